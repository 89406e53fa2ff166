"""A data-plane connection's reading side, first part: states, buffers, the handshake.

Each state says what the next bytes are for; a step reads what is there and
moves on (True), or returns False to wait: for readiness (the socket is
selected for reading), for room (not selected: the bytes stay in the kernel,
and TCP slows the client), or for its deadline (a timer). The connection
(reducerd.dataconn) resumes it.

    TLS, PREFACE, HELLO_HEADER, HELLO_BODY   the handshake, by its deadline (here)
    HEADER -> RESERVE -> ROOM -> PAYLOAD     a frame: its bytes reserved, room
                                             for it, then its payload, in place
    SKIP, DROP                               bytes read and dropped: a frame
                                             after the stream ended, all input
                                             after a refusal       (reducerd.dataframes)
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING, Any

import grpc
from reducer_wire.framing import (
    FRAME_HEADER_BYTES,
    HELLO,
    MAGIC,
    MAX_HELLO_BYTES,
    FrameError,
    parse_header,
    truncated,
)

from reducerd.session import Stream

if TYPE_CHECKING:
    from reducerd.dataio import IoThread
    from reducerd.dataplane import DataPlane
    from reducerd.dataroom import WakingOutbox
    from reducerd.datawire import Wire

__all__ = ["HelloReader", "TLS", "PREFACE", "HELLO_HEADER", "HELLO_BODY", "HEADER", "RESERVE",
           "ROOM", "PAYLOAD", "SKIP", "DROP", "DONE", "HANDSHAKE", "READING"]

log = logging.getLogger("reducerd")

(TLS, PREFACE, HELLO_HEADER, HELLO_BODY, HEADER, RESERVE, ROOM, PAYLOAD, SKIP, DROP,
 DONE) = range(11)
HANDSHAKE = frozenset({TLS, PREFACE, HELLO_HEADER, HELLO_BODY})
READING = frozenset({*HANDSHAKE, HEADER, PAYLOAD, SKIP, DROP})  # selected for reading


class HelloReader:
    """The reading side's state, and its handshake; reducerd.dataconn.Connection
    supplies the attributes and the methods declared first."""

    plane: DataPlane
    io: IoThread
    wire: Wire
    stream: Stream
    outbox: WakingOutbox
    registered: bool
    closed: bool

    def reader_done(self) -> None:
        raise NotImplementedError

    def refuse(self, code: grpc.StatusCode, message: str) -> None:
        raise NotImplementedError

    def admitted(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __init__(self) -> None:
        self.state = DONE
        self.deadline: float | None = None  # of the current state, if it has one
        self._buf: memoryview | None = None  # being filled: _got bytes so far
        self._got = 0
        self._header = memoryview(bytearray(FRAME_HEADER_BYTES))
        self._handshake_deadline_s = 0.0
        self._kind = self._length = 0
        self._pump_until = 0  # wire.received_bytes at which to let the others read

    def enter(self, state: int, buf: Any = None, deadline: float | None = None) -> None:
        self.state = state
        self._buf = None if buf is None else memoryview(buf).cast("B")
        self._got = 0
        self.deadline = deadline

    def begin_handshake(self, deadline_s: float) -> None:
        """All of it (TLS, preface, HELLO) by `deadline_s` (time.monotonic())."""
        self._handshake_deadline_s = deadline_s
        if self.wire.tls is not None:
            self.enter(TLS, deadline=deadline_s)
        else:
            self.enter(PREFACE, bytearray(len(MAGIC)), deadline_s)

    # -- filling a buffer -----------------------------------------------------

    def _fill(self) -> bool | None:
        """Read into _buf: True once full, False to wait, None at the end of the stream."""
        buf = self._buf
        assert buf is not None
        while self._got < len(buf):
            if self.wire.received_bytes >= self._pump_until:
                self.io.again(self)
                return False
            n = self.wire.recv_into(buf[self._got:])
            if n is None:
                return False
            if not n:
                return None
            self._got += n
        return True

    def _refuse_early(self, code: grpc.StatusCode, message: str) -> bool:
        self.refuse(code, message)
        return False

    # -- the handshake --------------------------------------------------------

    def _step_tls(self) -> bool:
        assert self.wire.tls is not None
        try:
            done = self.wire.tls.step_handshake()
        except ssl.SSLError as exc:  # closed at once: its alert is not sent, as before
            log.info("data plane: TLS handshake with %s failed: %s", self.stream.peer, exc)
            self.close()
            return False
        self.wire.take_records()
        if done:
            self.enter(PREFACE, bytearray(len(MAGIC)), self._handshake_deadline_s)
            return True
        pulled = self.wire.pull()
        if pulled is None:
            return False
        if not pulled:
            raise ConnectionResetError("the peer closed the connection during the TLS handshake")
        return True

    def _step_preface(self) -> bool:
        full = self._fill()
        if full is False:
            return False
        if full and self._buf == MAGIC:
            self.enter(HELLO_HEADER, self._header, self._handshake_deadline_s)
            return True
        return self._refuse_early(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"not a reducer data-plane client: expected the preface "
                                  f"{MAGIC!r}")

    def _step_hello_header(self) -> bool:
        full = self._fill()
        if full is False:
            return False
        if full is None:
            if not self._got:
                return self._refuse_early(grpc.StatusCode.INVALID_ARGUMENT,
                                          "the first frame must be HELLO")
            return self._refuse_early(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"bad HELLO frame: {truncated(self._got, len(self._header))}")
        try:
            self._kind, length = parse_header(self._header, MAX_HELLO_BYTES)
        except FrameError as exc:
            return self._refuse_early(grpc.StatusCode.INVALID_ARGUMENT, f"bad HELLO frame: {exc}")
        self.enter(HELLO_BODY, bytearray(length), self._handshake_deadline_s)
        return True

    def _step_hello_body(self) -> bool:
        full = self._fill()
        if full is False:
            return False
        assert self._buf is not None
        if full is None:
            return self._refuse_early(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"bad HELLO frame: {truncated(self._got, len(self._buf))}")
        if self._kind != HELLO:
            return self._refuse_early(grpc.StatusCode.INVALID_ARGUMENT,
                                      "the first frame must be HELLO")
        # The HELLO's token binds the connection to its job (a job token).
        grant = self.plane.access.grant(bytes(self._buf))
        if grant is None:
            return self._refuse_early(grpc.StatusCode.UNAUTHENTICATED,
                                      "missing or wrong token in the data-plane HELLO")
        self.stream.job = grant.job
        refusal = self.plane.admit(self)  # type: ignore[arg-type]
        if refusal is not None:
            return self._refuse_early(*refusal)
        self.admitted()
        self.enter(HEADER, self._header)
        return True
