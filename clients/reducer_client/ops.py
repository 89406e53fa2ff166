"""One allreduce in flight (Operation), and the watchdog over them (InFlight).

An Operation is settled exactly once, by the last chunk's reply or by the
first failure, whichever thread gets there first: the links' reader threads
(replies, in-band errors, a link giving up), the watchdog (the deadline),
close(), a node group. `settled` is decided under the operation's lock; the
winner alone runs the settle callback and completes the future, outside the
lock, so a reply and a failure racing can neither raise InvalidStateError nor
kill the thread that lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc
import numpy as np
from reducer_wire import convert, dtypes
from reducer_wire.codec import ShardView
from reducer_wire.layout import Chunk

from reducer_client.errors import ReducerError
from reducer_client.transport.link import ReplyHandler

__all__ = ["Operation", "InFlight", "SettleCallback", "reply_dtype_problem"]

log = logging.getLogger("reducer_client")

# Called once, by the thread that settled the operation, before the future completes.
SettleCallback = Callable[["Operation", ReducerError | None], None]

# Outputs of at least this many bytes are widened with streaming stores
# (convert.from_wire(stream=True)): far larger than a core's cache, they are
# not in it when the caller reads them, and plain stores would read every
# line before writing it (a 64 MiB float32 output: 6.4 ms against 3.6 here).
STREAM_OUTPUT_BYTES = 4 << 20


def reply_dtype_problem(got: int, expected: int) -> str:
    """What a reply of another wire dtype than its chunk's is told with."""
    return (f"reply has wire dtype {dtypes.DTYPE_NAMES.get(got, got)}, expected "
            f"{dtypes.DTYPE_NAMES.get(expected, expected)}")


class Operation:
    """One allreduce in flight: the output buffer and the chunks still missing.

    out: the flat view of `result` (the array the future hands back) that
    the replies are widened into, chunk by chunk, on the reader threads.
    """

    def __init__(self, key: str, round_: int, out: np.ndarray, result: np.ndarray,
                 dtype: int, chunks: Sequence[Chunk], deadline_s: float,
                 on_settled: SettleCallback | None = None,
                 explain: Callable[[ReducerError], ReducerError] | None = None) -> None:
        """`explain`: maps the error the operation fails with to its cause
        where one is known (ReducerClient: a daemon that went away behind
        another daemon's DEADLINE_EXCEEDED)."""
        self.future: Future[np.ndarray] = Future()
        self.future.set_running_or_notify_cancel()  # cannot be cancelled from now on
        self.key, self.round = key, round_
        self.out, self.result, self.dtype = out, result, dtype
        self.stream = out.nbytes >= STREAM_OUTPUT_BYTES
        self.chunks = chunks
        self.deadline_s = deadline_s
        self._on_settled = on_settled
        self._explain = explain
        # _lock guards _answered, remaining and settled (reader threads, the
        # watchdog, closers); nothing is called while it is held.
        self._lock = threading.Lock()
        self._answered = bytearray(len(chunks))  # one flag per chunk: a repeat counts once
        self.remaining = len(chunks)
        self.settled = False
        if not chunks:  # nothing to wait for
            self.settled = True
            self.future.set_result(result)

    def handler(self, index: int) -> ReplyHandler:
        """The reply handler of chunk `index`; it never raises."""
        chunk = self.chunks[index]

        def on_reply(reply: ShardView | None, error: ReducerError | None) -> None:
            if error is not None or reply is None:
                self.fail(error or ReducerError(grpc.StatusCode.INTERNAL, "empty reply"))
                return
            if self.settled:
                return  # failed already: leave the caller's buffer alone
            if reply.dtype != self.dtype:
                self.fail(self._error(chunk, reply_dtype_problem(reply.dtype, self.dtype)))
                return
            expected = dtypes.wire_nbytes(self.dtype, chunk.numel)
            if len(reply.data) != expected:
                self.fail(self._error(chunk, f"reply has {len(reply.data)} bytes, "
                                             f"expected {expected}"))
                return
            try:
                convert.from_wire(reply.data, self.dtype,
                                  self.out[chunk.offset:chunk.offset + chunk.numel],
                                  stream=self.stream)
            except Exception as exc:
                self.fail(self._error(chunk, f"cannot widen the reply: {exc!r}"))
                return
            with self._lock:
                if self.settled or self._answered[index]:
                    return
                self._answered[index] = 1
                self.remaining -= 1
                if self.remaining:
                    return
                self.settled = True
            self._settle(None)

        return on_reply

    def answered_many(self, count: int) -> None:
        """`count` chunks were answered and widened elsewhere (the C loop,
        fastpath.py), none of them through handler()."""
        with self._lock:
            if self.settled or not count:
                return
            self.remaining -= count
            if self.remaining:
                return
            self.settled = True
        self._settle(None)

    def chunk_error(self, index: int, problem: str) -> ReducerError:
        """The error of chunk `index` whose reply is wrong: `problem` says how."""
        return self._error(self.chunks[index], problem)

    def fail(self, error: ReducerError) -> bool:
        """Fail the operation unless it is settled already; True if this call did."""
        with self._lock:
            if self.settled:
                return False
            self.settled = True
        if self._explain is not None:
            try:
                error = self._explain(error)
            except Exception:  # the error as it came, rather than none
                log.exception("key %r round %d: explaining %r failed", self.key, self.round,
                              error)
        self._settle(error)
        return True

    def _error(self, chunk: Chunk, problem: str) -> ReducerError:
        return ReducerError(grpc.StatusCode.INTERNAL, f"key {self.key!r} round {self.round} "
                                                      f"offset {chunk.offset}: {problem}")

    def _settle(self, error: ReducerError | None) -> None:
        """Run by the one thread that settled the operation, outside the lock."""
        if self._on_settled is not None:
            try:
                self._on_settled(self, error)
            except Exception:  # bookkeeping must not keep the caller waiting
                log.exception("key %r round %d: settle callback failed", self.key, self.round)
        if error is None:
            self.future.set_result(self.result)
        else:
            self.future.set_exception(error)


