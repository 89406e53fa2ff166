"""Complete a node group's futures where a blocking callback cannot stall it.

Completing a future runs the callers' done-callbacks on the completing
thread, and a callback may well start another reduction and wait for it (a
shim chaining steps). On the node's work thread, which sums the slices and
copies the results out, that wait would hold up the very work it waits for.
So futures are completed here: on a thread of their own, and whenever every
such thread is busy (a callback blocks) on a new one, so a completion never
queues behind a blocked callback. Threads that stay idle for a while exit;
in the usual case one thread completes everything in order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Settler"]

_IDLE_EXIT_S = 5.0


class Settler:
    """Run short completions (future.set_result, set_exception) off the caller."""

    def __init__(self, name: str) -> None:
        self._name = name
        # _cond guards _queue, _idle and _closed: any thread submits, the
        # settler's threads take from the queue.
        self._cond = threading.Condition()
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._idle = 0  # threads waiting for work
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) soon on a settler thread (here and now once closed)."""
        with self._cond:
            here, spawn = self._closed, False
            if not here:
                self._queue.append((fn, args))
                # One idle thread for every queued item, or a new thread: an
                # item never waits for a thread a callback holds.
                spawn = self._idle < len(self._queue)
                if not spawn:
                    self._cond.notify()
        if here:
            fn(*args)
        elif spawn:
            threading.Thread(target=self._run, daemon=True, name=self._name).start()

    def close(self) -> None:
        """Take no more work; what is queued still runs."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        return
                    self._idle += 1
                    woken = self._cond.wait(_IDLE_EXIT_S)
                    self._idle -= 1
                    if not woken and not self._queue:
                        return
                fn, args = self._queue.popleft()
            fn(*args)  # Future.set_*: its callbacks' exceptions are logged, not raised
