"""The summing pool: threads that add contributions off the event loop (--threads N).

The event-loop thread keeps the reduction table's bookkeeping (which ranks
arrived, who waits, limits, failures, timeouts) and hands the arithmetic to
N summing threads, each with its own FIFO queue (a partition). A chunk is
given one partition when it opens (pick_partition) and keeps it for life, so
its adds run one after the other in the order the loop counted them: an
accumulator is only ever written by one thread, and no lock is held while
adding. The C kernels (reducer_wire._kernels) and NumPy release the GIL, so
the threads sum side by side, beside the loop and the data plane's threads.

Bounds: the loop thread waits in submit() while more than
`queued_bytes_at_most` of input is queued (as it waits today while it sums
inline), so a slow pool slows the readers down instead of buffering their
frames without limit. A summing thread never waits for the loop: it posts
what the loop must do (deliver a result) with `post` (the loop's
call_soon_threadsafe), which never blocks.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from reducerd.core.accumulate import WideningBuffer

__all__ = ["SummingPool", "PoolClosed", "QUEUED_BYTES_PER_THREAD", "QUEUED_SHARE_OF_BUDGET"]

log = logging.getLogger("reducerd")

# Input queued per summing thread before the loop waits. A chunk's
# contributions all queue on its one thread (8 contributors of 1 MiB: 8 MiB),
# so this is four such chunks: with 8 MiB (one) a thread often ran dry while
# the loop waited for room (2 threads, scripts/daemon_threads.py: 1.69x one thread's
# rate, 1.86x with 32 MiB). The daemon caps the pool's total at an eighth of
# --max-inflight-bytes, which counts what is queued (as transport bytes).
QUEUED_BYTES_PER_THREAD = 32 << 20
QUEUED_SHARE_OF_BUDGET = 8
# The GIL's switch interval while summing threads run. A summing thread back
# from a kernel needs the GIL for a few microseconds to take its next task;
# under the default 5 ms a thread busy in Python (the loop, the data plane's
# readers) can keep it waiting that long each time, its core idle (measured:
# twice the wall time for the same sums). Forced switches every 0.5 ms cost
# a few microseconds each.
SWITCH_INTERVAL_S = 0.0005
_STOP = object()

Post = Callable[..., Any]


class PoolClosed(RuntimeError):
    """Work handed to a pool that was closed (the daemon is stopping)."""


class _Partition:
    """One summing thread's FIFO (a C queue: put and get cost no Python lock)."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.queued_bytes = 0  # guarded by the pool's _lock; read unlocked as a hint


def post_to_loop(post: Post | None, fn: Callable[..., Any], *args: Any) -> None:
    """post(fn, *args), the loop's call_soon_threadsafe; dropped once the loop
    is closed (the daemon is gone)."""
    assert post is not None, "post before start"
    try:
        post(fn, *args)
    except RuntimeError:
        pass


def pool_bounds(threads: int, queued_bytes_at_most: int | None, min_chunk_bytes: int) -> int:
    """A pool's arguments checked (both pools take the same); the queued input
    it holds at most, QUEUED_BYTES_PER_THREAD per thread by default."""
    if threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    if min_chunk_bytes < 0:
        raise ValueError(f"min_chunk_bytes: must be >= 0, got {min_chunk_bytes}")
    return (queued_bytes_at_most if queued_bytes_at_most is not None
            else threads * QUEUED_BYTES_PER_THREAD)


