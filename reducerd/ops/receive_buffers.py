"""The kernel's receive buffers of data connections, kept to --max-inflight-bytes.

A frame is read only once its declared length is reserved from
--max-inflight-bytes (reducerd.core.limits.MemoryBudget); until then its
bytes wait in the socket's receive buffer, which the daemon's process does
not count. Left to the kernel, each buffer grows to hold the largest
payload that waits to be whole (4 MiB, reducerd.dataplane.recvside) and
further by autotuning (net.ipv4.tcp_rmem): 64 connections each sending a
4 MiB frame under a 16 MiB limit parked 240-256 MiB in host TCP memory,
15-16 times the limit.

So every data connection's buffer is set with SO_RCVBUF, which fixes it (the
kernel's autotuning stops for that socket) and which Linux doubles for its
bookkeeping: what a socket may hold unread is the doubled value, and that is
what is counted here. A socket starts at FLOOR_BYTES (accept, through its
handshake); once admitted it gets OPEN_BYTES where the total allows, what is
left where less, FLOOR_BYTES where nothing is. The total is
--max-inflight-bytes, one job's share half of it (a job token's job; the
daemon token's connections count against the total alone). So the unread
bytes of all data connections come to at most the limit plus
FLOOR_BYTES x 2 for each connection past the total: the caps' 4,096 data
connections at most, fewer under a low RLIMIT_NOFILE (reducerd.ops.descriptors).
A payload larger than half its socket's buffer is read in pieces
(SO_RCVLOWAT is capped there), as one above 4 MiB always was.

The kernel caps SO_RCVBUF at net.core.rmem_max (208 KiB on a stock Linux):
fixed there, an admitted connection's window would be smaller than its
autotuning gives it (tcp_rmem's largest, 6 MiB stock), too small for a
fast link's bandwidth-delay product. Where rmem_max is below OPEN_BYTES an
admitted connection's buffer is left to the kernel and counted at the most
autotuning can grow it to (tcp_rmem[2]); sockets in their handshake keep
the kernel's first size (tcp_rmem[1]: they read nothing past their HELLO,
and autotuning grows a buffer only as it is read), and those past the
total are fixed at the floor.

`set_receive_buffer` is the one function every accept path calls (the
Python data plane's, and the C loop's through it).
"""

from __future__ import annotations

import socket
import threading

__all__ = ["FLOOR_BYTES", "OPEN_BYTES", "JOB_SHARE", "set_receive_buffer", "kernel_limits",
           "ReceiveBuffers"]

# SO_RCVBUF of a socket in its handshake or past the total (the kernel holds
# twice as much): a frame header and a loopback segment or two.
FLOOR_BYTES = 64 << 10
# SO_RCVBUF of an admitted connection where the total allows: the largest
# payload that waits in the kernel until whole (recvside.WHOLE_MAX).
OPEN_BYTES = 4 << 20
JOB_SHARE = 2  # one job's connections hold 1/2 of the total at most


def set_receive_buffer(sock: socket.socket | int, nbytes: int) -> int:
    """Fix the socket's receive buffer at `nbytes` (SO_RCVBUF); what the kernel
    may now hold unread (its doubled value, capped by net.core.rmem_max), or
    0 where the option is refused (nothing is then counted)."""
    owned = isinstance(sock, int)
    s = socket.socket(fileno=sock) if owned else sock
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)
        return int(s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    except OSError:
        return 0
    finally:
        if owned:
            s.detach()  # the descriptor stays the caller's


def kernel_limits() -> tuple[int, int]:
    """(net.core.rmem_max, tcp_rmem's largest): the most SO_RCVBUF may set, and
    the most autotuning grows a buffer to; (0, 0) where they cannot be read."""
    try:
        with open("/proc/sys/net/core/rmem_max") as f:
            rmem_max = int(f.read())
        with open("/proc/sys/net/ipv4/tcp_rmem") as f:
            autotune_max = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return rmem_max, autotune_max


class ReceiveBuffers:
    """The receive buffers granted to admitted data connections against
    `total_bytes`, in all and per job; thread-safe (the accept and handshake
    threads take, whichever thread ends a connection gives)."""

    def __init__(self, total_bytes: int, open_bytes: int = OPEN_BYTES,
                 floor_bytes: int = FLOOR_BYTES,
                 limits: tuple[int, int] | None = None) -> None:
        """`limits`: kernel_limits() (read here by default)."""
        self.total_bytes, self.open_bytes, self.floor_bytes = total_bytes, open_bytes, floor_bytes
        rmem_max, autotune_max = kernel_limits() if limits is None else limits
        # Whether an admitted connection's buffer is fixed at open_bytes, or
        # left to autotuning and counted at its most (module doc).
        self.fixes_open = rmem_max >= open_bytes or autotune_max <= 0
        self.autotune_bytes = autotune_max
        # _lock guards held_bytes, _jobs and _granted.
        self._lock = threading.Lock()
        self.held_bytes = 0  # the kernel's (doubled) sizes of the grants above the floor
        self._jobs: dict[str, int] = {}
        self._granted: dict[object, tuple[int, str | None]] = {}  # owner -> (bytes, job)

    def at_accept(self, sock: socket.socket | int) -> None:
        """A new socket, in its handshake: the floor (where buffers are fixed)."""
        if self.fixes_open:
            set_receive_buffer(sock, self.floor_bytes)

    def describe(self) -> str:
        """The log line's account of the sizes."""
        if self.fixes_open:
            return (f"receive buffers of {2 * self.open_bytes >> 10} KiB each (SO_RCVBUF "
                    f"{self.open_bytes >> 10} KiB, doubled by the kernel) while their total "
                    f"keeps to {self.total_bytes} bytes (--max-inflight-bytes), "
                    f"{2 * self.floor_bytes >> 10} KiB past it")
        return (f"receive buffers left to the kernel's autotuning (net.core.rmem_max is "
                f"below {self.open_bytes} bytes), each counted at {self.autotune_bytes} "
                f"bytes (tcp_rmem) while their total keeps to {self.total_bytes} bytes "
                f"(--max-inflight-bytes), {2 * self.floor_bytes >> 10} KiB past it")

    def admit(self, owner: object, sock: socket.socket | int, job: str | None) -> int:
        """An admitted connection's buffer: OPEN_BYTES where the total and its
        job's share allow, what is left where less, else the floor it has. What
        the kernel holds for it at most (doubled), for tests and the log."""
        with self._lock:
            free = self.total_bytes - self.held_bytes
            if job is not None:
                free = min(free, self.total_bytes // JOB_SHARE - self._jobs.get(job, 0))
            if not self.fixes_open:
                if free < self.autotune_bytes:
                    return set_receive_buffer(sock, self.floor_bytes)
                got = self.autotune_bytes  # the most the kernel lets it grow to
            else:
                want = min(self.open_bytes, free // 2)  # the kernel doubles it
                if want <= self.floor_bytes:
                    return 2 * self.floor_bytes
                got = set_receive_buffer(sock, want)
                if got <= 0:
                    return 0
            self.held_bytes += got
            if job is not None:
                self._jobs[job] = self._jobs.get(job, 0) + got
            self._granted[owner] = (got, job)
            return got

    def release(self, owner: object) -> None:
        """The connection ended: its grant goes back (once; nothing if none)."""
        with self._lock:
            got, job = self._granted.pop(owner, (0, None))
            self.held_bytes -= got
            if job is not None and got:
                held = self._jobs.pop(job, 0) - got
                if held > 0:
                    self._jobs[job] = held
