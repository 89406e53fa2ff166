"""Plain-TCP data-plane connections served by the C data loop (reducerd.dataplane._cplane).

Once a plain-TCP connection has passed its handshake and admission (on its
reader thread, as on the Python path), the C loop's thread reads its frames
and sends its replies: per frame, no Python runs until the shard itself
(header, limits, reservation, payload receive, reply send all in C, without
the GIL). Python sees the events it must: each frame's payload (the session
decodes, checks and takes it exactly as on the Python path), an end the C
loop decided (a bad frame, a frame timeout, no memory for a frame), the
client's half-close, and the connection's end. The C loop wakes the event
loop once per batch of events (an eventfd the asyncio loop watches), and
one wake-up takes them all.

The bounds are the Python path's (reducerd.dataread), kept in C: the job's
share of the MemoryBudget, each frame's reservation (RESERVE_WAIT_S, then
RESOURCE_EXHAUSTED with MemoryBudget.no_room's message), the frame timeout,
UNSENT_FRAMES and UNSENT_BYTES of replies waiting (frames Python has not
freed yet counted as replies to come), BACKLOG_FRAMES payloads alive
plane-wide, the send timeout, LINGER_S after the status frame.

TLS connections stay on the Python path (reducerd.dataconn): the C loop
would need its own TLS (OpenSSL) beside Python's ssl module, and TLS
deployments are the minority the plain path's figures do not depend on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Any

import grpc
from reducer_wire.framing import status_frame

from reducerd.outbox import END, GONE

if TYPE_CHECKING:
    from reducerd.limits import MemoryBudget

try:
    from reducerd.dataplane import _cplane
except ImportError:  # built without a C compiler: the Python path serves every connection
    _cplane = None  # type: ignore[assignment]

__all__ = ["CDataLoop", "LoopOutbox", "available"]

log = logging.getLogger("reducerd")

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def available(budget: Any) -> bool:
    """Whether the C loop can serve connections counted against `budget`."""
    return _cplane is not None and isinstance(budget, _cplane.Budget)


class LoopOutbox:
    """A C-loop connection's outbox: the session puts, the C loop sends.

    A reply's frame buffer is handed to the C loop, which keeps it alive
    until sent (or the connection is gone) and then gives its bytes back to
    the budget; END or a (code, message) item is the stream's status frame,
    sent after the replies queued before it. Used on the loop thread only.
    """

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self._job: str | None = None
        self._loop: CDataLoop | None = None
        self.id = 0
        self.fd = -1
        self.closed = False

    @property
    def job(self) -> str | None:
        return self._job

    @job.setter
    def job(self, job: str | None) -> None:
        """The job its bytes count against: set once (Stream.count_against)."""
        if self._job is None and job is not None:
            self._job = job
            if self._loop is not None and not self.closed:
                self._loop.native.set_job(self.id, self.fd, job)

    def attach(self, loop: CDataLoop, conn_id: int, fd: int) -> None:
        self._loop, self.id, self.fd = loop, conn_id, fd

    def put_nowait(self, item: Any, priority: int = 0) -> None:
        loop = self._loop
        if self.closed or loop is None or item is GONE:
            return
        if item is END:
            loop.native.end(self.id, self.fd, status_frame(grpc.StatusCode.OK, ""))
        elif isinstance(item, tuple):
            loop.native.end(self.id, self.fd, status_frame(*item))
        else:
            frame = item.frame
            self._budget.take_transport(len(frame), self._job)
            loop.native.send(self.id, self.fd, frame, priority, self._job, len(frame))

    def discard(self) -> None:
        """Nothing to do: the C loop gives back what it held at the connection's end."""
        self.closed = True


class CDataLoop:
    """The C loop and the connections it serves (every method on the loop thread)."""

    def __init__(self, plane: Any, loop: asyncio.AbstractEventLoop, budget: MemoryBudget,
                 *, max_message_bytes: int, frame_timeout_s: float, send_timeout_s: float,
                 linger_s: float, reserve_wait_s: float, payload_slots: int,
                 unsent_frames: int, unsent_bytes: int) -> None:
        assert _cplane is not None
        self.plane = plane
        self.loop = loop
        self.budget = budget
        self.reserve_wait_s = reserve_wait_s
        self.native = _cplane.Loop(budget, max_message_bytes, frame_timeout_s, send_timeout_s,
                                   linger_s, reserve_wait_s, payload_slots, unsent_frames,
                                   unsent_bytes)
        self._ids = itertools.count(1)
        self._conns: dict[int, Any] = {}
        self._started = False

    def _start(self) -> None:
        self.native.start()
        self.loop.add_reader(self.native.fileno(), self._on_events)
        self._started = True

    def adopt(self, conn: Any) -> None:
        """Serve `conn` (handshake and admission done; its stream is open)."""
        if not self._started:
            self._start()
        conn_id = next(self._ids)
        fd = conn.sock.fileno()
        self._conns[conn_id] = conn
        conn.outbox.attach(self, conn_id, fd)
        self.native.add(conn_id, fd, conn.outbox.job)

    def stop(self) -> None:
        """Stop the C thread (after every stream was ended); close what is left."""
        if not self._started:
            return
        self._on_events()
        self.loop.remove_reader(self.native.fileno())
        self.native.stop()
        self._started = False
        for conn_id in list(self._conns):
            self._closed(conn_id)

    def _on_events(self) -> None:
        session = self.plane.session
        events = self.native.take()
        for i in range(len(events)):
            # Taken out of the list: a payload is freed as soon as it is handled.
            event, events[i] = events[i], None
            kind, conn_id = event[0], event[1]
            conn = self._conns.get(conn_id)
            if conn is None:
                continue
            stream = conn.stream
            try:
                if kind == _cplane.EV_FRAME:
                    payload = event[2]
                    del event
                    if not stream.ended:
                        self._accept(session, conn, memoryview(payload))
                    del payload  # the table copied what it keeps: its memory comes back
                elif kind == _cplane.EV_END:
                    stream.end(_CODES[event[2]], event[3])
                elif kind == _cplane.EV_NO_ROOM:
                    stream.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               self.budget.no_room(event[2], event[3], self.reserve_wait_s))
                elif kind == _cplane.EV_HALF_CLOSE:
                    stream.half_close()
                elif kind == _cplane.EV_CLOSED:
                    self._closed(conn_id)
            except Exception:  # as the loop's own handler would: log, take the rest
                log.exception("reducerd fault in a C data-loop event for %s", stream.peer)

    def _accept(self, session: Any, conn: Any, payload: memoryview) -> None:
        from reducerd.session import daemon_fault_message, decode_request

        try:
            session.accept(decode_request(payload), conn.stream)
        except Exception as exc:  # still a bug must end this stream, not hang its client
            log.exception("data connection %s: shard not taken", conn.stream.peer)
            conn.stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))

    def _closed(self, conn_id: int) -> None:
        """The C loop is done with the connection: close it, forget its stream."""
        conn = self._conns.pop(conn_id)
        conn.outbox.discard()
        conn.reader_done.set()
        conn.writer_done.set()
        conn.sock.close()
        self.plane.forget(conn)
        self.plane.session.close_stream(conn.stream)
