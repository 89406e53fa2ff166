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

`set_receive_buffer` is the one function every accept path calls (the
Python data plane's, and the C loop's through it).
"""

from __future__ import annotations

import socket
import threading

__all__ = ["FLOOR_BYTES", "OPEN_BYTES", "JOB_SHARE", "set_receive_buffer", "ReceiveBuffers"]

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


class ReceiveBuffers:
    """The receive buffers granted to admitted data connections against
    `total_bytes`, in all and per job; thread-safe (the accept and handshake
    threads take, whichever thread ends a connection gives)."""

    def __init__(self, total_bytes: int, open_bytes: int = OPEN_BYTES,
                 floor_bytes: int = FLOOR_BYTES) -> None:
        self.total_bytes, self.open_bytes, self.floor_bytes = total_bytes, open_bytes, floor_bytes
        # _lock guards held_bytes, _jobs and _granted.
        self._lock = threading.Lock()
        self.held_bytes = 0  # the kernel's (doubled) sizes of the grants above the floor
        self._jobs: dict[str, int] = {}
        self._granted: dict[object, tuple[int, str | None]] = {}  # owner -> (bytes, job)

    def at_accept(self, sock: socket.socket | int) -> None:
        """A new socket, in its handshake: the floor."""
        set_receive_buffer(sock, self.floor_bytes)

    def admit(self, owner: object, sock: socket.socket | int, job: str | None) -> int:
        """An admitted connection's buffer: OPEN_BYTES where the total and its
        job's share allow, what is left where less, else the floor it has. What
        the kernel holds for it at most (doubled), for tests and the log."""
        with self._lock:
            free = self.total_bytes - self.held_bytes
            if job is not None:
                free = min(free, self.total_bytes // JOB_SHARE - self._jobs.get(job, 0))
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
