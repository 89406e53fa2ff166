"""The summing pool on C threads (reducerd/core/_sumpool.c): SummingPool's interface,
and sums that never take the GIL.

SummingPool's threads are Python threads: each task takes the GIL to start,
again after its kernel, and once more to count itself done, and every one of
those hand-offs can wait for the loop thread and wake it (on a 2-vCPU VM:
2.5 context switches per 1 MiB task, and the two threads burned 1.6 cores for
the work one core did inline: scripts/daemon_threads.py). Here a chunk's copy, adds and
finish (MEAN's divide and the narrowing into its reply) are C tasks with the
wire kernels' C API: no GIL and no Python on the summing threads. What the
loop must do after them (give back the room, land the result) comes back as
`done` tuples, fn(*args), which the loop takes in one batch per wake-up
(drain): from an eventfd it watches (start's add_reader), or, without one,
posted by a summing thread.

Python tasks (submit, as SummingPool's) run on the same threads with the GIL,
in the same FIFO order: the NumPy path (the daemon's wire_numpy) and tests.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from reducer_wire import convert, quant
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.accumulate import WideningBuffer
from reducerd.core.summing import (
    QUEUED_BYTES_PER_THREAD,
    QUEUED_SHARE_OF_BUDGET,
    SWITCH_INTERVAL_S,
    PoolClosed,
    SummingPool,
    pool_bounds,
    post_to_loop,
)

try:
    import reducerd.core._sumpool as _sumpool
except ImportError:  # built without a C compiler: SummingPool's Python threads
    _sumpool = None  # type: ignore[assignment]

__all__ = ["CSummingPool", "AnySummingPool", "summing_pool", "COPY", "ADD"]

log = logging.getLogger("reducerd")

COPY, ADD, _FINISH = 0, 1, 2

# The C pool's codec and its parameter for each wire dtype (_sumpool.c).
_CODECS: dict[int, tuple[int, int]] = {
    pb.DTYPE_FLOAT32: (0, 0),
    pb.DTYPE_FLOAT16: (1, 0),
    pb.DTYPE_BFLOAT16: (2, 0),
    pb.DTYPE_INT8_BLOCK128: (3, quant.INT8_BLOCK),
    pb.DTYPE_FP8_E4M3: (4, quant.E4M3.kind),
    pb.DTYPE_FP8_E5M2: (4, quant.E5M2.kind),
}

Post = Callable[..., Any]
AddReader = Callable[[int, Callable[[], None]], Any]


def summing_pool(threads: int, min_chunk_bytes: int = 0, budget_bytes: int | None = None,
                 coalesce_at_most: int | None = None) -> SummingPool | CSummingPool:
    """The daemon's pool: on C threads where the extension was built; what it
    queues at most is capped by its share of the memory budget, if given.
    `coalesce_at_most`: the C pool's (CSummingPool); None, its default."""
    at_most = threads * QUEUED_BYTES_PER_THREAD
    if budget_bytes is not None:
        at_most = min(at_most, budget_bytes // QUEUED_SHARE_OF_BUDGET)
    if _sumpool is None:
        return SummingPool(threads, queued_bytes_at_most=at_most, min_chunk_bytes=min_chunk_bytes)
    return CSummingPool(threads, queued_bytes_at_most=at_most, min_chunk_bytes=min_chunk_bytes,
                        coalesce_at_most=coalesce_at_most)


class CSummingPool:
    """N summing threads in C, one FIFO each; sums in C, other tasks as task(scratch, *args)."""

    def __init__(self, threads: int, queued_bytes_at_most: int | None = None,
                 min_chunk_bytes: int = 0, coalesce_at_most: int | None = None) -> None:
        """`coalesce_at_most`: a chunk's queued copy and adds that a thread sums
        in one pass, at most (1: each alone; None: the extension's default)."""
        if _sumpool is None:
            raise RuntimeError("reducerd.core._sumpool was not built (no C compiler at install)")
        self.queued_bytes_at_most = pool_bounds(threads, queued_bytes_at_most, min_chunk_bytes)
        self.threads = threads
        self.min_chunk_bytes = min_chunk_bytes
        self.busy = True  # as SummingPool's
        extra = {} if coalesce_at_most is None else {"coalesce_at_most": coalesce_at_most}
        self._c = _sumpool.Pool(threads, self.queued_bytes_at_most, **extra)
        # Python tasks get their partition's scratch: a partition runs on one thread.
        self._scratch = [WideningBuffer() for _ in range(threads)]
        self._next = 0
        self._post: Post | None = None

    # -- loop thread ---------------------------------------------------------

    def start(self, post: Post, add_reader: AddReader | None = None) -> None:
        """Start the threads. `post(fn, *args)` runs fn on the loop thread later;
        with `add_reader(fd, callback)` (the loop's), finished sums wake the loop
        through the pool's eventfd instead of a post."""
        if self._c.started:
            raise RuntimeError("summing pool already started")
        self._post = post
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        if add_reader is not None:
            add_reader(self._c.fileno(), self.drain)
        self._c.start(lambda: self.post(self.drain), add_reader is not None)
        log.info("summing on %d threads (chunks of %d wire bytes or more; smaller ones on "
                 "the event loop's thread), in C", self.threads, self.min_chunk_bytes)

    @property
    def started(self) -> bool:
        return bool(self._c.started)

    def pick_partition(self) -> int:
        """The partition for a chunk that opens: the least loaded, in turn on ties."""
        best = self._c.pick_partition(self._next)
        self._next = (best + 1) % self.threads
        return int(best)

    def submit(self, partition: int, task: Callable[..., None], *args: Any,
               nbytes: int = 0) -> None:
        """Queue task(scratch, *args) behind `partition`'s earlier tasks, as
        SummingPool.submit does (waits for room; PoolClosed once closed)."""
        if not self._c.submit_call(partition, self._run, (partition, task, args), nbytes):
            raise PoolClosed("the summing pool is closed (the daemon is stopping)")

    def sums_in_c(self, dtype: int) -> bool:
        """Whether contributions of `dtype` are summed by the C tasks (else
        NumPy's, as Python tasks: the daemon's wire_numpy setting)."""
        return dtype in _CODECS and convert.accelerated()

    def new_accumulator(self, numel: int) -> Any:
        """A chunk's float32 accumulator for the C tasks (reducerd.core._sumpool.
        Accumulator): memory the pool owns, not touched until its first task,
        which may swap in its thread's spare; given back by its finish or a
        mark. A buffer (np.frombuffer) while held and none of its tasks queued."""
        return self._c.new_accumulator(numel)

    def submit_sum(self, partition: int, kind: int, acc: Any, data: Any, dtype: int,
                   done: tuple[Any, ...]) -> None:
        """Queue COPY (data widened into acc) or ADD (data added to acc) in C;
        the loop runs done[0](*done[1:]) once it ran (the data is held till then)."""
        codec, param = _CODECS[dtype]
        if not self._c.submit_sum(partition, kind, acc, data, codec, param, len(data), done):
            raise PoolClosed("the summing pool is closed (the daemon is stopping)")

    def submit_finish(self, partition: int, acc: Any, payload: Any, dtype: int,
                      divisor: int, done: tuple[Any, ...]) -> None:
        """Queue the finish: acc divided by `divisor` (0: not), rounded into
        `payload` (the reply's data field), its memory given back; then done."""
        codec, param = _CODECS[dtype]
        if not self._c.submit_sum(partition, _FINISH, acc, payload, codec, param, 0, done,
                                  float(divisor)):
            raise PoolClosed("the summing pool is closed (the daemon is stopping)")

    def submit_mark(self, partition: int, done: tuple[Any, ...], acc: Any = None) -> None:
        """Queue nothing but `done`, run on the loop once the earlier tasks ran;
        with `acc`, its memory is given back then (a chunk that failed)."""
        queued = (self._c.submit_mark(partition, done) if acc is None
                  else self._c.submit_mark(partition, done, acc))
        if not queued:
            raise PoolClosed("the summing pool is closed (the daemon is stopping)")

    @property
    def spare_bytes(self) -> int:
        """Accumulator memory the threads keep for their next chunks: one each at
        most, of 4 MiB at most (a 1 MiB chunk of any wire dtype), not counted
        in the memory budget."""
        return int(self._c.spare_bytes)

    def drain(self) -> None:
        """Run the done tuples of the sums finished so far (the loop thread)."""
        for fn, *args in self._c.take_done():
            try:
                fn(*args)
            except Exception:  # one failing must not strand the rest
                log.exception("reducerd fault after a summing task (%r)", fn)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop thread (from a summing thread); dropped
        once the loop is gone."""
        post_to_loop(self._post, fn, *args)

    @property
    def pending(self) -> int:
        """Tasks queued or running."""
        return int(self._c.pending)

    @property
    def coalesced(self) -> int:
        """Copies and adds summed so far in a pass with others of their chunk
        (each found queued behind the first: the threads were behind)."""
        return self._c.sums()[1]

    @property
    def summed(self) -> int:
        """Copies and adds run so far."""
        return self._c.sums()[0]

    @property
    def finished_in_pass(self) -> int:
        """Finishes run in a pass with their chunk's adds, so far: the sum
        narrowed into the reply while its pieces were still in L1."""
        return self._c.sums()[2]

    @property
    def queued_bytes(self) -> int:
        return int(self._c.queued_bytes)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no task is queued or running; False after `timeout_s`."""
        return bool(self._c.wait_idle(float(timeout_s)))

    def close(self, timeout_s: float = 10.0) -> bool:
        """Refuse new tasks, run every queued one, stop the threads; False if
        some thread was still busy after `timeout_s`."""
        stopped = bool(self._c.close(float(timeout_s)))
        summed, coalesced, finished = self._c.sums()
        if summed:
            log.info("summing threads: %d of %d copies and adds summed in passes with "
                     "others of their chunk (queued behind it), %d finishes in those passes",
                     coalesced, summed, finished)
        if not stopped:
            log.error("summing threads still busy %g s after the pool closed", timeout_s)
        return stopped

    # -- summing threads -----------------------------------------------------

    def _run(self, partition: int, task: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            task(self._scratch[partition], *args)
        except Exception:  # tasks answer their own faults; this one is a bug
            log.exception("reducerd fault in summing thread %d (task %r)", partition, task)


AnySummingPool = SummingPool | CSummingPool
