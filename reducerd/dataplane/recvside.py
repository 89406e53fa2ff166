"""A socket's receive side as the data plane's loop reader uses it (Linux).

SO_RCVLOWAT is the fewest bytes that make the socket readable, so the loop
wakes once for a payload's rest, not for every segment that arrives.
Setting it also grows the socket's receive buffer to hold that much, and so
the window TCP offers the client; FIONREAD says how much the kernel holds.
Together they let a payload wait in the kernel until it is whole, then be
received by one call into a buffer allocated only then (reducerd.dataplane.loop_reader).
"""

from __future__ import annotations

import array
import fcntl
import socket
import termios

__all__ = ["ReceiveSide", "WHOLE_MAX", "OPEN_WINDOW_BYTES"]

_RCVLOWAT = getattr(socket, "SO_RCVLOWAT", None)
# The largest low-water mark for a payload read in pieces.
_PIECES_LOWAT_MAX = 1 << 20
# Payloads up to this size wait in the kernel until they are whole; the
# kernel caps SO_RCVLOWAT at half its largest receive buffer (tcp_rmem), and
# a payload above that cap is read in pieces.
WHOLE_MAX = 4 << 20 if _RCVLOWAT is not None else 0
# The receive buffer a connection is given before its first frame: room for
# the largest payload that waits to be whole. Grown only once a header is
# read, the window would stay as small as it was (no window update goes out
# while nothing is read), and the wait would end early with part of it. An
# allowance, not an allocation: the kernel takes memory as data arrives, and
# TCP's own autotuning grows a busy socket's buffer further (tcp_rmem).
OPEN_WINDOW_BYTES = WHOLE_MAX

class ReceiveSide:
    """Non-blocking receives and the low-water mark of one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.lowat = 1
        self._count = array.array("i", [0])

    def open_window(self) -> None:
        """Grow the receive buffer to OPEN_WINDOW_BYTES (it never shrinks back)."""
        self.set_lowat(OPEN_WINDOW_BYTES)
        self.set_lowat(1)

    def recv(self, view: memoryview) -> int | None:
        """Bytes received into `view` without waiting; None: none there yet."""
        try:
            return self.sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None

    def queued(self) -> int:
        """Bytes the kernel holds, ready to be received."""
        fcntl.ioctl(self.fd, termios.FIONREAD, self._count, True)
        return self._count[0]

    def wake_when_whole(self, nbytes: int) -> None:
        """Readable once `nbytes` are there (or the kernel cannot hold them)."""
        self.set_lowat(nbytes)

    def wake_for_rest(self, missing: int) -> None:
        """A payload read in pieces: readable once its rest is there, or
        _PIECES_LOWAT_MAX of it."""
        self.set_lowat(min(missing, _PIECES_LOWAT_MAX))

    def set_lowat(self, nbytes: int) -> None:
        if _RCVLOWAT is not None and nbytes != self.lowat:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, _RCVLOWAT, max(1, nbytes))
                self.lowat = nbytes
            except OSError:
                pass
