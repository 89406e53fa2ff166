"""One daemon: a long-lived link and one stream of shards at a time.

Shards go out through a queue that the transport drains on a thread of its
own, replies come back on the link's reader thread: any number of chunks in
flight. Replies find their chunks by (key, round, offset); the daemon reports
a failed chunk in band, so one bad chunk does not end the stream.

Transports (base.py): a Control (the daemon's brief status: its data port and
round timeout) and the transports tried in order at each stream. By default
the real ones: data_plane "auto" is [TCP data plane, gRPC] (gRPC takes over
where the daemon offers no data plane, it cannot be reached, or it refused it
for capacity), "tcp" or "grpc" insist on one; with TLS the data plane runs
over TLS too; the C loop's (loopstream.py) replaces plain TCP. Tests inject
the in-process fake (fake.py).

Recovery: when the stream breaks with a retryable status (errors.py: the
daemon restarted or went away, or refused the connection for capacity), the
link opens a new stream with a backoff that no chunk's deadline outlasts,
resends first its contribution to the last completed round of every chunk
that a daemon may still need (history.py: bounded by the daemon's round
timeout and a count), then every contribution still waiting. The daemon
counts each rank once, so ranks that missed a result get it and the others
ignore the repeat. Chunks still unanswered at their deadline fail with the
last reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import grpc
from reducer_wire.codec import ShardView

from reducer_client.env import DATA_PLANES
from reducer_client.errors import ReducerError, status_code_from_value, stream_error
from reducer_client.tls import TLSConfig
from reducer_client.transport.base import Control, NotOffered, Transport, TransportError
from reducer_client.transport.history import Message, SendHistory, Slot
from reducer_client.transport.order import LinkQueue, Turn
from reducer_client.transport.real import real_transports

__all__ = ["DaemonLink", "ReplyHandler", "PendingKey", "real_transports",
           "status_code_from_value", "DATA_PLANES"]

log = logging.getLogger("reducer_client")

# (key, round, offset): how a reply finds the chunk that waits for it.
PendingKey = tuple[str, int, int]
# Called on the reader thread with the reply, or with None and an error.
ReplyHandler = Callable[[ShardView | None, ReducerError | None], None]
_CLOSE = object()
# Backoff between stream attempts: 0, 50 ms, 100 ms, ... up to 1 s.
_FIRST_RETRY_DELAY_S, _MAX_RETRY_DELAY_S = 0.05, 1.0


class _Resume(NamedTuple):  # in an outbox: what a direct send left, sent before anything
    message: Message
    rest: memoryview


class _Pending(NamedTuple):
    handler: ReplyHandler
    message: Message
    deadline_s: float  # time.monotonic() after which no retry is made for it
    turn: Turn | None  # its first sending's: its reply frees the turn's credit


class DaemonLink:
    """The client's connection to one daemon; thread-safe."""

    def __init__(self, address: str, metadata: Sequence[tuple[str, str]] = (),
                 credentials: grpc.ChannelCredentials | None = None,
                 extra_options: Sequence[tuple[str, Any]] = (), *, token: str = "",
                 data_plane: str = "auto", transports: Sequence[Transport] | None = None,
                 control: Control | None = None, tls: TLSConfig | None = None) -> None:
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
        if credentials is not None and tls is None and data_plane == "tcp":
            raise ValueError("data_plane='tcp' with TLS needs tls (the TLSConfig, for the "
                             "data plane's TLS): use 'auto' or 'grpc', or give it")
        if transports is None:
            control, transports = real_transports(address, metadata, credentials,
                                                  extra_options, token, data_plane, tls)
        if control is None or not transports:
            raise ValueError("give a control and at least one transport, or neither")
        self.address = address
        self._control = control
        self._transports = list(transports)
        # What the current (or last) stream uses: "tcp", "grpc"; None before the first.
        self.transport: str | None = None
        self._warned: set[str] = set()  # transports whose fallback was logged
        # Why the last stream failed, or None once a reply came back since.
        self.last_error: ReducerError | None = None
        # _lock guards _pending, _history, _outbox, _direct, _retries, _alive_s,
        # _streams_opened, _closed and Message.queued; taken by callers of
        # send(), the reader thread and the transports' sender threads.
        # Handlers run outside it.
        self._lock = threading.Lock()
        self._pending: dict[PendingKey, _Pending] = {}
        self._history = SendHistory()
        self._outbox: LinkQueue | None = None
        self._retries = 0
        self._streams_opened = 0
        self._alive_s = time.monotonic()  # when the daemon last answered
        self._closed = False
        self._closing = threading.Event()  # cuts a backoff short at close()
        # The current stream where it takes direct sends (base.py), with its
        # outbox: valid while that is still self._outbox.
        self._direct: tuple[LinkQueue, Any] | None = None
        # Chunks sent directly, and how many of them left a rest (diagnostics).
        self.direct_sends = self.direct_rests = 0

    @property
    def reconnects(self) -> int:  # streams opened after the first (each resent what was open)
        return max(0, self._streams_opened - 1)

    def job_status(self, job: str) -> Any:  # the daemon's GetStatus (Control.job_status)
        return self._control.job_status(job)

    @property
    def history(self) -> SendHistory:  # what is kept for a resend (tests, diagnostics)
        return self._history

    def message(self, slot: Slot, nbytes: int) -> Message:
        """A buffer for an nbytes Shard of slot (key, offset): recycled when one is free."""
        with self._lock:
            return self._history.message(slot, nbytes)

    def send(self, key: PendingKey, message: Message, handler: ReplyHandler,
             deadline_s: float = float("inf"), turn: Turn | None = None,
             priority: int = 0) -> None:
        """Queue one encoded shard for the daemon; `handler` gets its reply, or
        the error it failed with (at the latest just after deadline_s). turn:
        its place in its operation's SendOrder (order.py), which its first
        sending waits for (and holds a credit of, until answered); a resend
        does not wait. priority: the shard's, which puts it before queued
        shards of a lower one (order.LinkQueue); a resend goes at 0."""
        with self._lock:
            if self._closed:
                raise ReducerError(grpc.StatusCode.CANCELLED, "client is closed")
            if self._outbox is None:
                self._open_stream()
            assert self._outbox is not None
            self._pending[key] = _Pending(handler, message, deadline_s, turn)
            if turn is None and self._send_now(self._outbox, message):
                return
            self._put(self._outbox, message, turn, priority)

    def route(self) -> tuple[Control, Transport]:  # the control, the first transport
        return self._control, self._transports[0]

    def use_data_plane(self, transport: Transport) -> None:  # first from now on
        with self._lock:
            self._transports[0] = transport

    def ensure_stream(self) -> None:  # open one now unless one is open (or opening)
        with self._lock:
            if not self._closed and self._outbox is None:
                self._open_stream()

    def completed_elsewhere(self, key: str, round_: int, answered: bool = False,
                            messages: Sequence[tuple[int, Message]] = ()) -> None:
        """Round round_ of `key` completed on the C loop (answered: here too): drop older
        contributions to it; keep `messages` ((offset, message)) for the next resend."""
        with self._lock:
            if answered:  # as a result on our own stream: the daemon is back
                self._alive_s, self._retries, self.last_error = time.monotonic(), 0, None
            self._history.supersede(key, round_)
            for offset, message in messages:
                self._history.completed((key, offset), round_, message, time.monotonic())

    def forget(self, keys: Iterable[PendingKey]) -> None:
        """Stop waiting for these chunks (their operation failed or timed out)."""
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def close(self) -> None:
        """Half-close the stream, close the transports (open chunks are not answered)."""
        with self._lock:
            self._closed = True
            outbox, self._outbox = self._outbox, None
        self._closing.set()
        if outbox is not None:
            outbox.put(_CLOSE)
        parts: list[Transport | Control] = [*self._transports, self._control]
        for part in {id(p): p for p in parts}.values():  # gRPC's is both: closed once
            part.close()

    # -- the stream -----------------------------------------------------------

    def _put(self, outbox: LinkQueue, message: Message, turn: Turn | None = None,
             priority: int = 0) -> None:
        """Queue `message` (caller holds _lock)."""
        message.queued += 1
        outbox.put(message if turn is None else (message, turn, priority), priority)

    def _send_now(self, outbox: LinkQueue, message: Message) -> bool:
        """Send `message` from this thread if the stream allows (base.py:
        direct sends) and its sender is idle; what the socket did not take
        goes first to the sender. Whether it did (caller holds _lock)."""
        direct = self._direct
        if direct is None or direct[0] is not outbox or not outbox.idle():
            return False
        rest = direct[1].send_now(message.frame)
        self.direct_sends += 1
        if rest:
            self.direct_rests += 1
            message.queued += 1
            outbox.put(_Resume(message, rest), front=True)
        return True

    def _drain(self, outbox: LinkQueue) -> Iterator[memoryview]:
        """The requests of one stream, on the transport's sender thread. Asking
        for the next item means the transport is done with the previous one
        (and its turn is over, before we wait for the next item)."""
        previous: Message | None = None
        turn: Turn | None = None
        while True:
            if previous is not None:
                if turn is not None:
                    turn.handed()
                with self._lock:
                    previous.queued -= 1
                previous = turn = None
            item = outbox.get()
            if item is _CLOSE:
                return
            if isinstance(item, _Resume):  # the rest of a direct send
                previous = item.message
                yield item.rest
                continue
            if isinstance(item, tuple):
                if not outbox.await_turn(item[1], item[2]):
                    outbox.put(item, item[2], front=True)  # a more urgent one goes first
                    continue
                item, turn, _ = item
            previous = item
            yield item.frame

    def _open_stream(self) -> None:
        """Open a new stream (caller holds _lock); after the first, resend history.

        Whether the old stream broke with shards in flight or after its last
        reply, the daemon may have lost the last completed round of some chunk
        before every rank had its result, so that round goes out again first.
        """
        outbox = LinkQueue()
        self._outbox = outbox
        if self._streams_opened:
            for message in self._history.resendable(self._alive_s):
                self._put(outbox, message)
        self._streams_opened += 1
        threading.Thread(target=self._read, args=(outbox,), daemon=True,
                         name=f"reducer-link-{self.address}").start()

    def _open_replies(self, requests: Iterator[memoryview], outbox: LinkQueue,
                      ) -> Iterable[ShardView]:
        """Start a stream of `requests` (outbox's) on the first transport that
        reaches the daemon; its replies. Runs on the reader thread: this blocks."""
        try:
            daemon = self._control.brief_status()
        except TransportError as exc:  # not answered in time (a stalled daemon): retried
            late = exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
            raise TransportError(grpc.StatusCode.UNAVAILABLE if late else exc.code,
                                 f"status: {exc.details}") from None
        if daemon.round_timeout_s:
            with self._lock:
                self._history.round_timeout_s = daemon.round_timeout_s
        for index, transport in enumerate(self._transports):
            try:
                replies = transport.open(requests, daemon)
            except NotOffered as exc:
                if index == len(self._transports) - 1:
                    raise
                if not exc.quiet and transport.name not in self._warned:
                    self._warned.add(transport.name)  # said once; each stream tries it again
                    log.warning("daemon %s: %s unreachable (%s); sending data through %s",
                                self.address, transport.label, exc.details,
                                self._transports[index + 1].label)
                continue
            self.transport = transport.name
            if getattr(replies, "can_send_now", False):
                with self._lock:
                    if self._outbox is outbox:
                        self._direct = (outbox, replies)
            return replies
        raise AssertionError("unreachable: the last transport returned or raised")

    def _read(self, outbox: LinkQueue) -> None:
        error: ReducerError | None = None
        try:
            for reply in self._open_replies(self._drain(outbox), outbox):
                self._deliver(reply)
        except TransportError as exc:
            error = stream_error(exc.code, f"daemon {self.address}: {exc.details}")
        except Exception as exc:  # a bug here must not hang the waiting chunks
            log.exception("daemon %s: reading the stream failed", self.address)
            error = ReducerError(grpc.StatusCode.INTERNAL,
                                 f"daemon {self.address}: client error: {exc!r}")
        self._stream_ended(outbox, error)

    def _deliver(self, reply: ShardView) -> None:
        now = time.monotonic()
        with self._lock:
            entry = self._pending.pop((reply.key, reply.round, reply.offset), None)
            self._alive_s = now
            if not reply.error_code:  # any result, a resent one's too: the daemon is back
                self._retries = 0
                self.last_error = None
                if entry is not None:
                    self._history.completed((reply.key, reply.offset), reply.round,
                                            entry.message, now)
        if entry is None:
            return  # a late reply to an operation that gave up, or a repeat
        if entry.turn is not None:
            entry.turn.answered()
        if reply.error_code:
            _call(entry.handler, None, ReducerError(status_code_from_value(reply.error_code),
                                                    f"daemon {self.address}: "
                                                    f"{reply.error_message}"))
        else:
            _call(entry.handler, reply, None)

    def _stream_ended(self, outbox: LinkQueue, error: ReducerError | None,
                      ) -> None:
        """Resend what is open on a new stream if worth it, else fail it."""
        # A stream the daemon ended with OK while we still waited (it was
        # shutting down or closed an idle stream) is as retryable as a crash.
        retryable = error is None or error.retryable
        with self._lock:
            if self._outbox is outbox:
                self._outbox, self._direct = None, None
                outbox.put(_CLOSE)
            if not self._pending:
                return
            if error is not None:
                self.last_error = error
            attempt = self._retries
            self._retries += 1
            retry = retryable and not self._closed
            if retry:
                first_deadline_s = min(p.deadline_s for p in self._pending.values())
            else:
                failed, self._pending = list(self._pending.values()), {}
        if not retry:
            error = error or ReducerError(grpc.StatusCode.UNAVAILABLE,
                                          f"daemon {self.address} ended the stream with "
                                          f"{len(failed)} chunk(s) unanswered")
            for entry in failed:
                _call(entry.handler, None, error)
            return
        if attempt:
            delay_s = min(_MAX_RETRY_DELAY_S, _FIRST_RETRY_DELAY_S * 2 ** (attempt - 1))
            self._closing.wait(max(0.0, min(delay_s, first_deadline_s - time.monotonic())))
        self._fail_late(attempt + 1)
        self._resend(error)

    def _fail_late(self, attempts: int) -> None:
        """Fail the chunks whose deadline passed while the daemon was unreachable."""
        now = time.monotonic()
        with self._lock:
            late = [key for key, p in self._pending.items() if p.deadline_s <= now]
            entries = [self._pending.pop(key) for key in late]
            last = self.last_error
        if not entries:
            return
        reason = str(last) if last else f"daemon {self.address} ended the stream early"
        error = ReducerError(last.code if last else grpc.StatusCode.UNAVAILABLE,
                             f"{reason} (no stream within the deadline, {attempts} "
                             f"attempt(s))", retryable=last.retryable if last else True)
        for entry in entries:
            _call(entry.handler, None, error)

    def _resend(self, cause: ReducerError | None) -> None:
        with self._lock:
            if self._closed or not self._pending:
                return
            if self._outbox is None:
                self._open_stream()
            assert self._outbox is not None
            if self._retries <= 1:  # once per outage, not per attempt
                log.warning("daemon %s: stream broke (%s); resending %d open and up to %d "
                            "completed chunk(s)", self.address,
                            cause.code.name if cause else "ended early",
                            len(self._pending), len(self._history))
            for entry in self._pending.values():
                self._put(self._outbox, entry.message)


def _call(handler: ReplyHandler, reply: ShardView | None, error: ReducerError | None) -> None:
    """Run a reply handler; a bug in one must not stop the others' replies."""
    try:
        handler(reply, error)
    except Exception:
        log.exception("reply handler failed")
