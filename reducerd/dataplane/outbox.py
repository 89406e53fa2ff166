"""Outboxes: the replies a stream has yet to send, counted against the memory budget.

The session puts replies (and last an END or a (code, message) item) into a
stream's outbox; the transport's writer takes them and says when one is
sent. Between the two, a reply's bytes count as the daemon's (MemoryBudget
transport bytes) and as the stream's `unsent_bytes`, which its reader watches:
beyond a bound it stops reading, so a client that does not read its replies
is slowed down by its own transport's flow control instead of buffered.

A reply is counted once per stream even where streams share its buffer: an
upper bound, and the one that a stream which never reads keeps alive. The
bytes count against the outbox's `job` too (its stream's, set before its
first reply): the job's share of the budget (reducerd.core.limits), which every
stream of that job waits for before it reads on.

Priority (Shard.priority of the stream's contribution): a reply put with a
positive one is taken before those of a lower one, in put order among equals;
priority 0 and the last items (END, a status) keep plain FIFO order behind them.

Direct sends (ThreadOutbox with a plain socket): a reply put while its writer
thread is idle and nothing waits before it goes straight out from the
putting thread (the loop) with one non-blocking send, and only what the
socket did not take, if anything, waits for the writer. Waking a writer
thread for every reply cost the loop about a tenth of its time (the
Condition's notify) and every reply a thread switch; with hundreds of
contributors, one per contributor per chunk. A connection starts its writer
thread only once something has to wait for it (a part-sent reply, the end).
"""

from __future__ import annotations

import asyncio
import heapq
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from reducer_wire.framing import send_at_once

from reducerd.core.limits import MemoryBudget

__all__ = ["reply_nbytes", "AsyncOutbox", "ThreadOutbox", "GONE"]

# In a data-plane outbox: the connection broke, its writer stops without a status.
GONE = object()


def reply_nbytes(item: Any) -> int:
    """The bytes an outbox item holds: a gRPC message, a data-plane Reply, else 0."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return len(item)
    frame = getattr(item, "frame", None)  # reducerd.core.replies.Reply
    return len(frame) if frame is not None else 0


class _Counted:
    """The byte count both outboxes keep (callers hold their own lock, if any)."""

    def __init__(self, budget: MemoryBudget | None) -> None:
        self._budget = budget
        self.unsent_bytes = 0
        self._closed = False
        # The job whose share its bytes count against (Stream.count_against);
        # fixed once set, as bytes counted for it are given back to it.
        self.job: str | None = None

    def _count(self, item: Any) -> None:
        nbytes = reply_nbytes(item)
        if nbytes and not self._closed:
            self.unsent_bytes += nbytes
            if self._budget is not None:
                self._budget.take_transport(nbytes, self.job)

    def _uncount(self, item: Any) -> None:
        nbytes = min(reply_nbytes(item), self.unsent_bytes)
        if nbytes:
            self.unsent_bytes -= nbytes
            if self._budget is not None:
                self._budget.give_transport(nbytes, self.job)

    def _uncount_all(self) -> None:
        self._closed = True
        if self._budget is not None:
            self._budget.give_transport(self.unsent_bytes, self.job)
        self.unsent_bytes = 0


class _Ordered:
    """Items in priority order: positive priorities first, highest first, put
    order among equals, then the FIFO of priority 0 (callers hold any lock)."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._urgent: list[tuple[int, int, Any]] = []  # (-priority, count, item): a heap
        self._count = 0

    def __len__(self) -> int:
        return len(self._items) + len(self._urgent)

    def push(self, item: Any, priority: int) -> None:
        if priority:
            heapq.heappush(self._urgent, (-priority, self._count, item))
            self._count += 1
        else:
            self._items.append(item)

    def pop(self) -> Any:
        return heapq.heappop(self._urgent)[2] if self._urgent else self._items.popleft()


class AsyncOutbox(_Counted):
    """A gRPC stream's outbox; the loop thread alone uses it."""

    def __init__(self, budget: MemoryBudget | None = None,
                 pause_at_bytes: int = 16 << 20) -> None:
        super().__init__(budget)
        self.pause_at_bytes = pause_at_bytes
        self._queue = _Ordered()
        self._ready = asyncio.Event()  # set while something waits to be taken
        self._room = asyncio.Event()
        self._room.set()

    def put_nowait(self, item: Any, priority: int = 0) -> None:
        self._count(item)
        if self.unsent_bytes >= self.pause_at_bytes:
            self._room.clear()
        self._queue.push(item, priority)
        self._ready.set()

    async def get(self) -> Any:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        return self._queue.pop()

    def sent(self, item: Any) -> None:
        """`item` left (gRPC took it): its bytes no longer count."""
        self._uncount(item)
        if self.unsent_bytes < self.pause_at_bytes:
            self._room.set()

    async def room(self) -> None:
        """Wait until fewer than pause_at_bytes wait to be sent."""
        await self._room.wait()

    def discard(self) -> None:
        """The stream ended: whatever is left is dropped, and no longer counted."""
        self._uncount_all()
        self._room.set()