class SummingPool:
    """N summing threads, one FIFO each; tasks run as task(scratch, *args)."""

    def __init__(self, threads: int, queued_bytes_at_most: int | None = None,
                 min_chunk_bytes: int = 0) -> None:
        self.queued_bytes_at_most = pool_bounds(threads, queued_bytes_at_most, min_chunk_bytes)
        self.threads = threads
        # Chunks of fewer wire bytes per contribution are summed on the loop
        # thread instead (reducerd.core.chunk_sums.PooledSums.takes), and so is every
        # new chunk while `busy` is False (set by the daemon: reducerd.ops.busy).
        self.min_chunk_bytes = min_chunk_bytes
        self.busy = True
        self._parts = [_Partition() for _ in range(threads)]
        # _lock guards the counts (_queued_bytes, _pending, each partition's
        # queued_bytes), _closed and _waiters; taken by the loop thread in
        # submit and by each summing thread after a task, never while a task
        # runs. _changed (on _lock) wakes a submit waiting for room or a
        # wait_idle, and only those: the hot path notifies nobody.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiters = 0
        self._queued_bytes = 0
        self._pending = 0  # tasks queued or running
        self._closed = False
        self._next = 0  # where pick_partition starts looking (loop thread only)
        self._workers: list[threading.Thread] = []
        self._post: Post | None = None

    # -- loop thread ---------------------------------------------------------

    def start(self, post: Post, add_reader: Callable[..., Any] | None = None) -> None:
        """Start the threads; `post(fn, *args)` runs fn on the loop thread later.
        (`add_reader`, the loop's, is for CSummingPool's eventfd: unused here.)"""
        if self._workers:
            raise RuntimeError("summing pool already started")
        self._post = post
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        for index, part in enumerate(self._parts):
            worker = threading.Thread(target=self._run, args=(index, part), daemon=True,
                                      name=f"reducerd-sum-{index}")
            worker.start()
            self._workers.append(worker)
        log.info("summing on %d threads (chunks of %d wire bytes or more; smaller ones on "
                 "the event loop's thread)", self.threads, self.min_chunk_bytes)

    @property
    def started(self) -> bool:
        return bool(self._workers)

    def pick_partition(self) -> int:
        """The partition for a chunk that opens: the least loaded, in turn on ties."""
        best, best_bytes = self._next, self._parts[self._next].queued_bytes
        for step in range(1, self.threads):
            index = (self._next + step) % self.threads
            if self._parts[index].queued_bytes < best_bytes:
                best, best_bytes = index, self._parts[index].queued_bytes
        self._next = (best + 1) % self.threads
        return best

    def submit(self, partition: int, task: Callable[..., None], *args: Any,
               nbytes: int = 0) -> None:
        """Queue task(scratch, *args) behind `partition`'s earlier tasks. Waits
        while more than queued_bytes_at_most of input is queued (until half of
        it is left); raises PoolClosed once the pool is closed."""
        part = self._parts[partition]
        with self._lock:
            if (self._queued_bytes and not self._closed
                    and self._queued_bytes + nbytes > self.queued_bytes_at_most):
                self._waiters += 1
                try:  # the summing threads run on meanwhile: they never wait for us
                    while (self._queued_bytes > self.queued_bytes_at_most // 2
                           and not self._closed):
                        self._changed.wait()
                finally:
                    self._waiters -= 1
            if self._closed:
                raise PoolClosed("the summing pool is closed (the daemon is stopping)")
            self._queued_bytes += nbytes
            self._pending += 1
            part.queued_bytes += nbytes
        part.items.put((task, args, nbytes))

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop thread (from a summing thread); dropped
        once the loop is gone."""
        post_to_loop(self._post, fn, *args)

    def drain(self) -> None:
        """Nothing: each task gives its room back itself (CSummingPool's loop
        thread does that for its C tasks here)."""

    @property
    def pending(self) -> int:
        """Tasks queued or running."""
        return self._pending

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no task is queued or running; False after `timeout_s`."""
        with self._lock:
            self._waiters += 1
            try:
                return self._changed.wait_for(lambda: self._pending == 0, timeout_s)
            finally:
                self._waiters -= 1

    def close(self, timeout_s: float = 10.0) -> bool:
        """Refuse new tasks, run every queued one, stop the threads; False if
        some thread was still busy after `timeout_s` (it stays a daemon thread)."""
        with self._lock:
            already = self._closed
            self._closed = True
            self._changed.notify_all()  # a submit waiting for room gives up
        if not already:
            for part in self._parts:
                part.items.put(_STOP)  # behind the queued tasks: they run first
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        stuck = [w.name for w in self._workers if w.is_alive()]
        if stuck and not already:
            log.error("summing threads %s still busy %g s after the pool closed",
                      ", ".join(stuck), timeout_s)
        return not stuck

    # -- summing threads -----------------------------------------------------

    def _run(self, index: int, part: _Partition) -> None:
        scratch = WideningBuffer()  # this thread's own (NumPy's widening, no C kernels)
        while True:
            item = part.items.get()  # blocks with the GIL released
            if item is _STOP:
                return
            task, args, nbytes = item
            try:
                task(scratch, *args)
            except Exception:  # tasks answer their own faults; this one is a bug
                log.exception("reducerd fault in summing thread %d (task %r)", index, task)
            finally:
                # Not kept while waiting for the next task: a chunk's last task
                # holds its accumulator.
                del item, task, args
                with self._lock:
                    part.queued_bytes -= nbytes
                    self._queued_bytes -= nbytes
                    self._pending -= 1
                    if self._waiters:
                        self._changed.notify_all()
