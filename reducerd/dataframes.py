"""A data-plane connection's reading side, second part: frames (reducerd.datahello
has the states and the handshake).

A frame's declared length is reserved from the MemoryBudget before its
payload is read; while there is no room the connection reads nothing and
looks again as room comes back (RESERVE); then it waits, not reading, for
room among the frames waiting for the loop thread and the replies waiting to
be sent (ROOM); only then is the payload read, into a fresh buffer that the
shard's data will stay a view of (PAYLOAD), within the frame timeout.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
import numpy as np
from reducer_wire.framing import SHARD, FrameError, parse_header, truncated

from reducerd.datahello import (
    DONE,
    DROP,
    HANDSHAKE,
    HEADER,
    HELLO_BODY,
    HELLO_HEADER,
    PAYLOAD,
    PREFACE,
    READING,
    RESERVE,
    ROOM,
    SKIP,
    TLS,
    HelloReader,
)
from reducerd.session import daemon_fault_message, decode_request

__all__ = ["FrameReader", "READING", "DONE", "ROOM", "PAYLOAD", "RESERVE", "QUEUED_FRAMES",
           "BACKLOG_FRAMES", "UNSENT_FRAMES", "UNSENT_BYTES", "RESERVE_WAIT_S", "LINGER_S"]

log = logging.getLogger("reducerd")

QUEUED_FRAMES = 8  # a connection's frames waiting for the loop thread
BACKLOG_FRAMES = 16  # the plane's
UNSENT_FRAMES = 64  # a connection's replies waiting to be sent, and their bytes
UNSENT_BYTES = 16 << 20
RESERVE_WAIT_S = 5.0
# After the daemon's last frame, how long the client gets to close its side
# (closing with unread input would reset the connection and lose that frame).
LINGER_S = 5.0
# A reader waiting for room looks again this often anyway (it is woken when
# room frees; this only bounds a wake-up that went astray).
_ROOM_RETRY_S = 1.0
_PUMP_BYTES = 1 << 20  # read by one connection before the thread serves the others


class FrameReader(HelloReader):
    """The reading side of reducerd.dataconn.Connection."""

    def writer_done(self) -> bool:
        raise NotImplementedError

    def broke(self, exc: OSError) -> None:
        raise NotImplementedError

    def _accept(self, shard: Any, length: int) -> None:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self._ending = False  # we asked the loop to end the stream: read and drop the rest
        self._skip_left = self._piece_got = 0

    def read(self) -> None:
        """Step while there is something to read and room to read it."""
        self._pump_until = self.wire.received_bytes + _PUMP_BYTES
        while self.state != DONE and not self.closed:
            state = self.state
            try:
                if not self._STEPS[state](self):
                    return
            except FrameError as exc:  # the byte stream cannot be followed: end with why
                self.give_back()
                self.plane.call(self.stream.end, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                self.drop(None)
            except OSError as exc:
                self.broke(exc)
                return
            except Exception as exc:  # e.g. MemoryError: our fault; end the stream and say so
                log.exception("data connection %s: reader failed", self.stream.peer)
                self.give_back()
                if self.registered and state != DROP:
                    self.plane.call(self.stream.end, grpc.StatusCode.INTERNAL,
                                    daemon_fault_message(exc))
                    self.drop(None)
                elif self.registered:
                    self.reader_done()
                else:
                    self.close()

    def expire(self, now: float) -> bool:
        """The current state's deadline passed; whether to step again."""
        state = self.state
        if state in HANDSHAKE:  # closed without a word: no linger for it
            log.info("data plane: %s did not end its handshake within %g s", self.stream.peer,
                     self.plane.limits.handshake_timeout_s)
            self.close()
            return False
        if state == PAYLOAD:
            got, length = self._got, self._length
            self.give_back()
            self.plane.call(self.stream.end, grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"a frame of {length} bytes did not arrive within "
                            f"{self.plane.limits.frame_timeout_s:g} s of its header ({got} "
                            f"of {length} bytes arrived by the deadline)")
            self.drop(LINGER_S)
            return True
        if state == DROP:
            self.reader_done()
            return False
        return state in (RESERVE, ROOM)  # they look again, and know their deadline

    def give_back(self) -> None:
        """Give back what the current frame holds (its reservation, its room)."""
        if self.state in (ROOM, PAYLOAD):
            self.plane.budget.give_transport(self._length)
            if self.state == PAYLOAD:
                self.plane.room.release(self)  # type: ignore[arg-type]
            self.plane.pool.room_given()
        elif self.state == RESERVE:
            self.io.reserving.pop(self, None)
        self.enter(DONE)

    def drop(self, timeout_s: float | None) -> None:
        """Read and drop until the client closes (or `timeout_s`, or the writer's
        linger shuts the socket down)."""
        self.enter(DROP, deadline=None if timeout_s is None else time.monotonic() + timeout_s)

    # -- frames ---------------------------------------------------------------

    def _step_header(self) -> bool:
        full = self._fill()
        if full is False:
            return False
        if full is None:
            if self._got:
                raise truncated(self._got, len(self._header))
            # The client half-closed: answer what is open, then OK.
            self.plane.call(self.stream.half_close)
            self.reader_done()
            return False
        kind, length = parse_header(self._header, self.plane.limits.max_message_bytes)
        if self._ending or self.stream.ended or self.writer_done():
            self._skip(length)  # so the client sees our status, not a reset
            return True
        if kind != SHARD:
            self._ending = True
            self.plane.call(self.stream.end, grpc.StatusCode.INVALID_ARGUMENT,
                            f"unexpected frame kind {kind} after HELLO")
            self._skip(length)
            return True
        self._length = length
        self.enter(RESERVE, deadline=time.monotonic() + RESERVE_WAIT_S)
        return True

    def _step_reserve(self) -> bool:
        """Reserve the frame's declared length, without blocking: try, and while
        there is no room, wait (not reading) until room comes back or RESERVE_WAIT_S."""
        budget, length = self.plane.budget, self._length
        if budget.fits_transport(length) and budget.reserve(length, 0.0):
            self.io.reserving.pop(self, None)
            self.enter(ROOM, deadline=time.monotonic() + _ROOM_RETRY_S)
            return True
        assert self.deadline is not None
        if length > budget.limit_bytes or time.monotonic() >= self.deadline:
            self.io.reserving.pop(self, None)
            self.plane.call(self.stream.end, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            self._no_room(length))
            self.drop(LINGER_S)
            return True
        self.io.reserving[self] = None
        return False

    def _step_room(self) -> bool:
        """Wait for room before reading the payload: the loop is behind (this
        connection's credit, the plane's backlog) or the client does not read
        its replies. Nothing more is taken once the writer is gone."""
        if self.writer_done():
            self.give_back()
            self._skip(self._length)
            return True
        if not self.outbox.below(UNSENT_FRAMES, UNSENT_BYTES):  # looked at again as replies go
            self.plane.room.pass_on(self)  # type: ignore[arg-type]
            self.deadline = time.monotonic() + _ROOM_RETRY_S
            return False
        if not self.plane.room.take(self):  # type: ignore[arg-type]  # woken by Room
            self.deadline = time.monotonic() + _ROOM_RETRY_S
            return False
        self.state = PAYLOAD  # room is held from here: a MemoryError below gives it back
        self.enter(PAYLOAD, np.empty(self._length, np.uint8).data,
                   time.monotonic() + self.plane.limits.frame_timeout_s)
        return True

    def _step_payload(self) -> bool:
        full = self._fill()
        if full is False:
            return False
        assert self._buf is not None
        if full is None:
            raise truncated(self._got, len(self._buf))
        payload, length = self._buf, self._length
        self.enter(HEADER, self._header)  # what the frame holds is the loop's to give back
        self.plane.call(self._accept, decode_request(payload), length)
        # Not kept while waiting for the next header: with hundreds of
        # connections, each one's last frame would add up.
        del payload
        return True

    def _skip(self, length: int) -> None:
        """Read and drop `length` bytes (nothing is reserved for them)."""
        self._skip_left, self._piece_got = length, 0
        self.enter(SKIP)

    def _step_skip(self) -> bool:
        scratch = self.io.scratch
        while self._skip_left:
            if self.wire.received_bytes >= self._pump_until:
                self.io.again(self)
                return False
            piece = min(self._skip_left, len(scratch))
            n = self.wire.recv_into(scratch[:piece - self._piece_got])
            if n is None:
                return False
            if not n:
                if self._piece_got:
                    raise truncated(self._piece_got, piece)
                self.plane.call(self.stream.half_close)
                self.reader_done()
                return False
            self._piece_got += n
            if self._piece_got == piece:
                self._skip_left, self._piece_got = self._skip_left - piece, 0
        self.enter(HEADER, self._header)
        return True

    def _step_drop(self) -> bool:
        try:
            while True:
                if self.wire.received_bytes >= self._pump_until:
                    self.io.again(self)
                    return False
                n = self.wire.recv_into(self.io.scratch)
                if n is None:
                    return False
                if not n:
                    break
        except OSError:  # as good as the end
            pass
        self.reader_done()
        return False

    def _no_room(self, length: int) -> str:
        budget = self.plane.budget
        return (f"a frame of {length} bytes does not fit: the daemon holds {budget.held_bytes} "
                f"of its {budget.limit_bytes} bytes (--max-inflight-bytes) and none came free "
                f"within {RESERVE_WAIT_S:g} s; try again later")

    _STEPS: dict[int, Any] = {}


FrameReader._STEPS = {
    TLS: FrameReader._step_tls, PREFACE: FrameReader._step_preface,
    HELLO_HEADER: FrameReader._step_hello_header, HELLO_BODY: FrameReader._step_hello_body,
    HEADER: FrameReader._step_header, RESERVE: FrameReader._step_reserve,
    ROOM: FrameReader._step_room, PAYLOAD: FrameReader._step_payload,
    SKIP: FrameReader._step_skip, DROP: FrameReader._step_drop,
}
