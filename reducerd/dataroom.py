"""Room for the data plane's frames, without blocking: counts that wake whoever waits.

The I/O threads (reducerd.dataio) must never block, so what the old reader
threads waited on (a credit, the plane's backlog, the outbox's unsent
replies) becomes a count checked before a frame's payload is read; a
connection that finds none stops reading (its frame stays in the kernel and
TCP slows the client) and is woken when the loop thread gives room back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from reducerd.limits import MemoryBudget
from reducerd.outbox import ThreadOutbox

__all__ = ["Room", "WakingOutbox", "Waiter"]


class Waiter(Protocol):
    """What Room needs of a connection (the fields are guarded by Room's lock)."""

    queued: int  # its frames read and not yet taken by the loop thread
    credit_wanted: bool  # it waits for one of those to be taken

    def wake_for_room(self) -> None:
        """Make the connection's I/O thread look for room again (any thread)."""


class Room:
    """Frames read and not yet taken by the loop thread: at most `per_connection`
    per connection (its credit) and `backlog` on the whole plane (with hundreds
    of contributors each connection's own allowance would add up).

    take() runs on the I/O threads, release() on the loop thread; a connection
    that take() turned down is woken (Waiter.wake_for_room) when a frame of its
    own is taken (its credit) or, oldest first, when a backlog slot frees.
    """

    def __init__(self, per_connection: int, backlog: int) -> None:
        self.per_connection = per_connection
        # _lock guards free, _waiters and every Waiter's queued and credit_wanted;
        # the I/O threads and the loop thread take it once or twice a frame.
        self._lock = threading.Lock()
        self.free = backlog
        # Connections whose own credit is fine, waiting for a backlog slot.
        self._waiters: OrderedDict[Waiter, None] = OrderedDict()

    def take(self, conn: Waiter) -> bool:
        """A credit of `conn` and a backlog slot, or False (it is woken later)."""
        with self._lock:
            if conn.queued >= self.per_connection:
                conn.credit_wanted = True
                self._waiters.pop(conn, None)
                return False
            if self.free <= 0:
                self._waiters[conn] = None
                return False
            self.free -= 1
            conn.queued += 1
            self._waiters.pop(conn, None)
            # Slots freed while several waited: pass the news along.
            after = self._next_locked() if self.free > 0 else None
        if after is not None:
            after.wake_for_room()
        return True

    def release(self, conn: Waiter) -> None:
        """The loop thread took one of `conn`'s frames."""
        with self._lock:
            conn.queued -= 1
            self.free += 1
            own = conn.credit_wanted
            conn.credit_wanted = False
            after = self._next_locked()
        if own:  # then it was not among the waiters: `after` is another
            conn.wake_for_room()
        if after is not None:
            after.wake_for_room()

    def pass_on(self, conn: Waiter) -> None:
        """`conn` no longer waits (it ended, or was woken and cannot read now):
        wake the next waiter if there is a slot it may have been woken for."""
        with self._lock:
            self._waiters.pop(conn, None)
            conn.credit_wanted = False
            after = self._next_locked() if self.free > 0 else None
        if after is not None:
            after.wake_for_room()

    def _next_locked(self) -> Waiter | None:
        return self._waiters.popitem(last=False)[0] if self._waiters else None


class WakingOutbox(ThreadOutbox):
    """A connection's outbox that its I/O thread drains without blocking: the
    loop thread's put calls `wake` (which posts to that thread only when the
    connection's writer is idle); the counts are ThreadOutbox's, unchanged."""

    def __init__(self, budget: MemoryBudget | None, wake: Callable[[], None]) -> None:
        super().__init__(budget)
        self._wake = wake

    def put_nowait(self, item: Any, priority: int = 0) -> None:
        super().put_nowait(item, priority)
        self._wake()

    def get_nowait(self) -> Any:
        """The next item, or None when there is none (None is never put)."""
        with self._lock:
            return self._items.pop() if self._items else None

    def below(self, frames: int, nbytes: int) -> bool:
        """Whether fewer than `frames` items and `nbytes` bytes wait to be sent."""
        with self._lock:
            return len(self._items) < frames and self.unsent_bytes < nbytes
