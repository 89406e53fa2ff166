"""A plain-TCP data-plane connection's frames, read on the event loop's own thread.

Once a plain-TCP connection has passed its handshake (on its reader thread,
reducerd.dataplane.connection), the loop thread reads its frames itself: the loop's
selector watches the socket (loop.add_reader), a frame's header and payload
are received without blocking, and a whole shard goes to the session at
once: no thread per connection waits for frames, and no frame crosses
threads on its way to the table. Under TLS the connection keeps its reader
thread (reducerd.dataplane.connection).

The reader thread's bounds hold, each checked before a payload is read;
where one is not met the loop stops watching the socket (the frame stays in
the kernel and TCP slows the client) and looks again every WAIT_POLL_S:
- the job's share of the memory budget (job_has_room), while the writer lives;
- the frame's length reserved from the budget (within RESERVE_WAIT_S, else
  RESOURCE_EXHAUSTED; at once where it can never fit);
- fewer than UNSENT_FRAMES replies and UNSENT_BYTES unsent;
- at most BACKLOG_FRAMES payloads being received at once, plane-wide (each
  holds its frame's buffer): a connection waits its turn (PayloadSlots).
A payload must arrive within the frame timeout of its start (a timer, set
only for a payload that is not all there at once). A payload of at most
WHOLE_MAX bytes waits in the kernel until it is all there
(reducerd.dataplane.recvside): its buffer is allocated only then and filled by one
receive, so no buffer waits in the daemon for a slow payload's bytes, and a
stalled payload holds no receive slot. Where the kernel will not hold it all,
or the client ends or breaks inside it, it is read in pieces into its
buffer, with a slot.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import numpy as np
from reducer_wire.framing import FRAME_HEADER_BYTES, SHARD, FrameError, TruncatedFrame, parse_header

from reducerd.dataplane.base import (
    LINGER_S,
    RESERVE_WAIT_S,
    SKIP_BYTES,
    UNSENT_BYTES,
    UNSENT_FRAMES,
    Link,
    PayloadSlots,
)
from reducerd.dataplane.outbox import GONE
from reducerd.dataplane.recvside import WHOLE_MAX, ReceiveSide
from reducerd.service.session import daemon_fault_message, decode_request

__all__ = ["LoopReader", "WAIT_POLL_S", "FRAMES_PER_WAKE"]

log = logging.getLogger("reducerd")

# The bounds shared with the reader threads are reducerd.dataplane.base's.
WAIT_POLL_S = 0.02
# Frames one connection may take per wake-up before the others get theirs.
FRAMES_PER_WAKE = 4

HEADER, ADMIT, WHOLE, PAYLOAD, SKIP, DROP, DONE = range(7)


class LoopReader:
    """Reads one connection's frames on the loop thread (every method runs there)."""

    def __init__(self, conn: Link, slots: PayloadSlots) -> None:
        self.conn = conn
        self.plane = conn.plane
        self.stream = conn.stream
        self.sock = conn.sock
        self.fd = conn.sock.fileno()
        self.receive = ReceiveSide(conn.sock)
        self.loop = conn.plane.loop
        self.slots = slots
        self.state = HEADER
        self.header = bytearray(FRAME_HEADER_BYTES)
        self.got = 0  # of the header, then of the payload
        self.length = 0
        self.job: str | None = None
        self.payload: memoryview | None = None
        self.left = 0  # SKIP: bytes still to drop
        self.ending = False  # the stream was ended here: drop what follows
        self.watching = False
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.reserved = False
        self.slot = False
        self.reserve_deadline: float | None = None
        self.pressure_noted = False
        self.frame_deadline = 0.0
        self.in_pieces = self.waited_whole = False  # how this payload is read (module doc)
        self.scratch: memoryview | None = None

    def start(self) -> None:
        self.receive.open_window()
        self._watch()

    @property
    def wants_slot(self) -> bool:
        return self.state == ADMIT and not self.slot

    # -- the selector's side --------------------------------------------------

    def _watch(self) -> None:
        if not self.watching and self.state != DONE:
            self.loop.add_reader(self.fd, self._on_readable)
            self.watching = True

    def _unwatch(self) -> None:
        if self.watching:
            self.loop.remove_reader(self.fd)
            self.watching = False

    def _on_readable(self) -> None:
        try:
            for _ in range(FRAMES_PER_WAKE):
                if not self._step():
                    break
        except FrameError as exc:  # the byte stream cannot be followed any further
            self._give_back()
            self.stream.end(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self._start_drop(None)
        except OSError as exc:
            log.debug("data connection %s broke: %r", self.stream.peer, exc)
            self.conn.outbox.put_nowait(GONE)
            self.finish()
        except Exception as exc:  # e.g. MemoryError: our fault; end the stream and say so
            log.exception("data connection %s: reader failed", self.stream.peer)
            self._give_back()
            self.stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
            self._start_drop(None)
        if not self.paused:
            self._watch()

    def _pause(self) -> bool:
        """Stop reading; look again in WAIT_POLL_S."""
        self._unwatch()
        self.paused = True
        self._cancel_timer()
        self.timer = self.loop.call_later(WAIT_POLL_S, self._retry)
        return False

    def _retry(self) -> None:
        self.timer = None
        self.paused = False
        self._on_readable()

    def resume_with_slot(self) -> None:
        """PayloadSlots gave this reader the slot it waited for."""
        self.slot = True
        if self.state != ADMIT:  # ended meanwhile
            self._give_slot()
            return
        self.paused = False
        self._on_readable()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- the frames -----------------------------------------------------------

    def _step(self) -> bool:
        """Go as far as the socket allows: True once a whole frame was handled
        (another may follow), False when it must wait."""
        if self.state == HEADER:
            return self._read_header()
        if self.state == ADMIT:
            return self._admit()
        if self.state == WHOLE:
            return self._read_whole()
        if self.state == PAYLOAD:
            return self._read_payload()
        if self.state in (SKIP, DROP):
            return self._discard()
        return False

    def _read_header(self) -> bool:
        n = self.receive.recv(memoryview(self.header)[self.got:])
        if n is None:
            return False
        if n == 0:
            if self.got:
                raise TruncatedFrame(f"connection ended inside a frame header ({self.got} of "
                                     f"{FRAME_HEADER_BYTES} bytes)")
            self.stream.half_close()  # answer what is open, then OK
            self.finish()
            return False
        self.got += n
        if self.got < FRAME_HEADER_BYTES:
            return False
        self.got = 0
        kind, self.length = parse_header(self.header, self.plane.limits.max_message_bytes)
        if self.ending or self.stream.ended or self.conn.writer_done.is_set():
            return self._start_skip(self.length)  # so the client sees our status, not a reset
        if kind != SHARD:
            self.ending = True
            self.stream.end(grpc.StatusCode.INVALID_ARGUMENT,
                            f"unexpected frame kind {kind} after HELLO")
            return self._start_skip(self.length)
        self.job = self.stream.tenant  # fixed from here on: what is counted goes back
        self.reserve_deadline = None
        self.pressure_noted = False
        self.in_pieces = self.length > WHOLE_MAX
        self.waited_whole = False
        self.frame_deadline = 0.0  # set when the payload starts (_admit)
        self.state = ADMIT
        return self._admit()

    def _admit(self) -> bool:
        """The frame's bounds (module doc), then its payload."""
        budget, writer_gone = self.plane.budget, self.conn.writer_done.is_set()
        if not budget.job_has_room(self.job):
            if writer_gone:
                return self._start_skip(self.length)
            self._note_pressure()
            return self._pause()
        if not self.reserved:
            if not budget.try_reserve(self.length, self.job):
                self._note_pressure()
                now = time.monotonic()
                if self.reserve_deadline is None:
                    self.reserve_deadline = now + RESERVE_WAIT_S
                if self.length > budget.limit_bytes or now >= self.reserve_deadline:
                    self.stream.end(grpc.StatusCode.RESOURCE_EXHAUSTED, budget.no_room(
                        self.length, self.job, RESERVE_WAIT_S))
                    self._start_drop(LINGER_S)
                    return False
                return self._pause()
            self.reserved = True
        if not self.conn.outbox.below(UNSENT_FRAMES, UNSENT_BYTES):
            if writer_gone:
                self._give_back()
                return self._start_skip(self.length)
            return self._pause()
        if not self.frame_deadline:  # the payload starts: its deadline runs from here
            self.frame_deadline = time.monotonic() + self.plane.limits.frame_timeout_s
        if not self.in_pieces:
            self.state = WHOLE
            return self._read_whole()
        if not self.slot:
            if not self.slots.take(self):
                self._unwatch()
                self.paused = True  # resume_with_slot() goes on
                return False
            self.slot = True
        return self._start_payload()

    def _read_whole(self) -> bool:
        """Receive the payload once the kernel holds all of it; until then wait
        (SO_RCVLOWAT: one wake-up). Woken with less, it is read in pieces."""
        held = self.receive.queued()
        if held < self.length:
            if not self.waited_whole:  # the first look: wait for the rest
                self.waited_whole = True
                self.receive.wake_when_whole(self.length)
                self._start_frame_timer()
                return False
            self.in_pieces = True  # SO_RCVLOWAT capped, or the client ended or broke
            self.state = ADMIT
            return self._admit()
        return self._start_payload()

    def _start_payload(self) -> bool:
        self.payload = np.empty(self.length, np.uint8).data
        self.got = 0
        self.state = PAYLOAD
        return self._read_payload()

    def _read_payload(self) -> bool:
        assert self.payload is not None
        if self.got < self.length:
            n = self.receive.recv(self.payload[self.got:])
            if n is None:
                return self._await_rest()
            if n == 0:
                raise TruncatedFrame(f"connection ended inside a frame ({self.got} of "
                                     f"{self.length} bytes)")
            self.got += n
            if self.got < self.length:
                return self._await_rest()
        payload, length, job = self.payload, self.length, self.job
        self.payload = None
        self.got = 0
        self._cancel_timer()
        self.receive.set_lowat(1)
        self._give_slot()
        self.reserved = False
        self.state = HEADER
        try:
            self.plane.session.accept(decode_request(payload), self.stream)
        except Exception as exc:  # still a bug must end this stream, not hang its client
            log.exception("data connection %s: shard not taken", self.stream.peer)
            self.stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
        finally:
            # The table copied what it keeps: the frame's buffer is free.
            self.plane.budget.give_transport(length, job)
        return True

    def _await_rest(self) -> bool:
        """Wake when the rest of the payload is there, or at its deadline."""
        self.receive.wake_for_rest(self.length - self.got)
        self._start_frame_timer()
        return False

    def _start_frame_timer(self) -> None:
        if self.timer is None:
            self.timer = self.loop.call_at(
                self.loop.time() + max(0.0, self.frame_deadline - time.monotonic()),
                self._frame_late)

    def _frame_late(self) -> None:
        self.timer = None
        if self.state not in (WHOLE, PAYLOAD):
            return
        arrived = self.got if self.state == PAYLOAD else min(self.receive.queued(), self.length)
        self._give_back()
        self.stream.end(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"a frame of {self.length} bytes did not arrive within "
                        f"{self.plane.limits.frame_timeout_s:g} s of its header "
                        f"({arrived} of {self.length} bytes arrived by the deadline)")
        self._start_drop(LINGER_S)

    def _note_pressure(self) -> None:
        """A frame waits for memory: once per frame, for memory.HeapTrimmer."""
        if not self.pressure_noted:
            self.pressure_noted = True
            self.plane.budget.note_pressure()

    # -- dropping what the client sends ---------------------------------------

    def _start_skip(self, length: int) -> bool:
        """Read and drop the frame's `length` bytes (nothing is reserved for them)."""
        self.left = length
        self.state = SKIP if length else HEADER
        return True

    def _start_drop(self, linger_s: float | None) -> None:
        """Read and drop until the client closes (or `linger_s`, or the writer's
        linger shuts the socket down)."""
        self._cancel_timer()
        self.receive.set_lowat(1)
        self.state = DROP
        self.paused = False
        if linger_s is not None:
            self.timer = self.loop.call_later(linger_s, self.finish)

    def _discard(self) -> bool:
        if self.scratch is None:
            self.scratch = memoryview(bytearray(SKIP_BYTES))
        view = self.scratch if self.state == DROP else self.scratch[:min(self.left, SKIP_BYTES)]
        n = self.receive.recv(view)
        if n is None:
            return False
        if n == 0:
            if self.state == SKIP:  # as at a frame's end: the client half-closed
                self.stream.half_close()
            self.finish()
            return False
        if self.state == SKIP:
            self.left -= n
            if not self.left:
                self.state = HEADER
                return True
        return True

    # -- the end ----------------------------------------------------------------

    def _give_slot(self) -> None:
        if self.slot:
            self.slot = False
            self.slots.give()

    def _give_back(self) -> None:
        """Give back what a frame cut short held."""
        self.payload = None
        self._give_slot()
        self.slots.forget(self)
        if self.reserved:
            self.reserved = False
            self.plane.budget.give_transport(self.length, self.job)

    def finish(self) -> None:
        """Read no more (before the socket is closed: the writer's end)."""
        if self.state == DONE:
            return
        self._give_back()
        self._cancel_timer()
        self._unwatch()
        self.paused = True
        self.state = DONE
        self.conn.reader_done.set()
