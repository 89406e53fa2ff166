"""One data-plane connection: a state machine run by its I/O thread (reducerd.dataio).

Reading: the handshake (reducerd.datahello), then frames (reducerd.dataframes);
writing (here): the replies the loop thread puts into its outbox, then the
last status. Nothing blocks: a read or send that would wait returns, and
readiness, a timer or a task posted by another thread resumes it.

Bounds kept here and in its reading steps (reducerd.dataplane has the
plane-wide ones):
- the handshake ends within the handshake timeout of the accept (a timer),
  however slowly its bytes come;
- a frame's declared length is reserved from the MemoryBudget before its
  payload is read (looked for again as room comes back, for up to
  RESERVE_WAIT_S, else RESOURCE_EXHAUSTED), and given back once the loop took
  the shard; its payload must arrive within the frame timeout;
- a connection reads a frame's payload only once it has fewer than
  QUEUED_FRAMES shards waiting for the loop, the plane fewer than
  BACKLOG_FRAMES (reducerd.dataroom.Room), and fewer than UNSENT_FRAMES
  replies or UNSENT_BYTES wait to be sent: meanwhile it reads nothing, the
  frame stays in the kernel, and TCP slows the client;
- a send that makes no progress for the send timeout ends the connection.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from reducer_wire.codec import DecodeError, ShardView
from reducer_wire.framing import shutdown_quietly, status_frame, tune_socket

from reducerd.dataframes import DONE, LINGER_S, READING, ROOM, FrameReader
from reducerd.dataroom import WakingOutbox
from reducerd.datawire import TLS_PIECE_BYTES, Wire
from reducerd.session import END, DecodeFault, Stream, daemon_fault_message

if TYPE_CHECKING:
    from reducerd.dataio import IoThread
    from reducerd.dataplane import DataPlane

__all__ = ["Connection", "ConnectionLimits", "GONE"]

log = logging.getLogger("reducerd")

# Bytes of replies one connection sends before the thread serves the others.
_PUMP_SEND_BYTES = 1 << 20
GONE = object()  # in an outbox: the connection broke, the writer stops without a status

# What the writer does: flush the handshake's records, send replies, send a
# refusal (then linger), or nothing more (its side is shut).
W_HANDSHAKE, W_RUN, W_REFUSE, W_DONE = range(4)


@dataclass(frozen=True)
class ConnectionLimits:
    max_message_bytes: int
    send_timeout_s: float
    handshake_timeout_s: float
    frame_timeout_s: float


class Connection(FrameReader):
    """A data-plane connection; only its I/O thread `io` runs its methods,
    apart from _wake_writer and wake_for_room (any thread) and _accept (loop)."""

    def __init__(self, plane: DataPlane, sock: socket.socket, peer: str, io: IoThread) -> None:
        self.plane = plane
        self.sock = sock
        self.io = io
        self.counted = True  # in io.load until io.remove
        self.wire = Wire(sock)
        self.accepted_s = time.monotonic()
        self.outbox = WakingOutbox(plane.budget, self._wake_writer)
        self.stream = Stream(f"tcp:{peer}", inband_errors=True, outbox=self.outbox,
                             frames=True)
        self.registered = False  # a Stream of the session (admitted)
        self.closed = False
        self.timer_at: float | None = None  # the I/O thread's next call of on_timer
        self.queued = 0  # Room's (under its lock): frames the loop has yet to take
        self.credit_wanted = False
        self._mask = 0  # what the socket is selected for
        self._read_again = False  # the writer made room the reader waits for
        self._writer = W_HANDSHAKE
        # Read by the loop thread: True while the writer found its outbox empty,
        # so that a put must wake it (else it takes the next item by itself).
        self._write_idle = False
        self._item: Any = None  # being sent
        self._plain: memoryview | None = None  # under TLS: its bytes yet to encrypt
        self._last = False
        self._blocked_since: float | None = None  # a send would block since
        self._linger_at: float | None = None
        self._lingered = False
        super().__init__()

    @property
    def peer(self) -> str:
        return self.stream.peer

    # -- from other threads ---------------------------------------------------

    def _wake_writer(self) -> None:
        """An item went into the outbox (loop thread, mostly)."""
        if self._write_idle:
            self._write_idle = False
            self.io.post(self._on_put)

    def wake_for_room(self) -> None:
        self.io.post(self._on_room)

    def _accept(self, shard: ShardView | DecodeError | DecodeFault, length: int) -> None:
        """Hand a shard to the session (loop thread)."""
        try:
            self.plane.session.accept(shard, self.stream)  # it answers its own faults
        except Exception as exc:  # still a bug must end this stream, not hang its client
            log.exception("data connection %s: shard not taken", self.peer)
            self.stream.end(grpc.StatusCode.INTERNAL, daemon_fault_message(exc))
        finally:
            self.plane.room.release(self)
            # The table copied what it keeps: the frame's buffer is free.
            self.plane.budget.give_transport(length)
            self.plane.pool.room_given()

    # -- events (I/O thread) --------------------------------------------------

    def start(self) -> None:
        try:
            tune_socket(self.sock)
            self.sock.setblocking(False)
            if self.plane.tls_context is not None:
                self.wire.start_tls(self.plane.tls_context)
        except OSError as exc:
            self.broke(exc)
            return
        self.begin_handshake(self.accepted_s + self.plane.limits.handshake_timeout_s)
        self._drive(read=True, write=False)

    def on_ready(self, mask: int) -> None:
        self._drive(read=bool(mask & selectors.EVENT_READ),
                    write=bool(mask & selectors.EVENT_WRITE))

    def resume(self) -> None:
        self._drive(read=True, write=True)

    def retry_reserve(self) -> None:
        self._drive(read=True, write=False)

    def _on_put(self) -> None:
        if not self.closed:
            self._drive(read=False, write=True)

    def _on_room(self) -> None:
        if self.closed or self.state != ROOM:  # the slot it was woken for: to the next
            self.plane.room.pass_on(self)
        else:
            self._drive(read=True, write=False)

    def on_timer(self, now: float) -> None:
        if self.closed:
            return
        read = self.deadline is not None and now >= self.deadline and self.expire(now)
        if (not self.closed and self._blocked_since is not None
                and self._writer in (W_RUN, W_REFUSE)
                and now >= self._blocked_since + self._send_timeout_s()):
            self._send_stalled()
        if self._linger_at is not None and now >= self._linger_at and not self.closed:
            read = self._linger(now) or read
        if not self.closed:
            self._drive(read=read, write=False)

    def evict(self) -> None:
        """Dropped in its handshake (more were handshaking, or the plane stops)."""
        if not self.closed and not self.registered:
            self.close()

    def abandon(self) -> None:
        """A fault of ours escaped a handler: give everything back and go."""
        if self.closed:
            return
        self.give_back()
        if self.registered:
            self.outbox.discard()
            self._finish()
        else:
            self.close()

    def _drive(self, read: bool, write: bool) -> None:
        if read:
            self.read()
        # Also what the reader queued (TLS records, a refusal), unless the socket is full.
        if not self.closed and (write or (self.wire.pending and self._blocked_since is None)):
            self._write()
        if not self.closed and self._read_again:
            self._read_again = False
            self.read()
            if not self.closed and self.wire.pending and self._blocked_since is None:
                self._write()
        self._settle()

    def _settle(self) -> None:
        """Select the socket for what its two sides wait for; time what has a deadline."""
        if self.closed:
            return
        mask = ((selectors.EVENT_READ if self.state in READING else 0)
                | (selectors.EVENT_WRITE if self._blocked_since is not None else 0))
        self.io.watch(self.sock, self, self._mask, mask)
        self._mask = mask
        due = [when for when in (self.deadline, self._linger_at) if when is not None]
        if self._blocked_since is not None and self._writer in (W_RUN, W_REFUSE):
            due.append(self._blocked_since + self._send_timeout_s())
        if due:
            self.io.schedule(self, min(due))

    # -- the end of the reading side (called by the reading steps) ------------

    def reader_done(self) -> None:
        self.enter(DONE)
        if not self.registered:  # a refusal's last drain
            self.close()
        elif self._writer == W_DONE:
            self._finish()

    def refuse(self, code: grpc.StatusCode, message: str) -> None:
        """Say why in a STATUS frame, shut our side, drain the client's for a while, close."""
        log.info("data plane: refused %s: %s", self.peer, message)
        self.plane.forget(self)
        self.enter(DONE)
        self._writer = W_REFUSE
        self.wire.send(status_frame(code, message))

    def admitted(self) -> None:
        """The handshake passed and the plane took it: replies may flow."""
        self.plane.call(self.plane.session.open_stream, self.stream)
        self._writer = W_RUN
        self._write_idle = True

    def writer_done(self) -> bool:
        return self._writer == W_DONE

    # -- writing --------------------------------------------------------------

    def _write(self) -> None:
        writer = self._writer
        try:
            if writer == W_RUN:
                self._write_replies()
            elif writer in (W_HANDSHAKE, W_REFUSE) and self._flush() and writer == W_REFUSE:
                self.wire.close_write()
                shutdown_quietly(self.sock, socket.SHUT_WR)
                self.drop(LINGER_S)
                self._read_again = True
        except OSError as exc:  # broken, or the peer reset
            log.debug("data connection %s broke while sending: %r", self.peer, exc)
            if writer == W_RUN:
                self._end_writer()
            else:
                self.close()

    def _flush(self) -> bool:
        """Send what is queued; whether all went (else the socket is selected for writing)."""
        moved, done = self.wire.flush()
        if done:
            self._blocked_since = None
        elif moved or self._blocked_since is None:
            self._blocked_since = time.monotonic()
        return done

    def _write_replies(self) -> None:
        queued = 0
        while True:
            if self.wire.pending and not self._flush():
                return
            if self._plain is not None:  # under TLS: encrypted as it goes
                piece, rest = self._plain[:TLS_PIECE_BYTES], self._plain[TLS_PIECE_BYTES:]
                self._plain = rest if len(rest) else None
                self.wire.send(piece)
                continue
            if self._item is not None:
                item, self._item = self._item, None
                if self._last:
                    self._end_writer()
                    return
                self.outbox.sent(item)
                del item  # a sent reply is not kept while waiting for the next one
                self.plane.pool.room_given()
                if self.state == ROOM:  # it may wait for fewer unsent replies
                    self._read_again = True
            if queued >= _PUMP_SEND_BYTES:
                self.io.again(self)
                return
            item = self.outbox.get_nowait()
            if item is None:
                self._write_idle = True  # then look once more: a put may have seen False
                item = self.outbox.get_nowait()
                if item is None:
                    return
                self._write_idle = False
            if item is GONE:
                self._end_writer()
                return
            if item is END:
                data = memoryview(status_frame(grpc.StatusCode.OK, ""))
                self._last = True
            elif isinstance(item, tuple):
                data = memoryview(status_frame(*item))
                self._last = True
            else:
                data = item.frame  # frame header and message: one buffer
            self._item = item
            queued += len(data)
            if self.wire.tls is None:
                self.wire.send(data)
            else:
                self._plain = data

    def _end_writer(self) -> None:
        """The writer's end (its last frame went, or sending broke): half-close,
        give the client LINGER_S to read our last frame and close its side
        (the reader drains meanwhile), then close."""
        self._writer = W_DONE
        self._write_idle = False  # puts no longer wake anyone
        self._item = self._plain = None
        self._blocked_since = None
        self.outbox.discard()
        self.plane.pool.room_given()
        self.wire.close_write()
        shutdown_quietly(self.sock, socket.SHUT_WR)
        if self.state == DONE:
            self._finish()
            return
        self._linger_at = time.monotonic() + LINGER_S
        self._read_again = True  # a reader waiting for room stops waiting

    def _linger(self, now: float) -> bool:
        if not self._lingered:  # shut the reading side too: the reader sees the end
            self._lingered = True
            shutdown_quietly(self.sock, socket.SHUT_RDWR)
            self._linger_at = now + LINGER_S
            return True
        self._linger_at = None  # the reader still did not end: close anyway
        self.give_back()
        self.reader_done()
        return False

    def _send_timeout_s(self) -> float:
        return self.plane.limits.send_timeout_s if self._writer == W_RUN else LINGER_S

    def _send_stalled(self) -> None:
        timeout_s = self._send_timeout_s()
        log.debug("data connection %s broke while sending: no progress for %g s",
                  self.peer, timeout_s)
        if self._writer == W_RUN:
            self._end_writer()
        else:
            self.close()

    # -- closing --------------------------------------------------------------

    def broke(self, exc: OSError) -> None:
        """Reading failed: the connection broke."""
        log.debug("data connection %s broke: %r", self.peer, exc)
        self.give_back()
        if self.registered:
            self.enter(DONE)
            self.outbox.put_nowait(GONE)
            self.reader_done()
        else:
            self.close()

    def _finish(self) -> None:
        self.close()
        self.plane.call(self.plane.session.close_stream, self.stream)

    def close(self) -> None:
        if self.closed:
            return
        self.give_back()
        self.closed = True
        try:
            self.io.watch(self.sock, self, self._mask, 0)
        except (KeyError, ValueError, OSError):
            pass
        self._mask = 0
        self._item = self._plain = None
        self.io.remove(self)
        self.plane.room.pass_on(self)
        self.plane.forget(self)
        self.sock.close()
