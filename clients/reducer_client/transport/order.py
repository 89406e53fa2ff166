"""In what order a worker's chunks leave: in step across the daemon links
(SendOrder), the most urgent first on each (LinkQueue).

Each daemon link has its own sender thread, and TCP shares a worker's link
unevenly among its flows: on the emulated 200 Mbit cluster one worker's flow
to a daemon ran 60-120 ms ahead of its flow to another. A daemon answers a
chunk only when every worker has sent it, so it waits for the slowest flow,
and what a fast flow sent early only waits; with every worker and daemon
link saturated (D = N) the daemon's answers fall behind and never catch up.
A SendOrder makes a worker's chunks leave in the operation's order: a link's
sender hands chunk i to its transport only once every chunk before
i - window has been handed to its own, and the TCP data plane keeps little
unsent in the socket (transport/tcp.py), so no flow runs more than about
window / D chunks ahead of the others.

It cannot deadlock: a chunk waits only for chunks of its operation queued
before it, and each link sends its queue in order, so every wait points at
something queued earlier. It cannot stall for long either: a wait lasts at
most max_wait_s, after which the order gives up for that operation (a link
reconnecting resends without order), and release() (the operation settled)
frees every waiter. The order only paces; results never depend on it.

A LinkQueue is a link's outbox: its sender takes the queued chunk of the
highest priority (Shard.priority; 0 the default) first, in queueing order
among equals, so a bucket that the next forward needs first overtakes the
chunks of earlier buckets still queued. The chunks of one operation share
its priority and so keep their order. A sender waiting for a chunk's turn
puts it back at the head of its priority when a more urgent chunk is queued
(link.py), so an operation's order never holds back a more urgent one; the
sender waits for nothing but local progress, so priorities cannot deadlock.
The waiting sender does not poll for that: the put of a more urgent chunk
pokes the order it waits on (2 ms polls woke each waiting sender 500 times a
second, for nothing unless priorities are in use: 2-6 % of a worker's CPU on
the emulated cluster).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["SendOrder", "Turn", "LinkQueue", "WINDOW_PER_DAEMON", "MAX_WAIT_S"]

# How many chunks of an operation each link may run ahead of the slowest
# link: one (window = the number of links). On the emulated cluster (N = D =
# 4, 64 MiB of float16 in 256 KiB chunks) this cut the spread of one chunk's
# arrival times at its daemon from 60-120 ms to about 20 ms.
WINDOW_PER_DAEMON = 1
# The longest a sender waits for its turn before the order gives up.
MAX_WAIT_S = 0.05


class SendOrder:
    """The handing-over order of one operation's `count` chunks; thread-safe."""

    __slots__ = ("count", "window", "max_wait_s", "_handed", "_frontier", "_released",
                 "_cond")

    def __init__(self, count: int, window: int, max_wait_s: float = MAX_WAIT_S) -> None:
        if count < 0 or window < 1 or not max_wait_s > 0:
            raise ValueError(f"SendOrder needs count >= 0, window >= 1 and max_wait_s > 0, "
                             f"got {count}, {window}, {max_wait_s}")
        self.count, self.window, self.max_wait_s = count, window, max_wait_s
        self._handed = bytearray(count)
        self._frontier = 0  # every chunk before it has been handed over
        self._released = False
        self._cond = threading.Condition(threading.Lock())

    @property
    def frontier(self) -> int:
        """How many chunks, from the first, have been handed over."""
        return self._frontier

    @property
    def released(self) -> bool:
        """Whether the order no longer holds anyone back."""
        return self._released

    def turn(self, index: int) -> Turn:
        if not 0 <= index < self.count:
            raise IndexError(f"chunk {index} of an operation of {self.count}")
        return Turn(self, index)

    def _may_go(self, index: int) -> bool:
        return index - self.window < self._frontier or self._released

    def wait(self, index: int, timeout_s: float | None = None,
             interrupted: Callable[[], bool] | None = None) -> bool:
        """Block until chunk `index` may go, at most timeout_s; whether it may.
        Without timeout_s: at most max_wait_s, after which the order gives up
        (released: a link is stuck, stop pacing this operation). interrupted:
        also stop waiting (False, not given up) once it is true; it is checked
        at each poke() and must not take a lock."""
        if self._may_go(index):  # the common case: no lock
            return True
        with self._cond:
            limit_s = self.max_wait_s if timeout_s is None else timeout_s
            if self._cond.wait_for(lambda: self._may_go(index)
                                   or (interrupted is not None and interrupted()), limit_s):
                return self._may_go(index)
            if timeout_s is None:
                self._released = True
                self._cond.notify_all()
            return False

    def poke(self) -> None:
        """Wake every waiter to check its `interrupted` (a more urgent chunk came)."""
        with self._cond:
            self._cond.notify_all()

    def handed(self, index: int) -> None:
        """Chunk `index` went to its transport."""
        with self._cond:
            self._handed[index] = 1
            frontier = self._frontier
            while frontier < self.count and self._handed[frontier]:
                frontier += 1
            if frontier != self._frontier:
                self._frontier = frontier
                self._cond.notify_all()

    def release(self) -> None:
        """Nobody waits any more (the operation settled)."""
        with self._cond:
            self._released = True
            self._cond.notify_all()