class InFlight:
    """The operations in flight, and the watchdog thread that fails each one
    at its deadline so that nothing waits for ever.

    timeout_error(op) says why a late operation failed; tick(now), if given,
    runs first on every round of the watchdog (the node group's backstop).
    Whatever either raises is logged and the watchdog carries on.
    """

    def __init__(self, timeout_error: Callable[[Operation], ReducerError],
                 tick: Callable[[float], None] | None = None, interval_s: float = 0.1) -> None:
        self._timeout_error = timeout_error
        self._tick = tick
        self._interval_s = interval_s
        # _lock guards _ops and _closed: callers adding, settling threads
        # discarding, the watchdog scanning, close().
        self._lock = threading.Lock()
        self._ops: dict[int, Operation] = {}
        self._closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="reducer-watchdog")
        self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._ops)

    @property
    def watching(self) -> bool:
        """Whether the watchdog thread runs (until close())."""
        return self._thread.is_alive()

    def add(self, operation: Operation) -> None:
        """Watch `operation` until it settles; CANCELLED once closed."""
        with self._lock:
            if self._closed:
                raise ReducerError(grpc.StatusCode.CANCELLED, "client is closed")
            self._ops[id(operation)] = operation

    def discard(self, operation: Operation) -> None:
        with self._lock:
            self._ops.pop(id(operation), None)

    def check(self, now_s: float) -> None:
        """Fail every operation whose deadline is past."""
        with self._lock:
            late = [op for op in self._ops.values() if op.deadline_s <= now_s]
        for operation in late:
            try:
                error = self._timeout_error(operation)
            except Exception:
                log.exception("key %r: describing the timeout failed", operation.key)
                error = ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"key {operation.key!r} round {operation.round}: "
                                     "no result within the timeout")
            operation.fail(error)

    def close(self, error: ReducerError) -> None:
        """Fail what is open with `error`, stop the watchdog; idempotent."""
        with self._lock:
            self._closed = True
            operations, self._ops = list(self._ops.values()), {}
        self._wake.set()
        for operation in operations:
            operation.fail(error)

    def _watch(self) -> None:
        while not self._wake.wait(self._interval_s):
            now_s = time.monotonic()
            for step in (self._tick, self.check):
                if step is None:
                    continue
                try:
                    step(now_s)
                except Exception:  # a dead watchdog would enforce no deadline again
                    log.exception("watchdog: %s failed; carrying on", step)
