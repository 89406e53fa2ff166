"""The reduction table's chunks summed on the summing pool (--threads N > 1).

On the loop thread the table says what happens to a chunk (open, add,
finish, release) and this module queues it on the chunk's partition of the
SummingPool; on the chunk's summing thread the tasks copy or add the wire
data into its float32 accumulator, and the finish divides (MEAN) and narrows
the result into its reply message, then posts it back to the table
(ReductionTable.land_result), which caches and delivers it. On the daemon's
CSummingPool (reducerd.core.summing_c) these are C tasks, on an accumulator the
pool owns (ChunkSums.acc), and what follows them (the room back, the
landing) runs when the loop takes their done tuples; with SummingPool, or
without the C kernels, they are the Python tasks below.

An accumulator lives as long as some thread may write it: every chunk gets
exactly one last task (the finish, or a discard queued when the chunk fails
or times out with adds still queued), behind all its adds, and that task
gives the accumulator's room back to the MemoryBudget. So bytes_held counts
it until no thread can touch it, and a failed chunk's queued adds run into
memory that is still its own (or are skipped) instead of freed memory.

Results are posted back to the loop thread, not put into the streams'
outboxes from the summing thread: the streams' state (what they wait for,
whether they ended), the gRPC outboxes (asyncio queues), the result cache and
the metrics all belong to the loop thread; one post per chunk (not per
contribution) costs little, and the fan-out to every contributor stays where
it was measured flat per contributor.

Numerics are the inline path's: float32 accumulation in the order the loop
counted the contributions, MEAN divided in float32 once, one rounding to the
wire dtype (reducerd.core.reduction).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any, Protocol

import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.dtypes import INTEGER_WIRES

from reducerd.core import accumulate
from reducerd.core.chunks import (
    ChunkId,
    Contribution,
    Delivery,
    OpenChunk,
    disagreeing_resend,
)
from reducerd.core.limits import MemoryBudget
from reducerd.core.replies import Reply, empty_result_reply, result_reply
from reducerd.core.summing import PoolClosed
from reducerd.core.summing_c import ADD, COPY, AnySummingPool, CSummingPool

__all__ = ["ChunkSums", "PooledSums", "SummedChunks", "narrow_result"]

log = logging.getLogger("reducerd")

_NO_ARRAY = np.empty(0, np.float32)  # a C-summed chunk's acc: the pool holds the real one


def narrow_result(cid: ChunkId, chunk: OpenChunk) -> Reply:
    """The chunk's reply: MEAN divided, the float32 sum rounded once into it."""
    acc = chunk.acc
    if chunk.op == pb.REDUCE_OP_MEAN:
        # Divide the float32 sum once, before the single rounding to the wire dtype.
        np.divide(acc, np.float32(chunk.world_size), out=acc)
    # Rounded once, straight into the reply message every sink gets.
    return result_reply(job=cid.job, key=cid.key, round=cid.round, offset=cid.offset,
                        dtype=chunk.dtype, op=chunk.op, world_size=chunk.world_size, acc=acc)


class ChunkSums:
    """A pooled chunk's summing state (its OpenChunk's `sums`).

    partition: fixed when the chunk opens, so its tasks run in order on one thread.
    fault: the first exception of its tasks (written and read on that thread).
    cancelled: set by the loop when the chunk failed: later tasks skip the work.
    ended: set by the loop once the last task (finish or discard) is queued.
    resends: contributions resent while the result was being summed, each
    answered after it as a resend to a completed chunk is: (the stream,
    None: the result once more; or the error to send it instead).
    """

    __slots__ = ("cid", "chunk", "partition", "acc", "fault", "cancelled", "ended", "resends")

    def __init__(self, cid: ChunkId, chunk: OpenChunk, partition: int, acc: Any) -> None:
        self.cid, self.chunk, self.partition = cid, chunk, partition
        # The C pool's accumulator when its tasks are C sums (CSummingPool; the
        # chunk's own acc is then empty), else None: Python tasks into chunk.acc.
        self.acc = acc
        self.fault: BaseException | None = None
        self.cancelled = False
        self.ended = False
        self.resends: list[tuple[Hashable, Delivery | None]] = []


class SummedChunks(Protocol):
    """What the pooled sums need of the reduction table (ReductionTable is one)."""

    budget: MemoryBudget

    def land_result(self, cid: ChunkId, chunk: OpenChunk, reply: Reply) -> None:
        """A summing thread finished `chunk` (called on the loop thread)."""

    def summing_failed(self, cid: ChunkId, chunk: OpenChunk, message: str) -> None:
        """A summing thread failed on `chunk` (called on the loop thread)."""


