"""Plain-TCP connections served by the C data loop (reducerd.dataplane._cplane).

With the C loop (the data_loop setting "c"), a plain-TCP connection's frames
are read, and its replies sent, by one C thread over epoll once its
handshake is over (on its reader thread, reducerd.dataplane.connection) and it
was admitted: no Python runs per byte or per send. Python sees one event per
whole frame, and one per end, half-close or close; the C loop wakes the event
loop once per batch of them (an eventfd the loop watches), and the loop thread
takes them all (CDataLoop._on_events). Under TLS a connection keeps its reader
and writer threads.

The bounds are the Python loop reader's (reducerd.dataplane.loop_reader), with
the same values (reducerd.dataplane.base), kept in C: the job's share of the
budget and the frame's reservation (through the C MemoryBudget,
reducerd.core._budget), the unsent-reply bound (replies queued in C plus frames
Python holds), BACKLOG_FRAMES payloads alive plane-wide, a payload of at most
WHOLE_MAX bytes waiting in the kernel until whole, the frame, send and linger
deadlines. What C decides is reported as the Python path would say it: an
EV_END carries framing's message and the status code, EV_NO_ROOM is ended with
MemoryBudget.no_room's message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import grpc
from reducer_wire.framing import status_frame

from reducerd.core.limits import MemoryBudget
from reducerd.dataplane.base import (
    BACKLOG_FRAMES,
    LINGER_S,
    RESERVE_WAIT_S,
    UNSENT_BYTES,
    UNSENT_FRAMES,
    ConnectionLimits,
    Link,
)
from reducerd.dataplane.outbox import GONE
from reducerd.service.session import END, Session, daemon_fault_message, decode_request

try:
    from reducerd.dataplane import _cplane
except ImportError:  # not built: the Python loop reads every connection
    _cplane = None  # type: ignore[assignment]

__all__ = ["CDataLoop", "LoopOutbox", "c_loop_available"]

log = logging.getLogger("reducerd")

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_OK_FRAME = status_frame(grpc.StatusCode.OK, "")


def c_loop_available(budget: Any) -> str | None:
    """Why the C loop cannot serve with `budget`, or None where it can."""
    if _cplane is None:
        return "reducerd.dataplane._cplane is not built"
    from reducerd.core import _budget

    if not isinstance(budget, _budget.Budget):
        return "the memory budget is the Python one (reducerd.core._budget is not built)"
    return None


class LoopOutbox:
    """A connection's outbox on the C loop: replies go to the loop's queue.

    Put on the loop thread only. A reply's bytes are taken from the budget
    when put (as ThreadOutbox counts them) and given back by the C loop once
    it is sent or dropped. Items put before the connection is on the loop
    (an end from a stop between its admission and its adoption) wait here.
    """

    def __init__(self, budget: MemoryBudget, loop: Any, conn_id: int, fd: int,
                 job: str | None) -> None:
        self._budget = budget
        self._loop = loop
        self._id = conn_id
        self._fd = fd
        self._job = job
        self._pending: list[tuple[Any, int]] | None = []  # None once on the loop
        self.closed = False

    @property
    def job(self) -> str | None:
        return self._job

    @job.setter
    def job(self, job: str | None) -> None:
        """Stream.count_against: the job its frames and replies count against, once."""
        if self._job is not None or job is None:
            return
        self._job = job
        if self._pending is None and not self.closed:
            self._call(self._loop.set_job, self._id, self._fd, job)

    def attach(self) -> None:
        """The connection is on the loop: what waited goes to it."""
        pending, self._pending = self._pending or [], None
        for item, priority in pending:
            self.put_nowait(item, priority)

    def put_nowait(self, item: Any, priority: int = 0) -> None:
        if self.closed or item is GONE:
            return
        if self._pending is not None:
            self._pending.append((item, priority))
            return
        if item is END:
            self._call(self._loop.end, self._id, self._fd, _OK_FRAME)
        elif isinstance(item, tuple):
            self._call(self._loop.end, self._id, self._fd, status_frame(*item))
        else:
            frame = item.frame
            self._budget.take_transport(len(frame), self._job)
            if not self._call(self._loop.send, self._id, self._fd, frame, priority, self._job,
                              len(frame)):
                self._budget.give_transport(len(frame), self._job)

    def _call(self, method: Any, *args: Any) -> bool:
        try:
            method(*args)
            return True
        except RuntimeError:  # the C loop stopped: the daemon is going
            self.closed = True
            return False


class CDataLoop:
    """The C loop thread and the connections on it, as the plane uses them
    (every method but outbox_for runs on the event loop's thread)."""

    def __init__(self, session: Session, loop: asyncio.AbstractEventLoop,
                 budget: MemoryBudget, limits: ConnectionLimits) -> None:
        assert _cplane is not None
        self.session = session
        self.loop = loop
        self.budget = budget
        self.c = _cplane.Loop(budget, limits.max_message_bytes, limits.frame_timeout_s,
                              limits.send_timeout_s, LINGER_S, RESERVE_WAIT_S, BACKLOG_FRAMES,
                              UNSENT_FRAMES, UNSENT_BYTES)
        self._ids = itertools.count(1)
        self.links: dict[int, Any] = {}  # id -> the Connection it serves
        self._started = False

    def start(self) -> None:
        self.c.start()
        self.loop.add_reader(self.c.fileno(), self._on_events)
        self._started = True

    def outbox_for(self, conn: Link) -> LoopOutbox:
        """The outbox a connection uses once on the loop (its reader thread,
        at its admission, before anything can be put into it)."""
        conn_id = next(self._ids)
        conn.c_id = conn_id
        return LoopOutbox(self.budget, self.c, conn_id, conn.sock.fileno(),
                          conn.stream.outbox.job)

    def adopt(self, conn: Any) -> None:
        """Read the connection's frames from here on."""
        conn_id = conn.c_id
        self.links[conn_id] = conn
        try:
            self.c.add(conn_id, conn.sock.fileno(), conn.stream.outbox.job)
        except RuntimeError:  # stopped: the daemon is going
            self._closed(conn_id)
            return
        conn.stream.outbox.attach()

    def stop(self) -> None:
        """Stop the C thread; close the connections still on it."""
        if not self._started:
            return
        self._started = False
        self.loop.remove_reader(self.c.fileno())
        self.c.stop()
        for conn_id in list(self.links):
            self._closed(conn_id)

    def _on_events(self) -> None:
        for event in self.c.take():
            kind, conn_id = event[0], event[1]
            conn = self.links.get(conn_id)
            if conn is None:
                continue
            try:
                if kind == _cplane.EV_FRAME:
                    self._frame(conn, event[2])
                elif kind == _cplane.EV_END:
                    conn.stream.end(_CODES[event[2]], event[3])
                elif kind == _cplane.EV_NO_ROOM:
                    conn.stream.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    self.budget.no_room(event[2], event[3], RESERVE_WAIT_S))
                elif kind == _cplane.EV_HALF_CLOSE:
                    conn.stream.half_close()
                elif kind == _cplane.EV_CLOSED:
                    self._closed(conn_id)
            except Exception:  # as the loop's own handler would: log, take the rest
                log.exception("reducerd fault in a C data-loop event %r", event[:2])

    def _frame(self, conn: Any, payload: Any) -> None:
        stream = conn.stream
        try:
            self.session.accept(decode_request(memoryview(payload)), stream)
        except Exception as exc:  # still a bug must end this stream, not hang its client
            log.exception("data connection %s: shard not taken", stream.peer)
            stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
        # Freeing the payload gives back its reservation and slot (the table
        # copied what it keeps).

    def _closed(self, conn_id: int) -> None:
        """The C loop is done with the connection (its end sent and lingered,
        or it broke): close it and forget it."""
        conn = self.links.pop(conn_id, None)
        if conn is None:
            return
        conn.stream.outbox.closed = True
        conn.reader_done.set()
        conn.writer_done.set()
        conn.sock.close()
        conn.plane.forget(conn)
        self.session.close_stream(conn.stream)
