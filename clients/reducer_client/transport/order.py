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

That keeps one worker's flows in step; several workers' flows into one
daemon are another matter. With N = 8 workers on D = 2 daemons each
daemon's inbound link ran full, but TCP shared it unevenly among the 8
flows: the daemon answered a chunk only when the slowest flow delivered it,
its reply link idled at 50-90 % in the first half, and the answers drained
about a second after the last input (the planner's worst misses). So each
link also holds credits: at most `credits` chunks of an operation sent and
not yet answered. A flow that runs ahead stops at its credits and leaves
the daemon's link to the flows behind it. This cannot deadlock within an
operation either: a worker that has not sent the lowest unanswered chunk
holds no credit of its link. Across operations it could (a link held by
one operation's credits, the chunks that would answer them queued behind
another's elsewhere), so the credits give up on an operation once neither
a credit was taken nor an answer came for stall_s.

The window cannot deadlock: a chunk waits only for chunks of its operation
queued before it, and each link sends its queue in order, so every wait points at
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
(link.py), so an operation's order never holds back a more urgent one (a
wait for credits is cut short the same way), so priorities cannot deadlock.
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

__all__ = ["SendOrder", "Turn", "LinkQueue", "WINDOW_PER_DAEMON", "MAX_WAIT_S",
           "CREDITS_PER_LINK", "STALL_S"]

# How many chunks of an operation each link may run ahead of the slowest
# link: one (window = the number of links). On the emulated cluster (N = D =
# 4, 64 MiB of float16 in 256 KiB chunks) this cut the spread of one chunk's
# arrival times at its daemon from 60-120 ms to about 20 ms.
WINDOW_PER_DAEMON = 1
# The longest a sender waits for its turn before the order gives up.
MAX_WAIT_S = 0.05
# How many chunks of an operation each link may have sent and not yet had
# answered (see the module: several workers on one daemon), and how long
# the credits wait without progress before they give up.
CREDITS_PER_LINK = 4
STALL_S = 0.5


class SendOrder:
    """The handing-over order of one operation's `count` chunks; thread-safe."""

    __slots__ = ("count", "window", "max_wait_s", "credits", "stall_s", "_handed",
                 "_frontier", "_released", "_settled", "_unpaced", "_unanswered", "_credited",
                 "_progress_s", "_cond")

    def __init__(self, count: int, window: int, max_wait_s: float = MAX_WAIT_S,
                 credits: int = 0, stall_s: float = STALL_S) -> None:
        if count < 0 or window < 1 or not max_wait_s > 0 or credits < 0 or not stall_s > 0:
            raise ValueError(f"SendOrder needs count >= 0, window >= 1, max_wait_s > 0, "
                             f"credits >= 0 and stall_s > 0, got {count}, {window}, "
                             f"{max_wait_s}, {credits}, {stall_s}")
        self.count, self.window, self.max_wait_s = count, window, max_wait_s
        self.credits, self.stall_s = credits, stall_s  # credits 0: unanswered uncapped
        self._handed = bytearray(count)
        self._frontier = 0  # every chunk before it has been handed over
        self._released = False  # the window no longer holds anyone back
        self._settled = False  # nothing holds anyone back
        self._unpaced = not credits  # the credits no longer hold anyone back
        self._unanswered: dict[int, int] = {}  # link -> chunks sent and not answered
        self._credited = bytearray(count)  # chunks that hold a credit of their link
        self._progress_s = time.monotonic()  # when a chunk last took a credit or was answered
        self._cond = threading.Condition(threading.Lock())

    @property
    def frontier(self) -> int:
        """How many chunks, from the first, have been handed over."""
        return self._frontier

    @property
    def released(self) -> bool:
        """Whether the order no longer holds anyone back."""
        return self._released

    @property
    def unpaced(self) -> bool:
        """Whether the credits no longer hold anyone back."""
        return self._unpaced or self._settled

    def turn(self, index: int, link: int = 0) -> Turn:
        """Chunk `index`, sent on link `link` (credits are counted per link)."""
        if not 0 <= index < self.count:
            raise IndexError(f"chunk {index} of an operation of {self.count}")
        return Turn(self, index, link)

    def _may_go(self, index: int) -> bool:
        return index - self.window < self._frontier or self._released or self._settled

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
            self.give_up_window()
        return False

    def give_up_window(self) -> None:
        """Stop holding chunks to the window (a link is stuck); credits still count."""
        with self._cond:
            self._released = True
            self._cond.notify_all()

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
        """Nobody waits any more, for the window or credits (the operation settled)."""
        with self._cond:
            self._released = self._settled = True
            self._cond.notify_all()

    def _has_credit(self, link: int) -> bool:
        return self._unanswered.get(link, 0) < self.credits or self.unpaced

    def take_credit(self, index: int, link: int, timeout_s: float | None = None,
                    interrupted: Callable[[], bool] | None = None) -> bool:
        """Block until link `link` has fewer than `credits` chunks of this
        operation unanswered, at most timeout_s, then count chunk `index` as
        one of them; whether it may go. The credits give up (unpaced: True)
        once neither a credit nor an answer came for stall_s, so a wait
        across operations (see the module) costs stall_s at most.
        interrupted: as in wait()."""
        with self._cond:
            if self._credited[index]:  # taken before the sender put it back
                return True
            deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
            while not self._has_credit(link):
                if interrupted is not None and interrupted():
                    return False
                now_s = time.monotonic()
                limit_s = self._progress_s + self.stall_s - now_s
                if limit_s <= 0:
                    self._unpaced = True
                    self._cond.notify_all()
                    break
                if deadline_s is not None:
                    if deadline_s <= now_s:
                        return False
                    limit_s = min(limit_s, deadline_s - now_s)
                self._cond.wait(limit_s)
            if not self.unpaced:
                self._credited[index] = 1
                self._unanswered[link] = self._unanswered.get(link, 0) + 1
                self._progress_s = time.monotonic()
            return True

    def answered(self, index: int, link: int) -> None:
        """The daemon answered chunk `index` (sent on `link`): its credit is free."""
        with self._cond:
            self._progress_s = time.monotonic()
            if self._credited[index]:
                self._credited[index] = 0
                self._unanswered[link] -= 1
                self._cond.notify_all()


class Turn:
    """Chunk `index` of a SendOrder, sent on link `link`: what a link's outbox
    carries beside the message."""

    __slots__ = ("order", "index", "link", "waited_s", "_in_window")

    def __init__(self, order: SendOrder, index: int, link: int = 0) -> None:
        self.order, self.index, self.link = order, index, link
        self.waited_s = 0.0  # over every wait() of this turn for the window
        self._in_window = False

    def wait(self, slice_s: float | None = None,
             interrupted: Callable[[], bool] | None = None) -> bool:
        """Whether the chunk may go, having waited at most slice_s more (None:
        until it may, or until `interrupted`, see SendOrder.wait): first for
        the window (past max_wait_s in all, the order gives up on it), then
        for a credit of its link (SendOrder.take_credit)."""
        if not self._in_window:
            start_s = time.monotonic()
            if not self._wait_window(slice_s, interrupted):
                return False
            self._in_window = True
            if slice_s is not None:
                slice_s = max(0.0, slice_s - (time.monotonic() - start_s))
        return self.order.take_credit(self.index, self.link, slice_s, interrupted)

    def answered(self) -> None:
        """The daemon answered the chunk (link.py, on the reader thread)."""
        self.order.answered(self.index, self.link)

    def _wait_window(self, slice_s: float | None,
                     interrupted: Callable[[], bool] | None) -> bool:
        order = self.order
        left_s = order.max_wait_s - self.waited_s
        start_s = time.monotonic()
        if order.wait(self.index, max(0.0, left_s if slice_s is None else min(slice_s, left_s)),
                      interrupted):
            return True
        self.waited_s += time.monotonic() - start_s
        if self.waited_s < order.max_wait_s:
            return False
        order.give_up_window()
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