class Turn:
    """Chunk `index` of a SendOrder: what a link's outbox carries beside the message."""

    __slots__ = ("order", "index", "waited_s")

    def __init__(self, order: SendOrder, index: int) -> None:
        self.order, self.index = order, index
        self.waited_s = 0.0  # over every wait() of this turn

    def wait(self, slice_s: float | None = None,
             interrupted: Callable[[], bool] | None = None) -> bool:
        """Whether the chunk may go, having waited at most slice_s more (None:
        until it may, or until `interrupted`, see SendOrder.wait). Past
        max_wait_s in all, the order gives up: True."""
        order = self.order
        left_s = order.max_wait_s - self.waited_s
        start_s = time.monotonic()
        if order.wait(self.index, max(0.0, left_s if slice_s is None else min(slice_s, left_s)),
                      interrupted):
            return True
        self.waited_s += time.monotonic() - start_s
        if self.waited_s < order.max_wait_s:
            return False
        order.release()
        return True

    def handed(self) -> None:
        self.order.handed(self.index)


class LinkQueue:
    """A link's outbox: get() returns the highest priority first, in put()
    order among equals (priority 0, the common case, is a plain FIFO)."""

    __slots__ = ("_fifo", "_urgent", "_count", "_front", "_cond", "top_priority", "waiting",
                 "_idle")

    def __init__(self) -> None:
        self._fifo: deque[Any] = deque()
        self._urgent: list[tuple[int, int, Any]] = []  # (-priority, count, item): a heap
        self._count = 0  # breaks ties in put() order
        self._front = 0  # below every count: put back at the head of a priority
        self._cond = threading.Condition(threading.Lock())
        # The highest priority queued (0 when none is): read without the lock.
        self.top_priority = 0
        # (turn, priority) of the chunk the sender waits to send, set by the
        # sender (link.py): a put of a more urgent chunk pokes its order.
        self.waiting: tuple[Turn, int] | None = None
        # The taker waits in get() for an item: it is done with the last one.
        self._idle = False

    def put(self, item: Any, priority: int = 0, front: bool = False) -> None:
        """Queue `item`; front: before the others of its priority (put back)."""
        with self._cond:
            if priority:
                if front:
                    self._front -= 1
                count = self._front if front else self._count
                heapq.heappush(self._urgent, (-priority, count, item))
                self._count += 1
                self.top_priority = -self._urgent[0][0]
            elif front:
                self._fifo.appendleft(item)
            else:
                self._fifo.append(item)
            self._cond.notify()
        waiting = self.waiting  # after top_priority is set: no wake-up is lost
        if waiting is not None and priority > waiting[1]:
            waiting[0].order.poke()

    def urgent_beyond(self, priority: int) -> bool:
        """Whether an item of a higher priority than `priority` is queued (no lock)."""
        return self.top_priority > priority

    def get(self) -> Any:
        """The next item, waiting for one."""
        with self._cond:
            while not (self._urgent or self._fifo):
                self._idle = True
                self._cond.wait()
            self._idle = False
            if self._urgent:
                item = heapq.heappop(self._urgent)[2]
                self.top_priority = -self._urgent[0][0] if self._urgent else 0
                return item
            return self._fifo.popleft()

    def idle(self) -> bool:
        """Nothing queued and the taker waiting for an item (so done with its
        last one): until the next put(), nobody else writes its stream."""
        with self._cond:
            return self._idle and not (self._urgent or self._fifo)

    def await_turn(self, turn: Turn, priority: int) -> bool:
        """On the taker's thread, wait for the turn of the chunk it took; False
        as soon as a chunk more urgent than this one (of `priority`) is queued
        behind it, which should go first (its put pokes the turn's order)."""
        self.waiting = (turn, priority)
        try:
            while not turn.wait(interrupted=lambda: self.urgent_beyond(priority)):
                if self.urgent_beyond(priority):
                    return False
            return True
        finally:
            self.waiting = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._fifo)
