"""A data-plane connection's bytes on a non-blocking socket, plain or under TLS.

Receiving fills the caller's buffer (recv_into: a frame's payload lands where
its shard's data will stay, no copy); sending keeps a queue of buffers and
the offset into the first, so a partial send resumes where it stopped when
the socket is writable again (a reply's frame is queued as it is, no copy).

Under TLS the socket's bytes go through reducer_wire.tls.TlsChannel's memory
BIOs: encrypted bytes received are fed to it and plaintext read out; records
it writes (the handshake's, replies', a TLS 1.3 key update's) are queued in
the order it wrote them. Plaintext it holds is not seen by select(), so the
connection reads on until `recv_into` says it would block.
"""

from __future__ import annotations

import socket
import ssl
from collections import deque

from reducer_wire.tls import TlsChannel

__all__ = ["Wire", "TLS_PIECE_BYTES"]

# Encrypted bytes taken from the socket per call; plaintext encrypted per step
# (a large reply is encrypted as it is sent, not all at once).
_RAW_RECV_BYTES = 256 << 10
TLS_PIECE_BYTES = 256 << 10


class Wire:
    """One connection's socket (non-blocking), used by its I/O thread alone."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls: TlsChannel | None = None
        self._out: deque[memoryview] = deque()  # to send, in order
        self._offset = 0  # bytes of _out[0] already sent
        self.write_closed = False  # we shut our sending side: nothing more is queued
        self.received_bytes = 0  # plaintext, for the I/O thread's fairness

    def start_tls(self, context: ssl.SSLContext) -> None:
        self.tls = TlsChannel(self.sock, context, server_side=True)

    @property
    def pending(self) -> bool:
        """Whether bytes wait to be sent."""
        return bool(self._out)

    def recv_into(self, view: memoryview) -> int | None:
        """Up to len(view) bytes into `view`: a count, 0 at the end of the
        stream, None when none are there yet. OSError when it broke."""
        if self.tls is None:
            try:
                n = self.sock.recv_into(view)
            except BlockingIOError:
                return None
            self.received_bytes += n
            return n
        while True:
            got = self.tls.read_into(view)
            self.take_records()  # e.g. a key update to answer
            if got is not None:
                self.received_bytes += got
                return got
            pulled = self.pull()
            if not pulled:
                return None if pulled is None else 0

    def pull(self) -> bool | None:
        """Move encrypted bytes from the socket into the TLS state: True if
        some came, None if none are there yet, False at the end of the stream."""
        assert self.tls is not None
        try:
            raw = self.sock.recv(_RAW_RECV_BYTES)
        except BlockingIOError:
            return None
        if not raw:
            return False
        self.tls.feed(raw)
        return True

    def send(self, data: bytes | memoryview) -> None:
        """Queue `data` (under TLS: the records carrying it) for flush()."""
        if self.write_closed:
            return
        if self.tls is not None:
            data = self.tls.encrypt(data)
        if len(data):
            self._out.append(memoryview(data).cast("B"))

    def take_records(self) -> None:
        """Queue the records the TLS state wrote on its own (handshake, alerts)."""
        assert self.tls is not None
        records = self.tls.take_records()
        if records and not self.write_closed:
            self._out.append(memoryview(records))

    def flush(self) -> tuple[bool, bool]:
        """Send what is queued as far as the socket takes it: (whether any
        byte went, whether all did). OSError when it broke."""
        moved = False
        while self._out:
            view = self._out[0]
            try:
                n = self.sock.send(view[self._offset:])
            except BlockingIOError:
                return moved, False
            moved = moved or n > 0
            self._offset += n
            if self._offset >= len(view):
                self._out.popleft()
                self._offset = 0
        return moved, True

    def close_write(self) -> None:
        """Our sending side is shut: drop what was still queued."""
        self.write_closed = True
        self._out.clear()
        self._offset = 0