class ThreadOutbox(_Counted):
    """A data-plane connection's outbox: the loop thread puts, its writer thread
    takes, its reader thread waits for room.

    direct: the connection's plain socket (None over TLS, where only the
    writer thread may write): replies that can go out at once are sent by
    put_nowait itself, without blocking (see the module's docstring).
    start_writer: called (under the outbox's lock) the first time an item
    waits for the writer, which is when a connection needs its writer thread:
    one whose replies all go out directly never starts one.
    """

    def __init__(self, budget: MemoryBudget | None = None,
                 direct: socket.socket | None = None,
                 start_writer: Callable[[], None] | None = None) -> None:
        super().__init__(budget)
        self.direct = direct
        self._start_writer = start_writer
        self._items = _Ordered()
        # A reply that a direct send left part-sent: (reply, bytes already
        # sent). The writer sends the rest before anything else.
        self._head: tuple[Any, int] | None = None
        # The writer thread took an item and has not said it is sent: no
        # direct send may overtake or interleave with it.
        self._writing = False
        # _lock guards _items, _head, _writing, the counts and the waiter
        # counts; the loop, writer and reader threads take it. Held without a
        # Condition's Python wrapper where nobody waits, and each Condition
        # notified only while its own waiter waits (every frame passes here
        # several times: a writer idle in take() woken for each frame the loop
        # took cost a futex wake and a thread switch per frame).
        self._lock = threading.RLock()
        self._item_ready = threading.Condition(self._lock)  # the writer, in take()
        self._room = threading.Condition(self._lock)  # the reader, in wait_below()
        self._taking = 0
        self._waiting_room = 0
        # Bytes of frames the reader handed to the loop that the loop has not
        # taken yet: each may bring a reply of about its size, which
        # wait_below counts (else a lagging loop lets the reader in for
        # replies nobody has counted yet).
        self._promised = 0

    def put_nowait(self, item: Any, priority: int = 0) -> None:
        with self._lock:
            self._count(item)
            direct = self.direct
            if direct is not None and self._can_send_directly(item):
                sent = send_at_once(direct, item.frame)
                if sent == len(item.frame):
                    self._uncount(item)
                    return
                self._head = (item, sent)
            else:
                self._items.push(item, priority)
            if self._start_writer is not None:
                start, self._start_writer = self._start_writer, None
                start()
            elif self._taking:
                self._item_ready.notify()

    def _can_send_directly(self, item: Any) -> bool:
        return (not self._writing and self._head is None
                and not self._items and not self._closed
                and getattr(item, "frame", None) is not None)

    def take(self) -> tuple[Any, int]:
        """The next item for the writer thread, and how many of its frame's
        bytes a direct send already sent (send the rest); until sent(item),
        nothing is sent directly."""
        with self._lock:
            while self._head is None and not self._items:
                self._taking += 1
                try:
                    self._item_ready.wait()
                finally:
                    self._taking -= 1
            self._writing = True
            if self._head is not None:
                head, self._head = self._head, None
                return head
            return self._items.pop(), 0

    def sent(self, item: Any) -> None:
        with self._lock:
            self._writing = False
            self._uncount(item)
            if self._waiting_room:
                self._room.notify_all()

    def _queued(self) -> int:
        return len(self._items) + (self._head is not None)

    def promise(self, nbytes: int) -> None:
        """A frame of `nbytes` goes to the loop (reader thread)."""
        with self._lock:
            self._promised += nbytes

    def kept(self, nbytes: int) -> None:
        """The loop took that frame (a reply it answered at once is counted by now)."""
        with self._lock:
            self._promised -= nbytes
            if self._waiting_room:
                self._room.notify_all()

    def below(self, frames: int, nbytes: int) -> bool:
        """Whether fewer than `frames` items and `nbytes` bytes (promised ones
        included) wait to be sent."""
        with self._lock:
            return self._queued() < frames and self.unsent_bytes + self._promised < nbytes

    def wait_below(self, frames: int, nbytes: int, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until below(frames, nbytes); whether it is."""
        def below() -> bool:
            return self.below(frames, nbytes)  # the lock is re-entrant

        with self._lock:
            if below():
                return True
            self._waiting_room += 1
            try:
                return self._room.wait_for(below, timeout_s)
            finally:
                self._waiting_room -= 1

    def discard(self) -> None:
        with self._lock:
            self._uncount_all()
            self._item_ready.notify_all()
            self._room.notify_all()