class PooledSums:
    """The table's side of the pool: loop-thread calls queue tasks on the chunk's partition."""

    def __init__(self, pool: AnySummingPool, table: SummedChunks) -> None:
        self.pool = pool
        self._c_pool = pool if isinstance(pool, CSummingPool) else None
        self._defer_results = False  # set while reclaim() drains inside a table call
        self.table = table
        self.budget = table.budget

    # -- loop thread ---------------------------------------------------------

    def takes(self, part: Contribution) -> bool:
        """Whether the chunk `part` opens is summed on the pool: a hand-off to a
        summing thread and back costs about as much CPU as adding 100-200 KiB
        (reducerd --help, --pool-chunk-bytes), so small chunks are summed inline,
        and so is every chunk while the daemon uses at most about one core
        (pool.busy: reducerd.ops.busy).
        Integer chunks are always summed inline: their int64 accumulator is
        NumPy's (neither the C tasks nor the pool's float32 arrays hold them)."""
        return (self.pool.busy and len(part.data) >= self.pool.min_chunk_bytes
                and part.dtype not in INTEGER_WIRES)

    def c_pool_for(self, part: Contribution) -> CSummingPool | None:
        """The C pool, if the chunk `part` opens is summed by its C tasks."""
        c_pool = self._c_pool
        return c_pool if c_pool is not None and c_pool.sums_in_c(part.dtype) else None

    def array_for(self, part: Contribution) -> np.ndarray:
        """The table's accumulator array for a pooled chunk: empty where the C
        pool holds the accumulator (ChunkSums.acc)."""
        return _NO_ARRAY if self.c_pool_for(part) else np.empty(part.numel, np.float32)

    def open(self, cid: ChunkId, chunk: OpenChunk, part: Contribution) -> None:
        """Queue the chunk's first contribution (copied into its accumulator)."""
        c_pool = self.c_pool_for(part)
        c_acc = c_pool.new_accumulator(chunk.numel) if c_pool is not None else None
        sums = chunk.sums = ChunkSums(cid, chunk, self.pool.pick_partition(), c_acc)
        try:
            self._queue(sums, self._copy, part, COPY)
        except BaseException:
            chunk.sums = None  # nothing queued: the table gives the room back
            raise

    def add(self, chunk: OpenChunk, part: Contribution) -> None:
        self._queue(chunk.sums, self._add, part, ADD)

    def finish(self, chunk: OpenChunk) -> None:
        """Queue the finish behind the adds; it posts the result to land_result."""
        sums: ChunkSums = chunk.sums
        sums.ended = True
        try:
            if sums.acc is not None:
                self._finish_in_c(sums)
            else:
                self.pool.submit(sums.partition, self._finish, sums)
        except BaseException:
            sums.ended = False  # not queued: release() must still give the room back
            raise

    def resent(self, cid: ChunkId, chunk: OpenChunk, part: Contribution,
               sink: Hashable) -> list[Delivery]:
        """A contribution to a chunk complete and being summed: answered as a
        completed chunk's resend (ReductionTable.contribute), after the result,
        once it lands (so the stream hears both in the inline path's order)."""
        error = disagreeing_resend(cid, part, sink, chunk.dtype, chunk.numel, chunk.world_size)
        chunk.sums.resends.append((sink, error))
        return []

    def resend_deliveries(self, cid: ChunkId, chunk: OpenChunk, reply: Reply,
                          ) -> list[Delivery]:
        """What each contribution resent while the result was summed gets."""
        return [error or Delivery(cid, chunk.dtype, chunk.op, chunk.world_size, (sink,),
                                  reply=reply, repeat=True)
                for sink, error in chunk.sums.resends]

    def release(self, chunk: OpenChunk) -> None:
        """The chunk left the table (done, failed, timed out): skip what is still
        queued for it; the room goes back once its last task ran."""
        sums: ChunkSums = chunk.sums
        sums.cancelled = True
        if sums.ended:
            return
        sums.ended = True
        try:
            if self._c_pool is not None and sums.acc is not None:
                self._c_pool.submit_mark(sums.partition, (self.budget.give_accumulator,
                                                          sums.acc.nbytes), sums.acc)
            else:
                self.pool.submit(sums.partition, self._discard, sums)
        except PoolClosed:  # no thread will touch it any more
            self.budget.give_accumulator(4 * chunk.numel)

    def _queue(self, sums: ChunkSums, task: Any, part: Contribution, kind: int) -> None:
        # The received data stays alive (and counted, against its job's share
        # too) until its task ran.
        nbytes, job = len(part.data), sums.cid.job
        self.budget.take_transport(nbytes, job)
        try:
            if self._c_pool is not None and sums.acc is not None:
                self._c_pool.submit_sum(sums.partition, kind, sums.acc, part.data, part.dtype,
                                        (self.budget.give_transport, nbytes, job))
            else:
                self.pool.submit(sums.partition, task, sums, part.data, part.dtype, nbytes,
                                 nbytes=nbytes)
        except BaseException:
            self.budget.give_transport(nbytes, job)
            raise

    def _finish_in_c(self, sums: ChunkSums) -> None:
        """The finish as a C task: the reply laid out here, the result divided
        (MEAN) and narrowed into its payload on the chunk's summing thread."""
        assert self._c_pool is not None
        cid, chunk = sums.cid, sums.chunk
        reply = empty_result_reply(job=cid.job, key=cid.key, round=cid.round,
                                   offset=cid.offset, dtype=chunk.dtype, op=chunk.op,
                                   world_size=chunk.world_size, numel=chunk.numel)
        divisor = chunk.world_size if chunk.op == pb.REDUCE_OP_MEAN else 0
        self._c_pool.submit_finish(sums.partition, sums.acc, reply.payload, chunk.dtype,
                                   divisor, (self._landed, sums, reply))

    def reclaim(self) -> None:
        """Give back now the room of C tasks that ran but whose done tuples the
        loop has not taken yet (the table, before it refuses a chunk for
        memory); results found land later, from a post, not inside the caller."""
        self._defer_results = True
        try:
            self.pool.drain()
        finally:
            self._defer_results = False

    def _landed(self, sums: ChunkSums, reply: Reply) -> None:
        """A C finish ran (on the loop thread): the room back, the result landed."""
        self.budget.give_accumulator(4 * sums.chunk.numel)
        if sums.cancelled:
            return
        if self._defer_results:
            self.pool.post(self._on_loop, self.table.land_result, sums, reply)
        else:
            self._on_loop(self.table.land_result, sums, reply)

    # -- the chunk's summing thread ------------------------------------------

    def _copy(self, scratch: accumulate.WideningBuffer, sums: ChunkSums,
              data: bytes | memoryview, dtype: int, nbytes: int) -> None:
        try:
            if sums.fault is None and not sums.cancelled:
                accumulate.copy_wire_into(sums.chunk.acc, data, dtype)
        except Exception as exc:
            self._fault(sums, exc)
        finally:
            self.budget.give_transport(nbytes, sums.cid.job)

    def _add(self, scratch: accumulate.WideningBuffer, sums: ChunkSums,
             data: bytes | memoryview, dtype: int, nbytes: int) -> None:
        try:
            if sums.fault is None and not sums.cancelled:
                acc = sums.chunk.acc
                accumulate.add_wire_into(acc, data, dtype, scratch.for_part(dtype, acc.size))
        except Exception as exc:
            self._fault(sums, exc)
        finally:
            self.budget.give_transport(nbytes, sums.cid.job)

    def _finish(self, scratch: accumulate.WideningBuffer, sums: ChunkSums) -> None:
        try:
            if sums.fault is None and not sums.cancelled:
                reply = narrow_result(sums.cid, sums.chunk)
                self.pool.post(self._on_loop, self.table.land_result, sums, reply)
        except Exception as exc:
            self._fault(sums, exc)
        finally:  # the last task of the chunk: no thread writes the accumulator now
            self.budget.give_accumulator(4 * sums.chunk.numel)

    def _discard(self, scratch: accumulate.WideningBuffer, sums: ChunkSums) -> None:
        self.budget.give_accumulator(4 * sums.chunk.numel)

    def _fault(self, sums: ChunkSums, exc: Exception) -> None:
        """Our own bug (or MemoryError): log it with its traceback, fail the chunk
        with INTERNAL on the loop thread, skip its remaining tasks."""
        log.error("reducerd fault while summing %s (a fault of the daemon, not of a "
                  "client): the chunk fails with INTERNAL", sums.cid.describe(), exc_info=exc)
        if sums.fault is None:
            sums.fault = exc
            message = (f"{sums.cid.describe()}: reducerd internal error (a fault of the "
                       f"daemon, not of this client) while summing: {exc!r}; the daemon's "
                       "log has the traceback")
            self.pool.post(self._on_loop, self.table.summing_failed, sums, message)

    # -- back on the loop thread ---------------------------------------------

    @staticmethod
    def _on_loop(fn: Any, sums: ChunkSums, *args: Any) -> None:
        try:
            fn(sums.cid, sums.chunk, *args)
        except Exception:  # the round timeout still fails the chunk for its streams
            log.exception("reducerd fault while handing back %s from its summing thread",
                          sums.cid.describe())
