"""The reduction table: open chunks, their accumulation, failures.

Pure Python and NumPy, no gRPC: the session checks and routes shards here and
delivers what this module returns. Every method runs on the daemon's event loop
thread, so the table needs no lock. With a summing pool (--threads N > 1) a
chunk of --pool-chunk-bytes or more is summed on its threads (chunk_sums); the
table counts every contribution, land_result delivers via `on_deliveries`.

Numerics: each chunk owns one float32 accumulator (int64 for the integer
wires: exact, reducerd.core.accumulate). The first contribution is converted
into it, the others are added in place; MEAN divides by world_size in float32
once all are in, then the result is rounded once to the wire dtype.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable

from reducerd.core import accumulate
from reducerd.core.chunk_sums import PooledSums, narrow_result
from reducerd.core.chunks import (
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    CachedResult,
    ChunkId,
    Contribution,
    Delivery,
    Failure,
    JobStats,
    OpenChunk,
    OpenChunks,
    disagreeing_resend,
    mismatch,
)
from reducerd.core.incarnations import Restart
from reducerd.core.limits import (
    MAX_OPEN_CHUNKS_PER_JOB,
    WORLD_SIZES_KEPT,
    MemoryBudget,
    describe_missing,
    job_inflight_limit,
    job_refusal,
)
from reducerd.core.names import short_name
from reducerd.core.records import ChunkRecords, JobRecords
from reducerd.core.replies import Reply
from reducerd.core.results import FailedChunks, ResultCache
from reducerd.core.summing_c import AnySummingPool

# The records and status code names live in reducerd.core.chunks; imported from here too.
__all__ = ["ChunkId", "Contribution", "Delivery", "ReductionTable", "JobStats",
           "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
           "INTERNAL", "FAILED_PRECONDITION"]

log = logging.getLogger("reducerd")

# A job with nothing open for this long is forgotten (its stats too): --job-idle-expiry.
JOB_FORGET_AFTER_S = 300.0
# The longest a restart waits (loop thread) for the summing threads to free the earlier era's.
RESTART_DRAIN_S = 2.0


class ReductionTable:
    """Every open chunk of every job, keyed by ChunkId.

    `contribute` returns the deliveries to make now; `expire` fails chunks
    past the round timeout; `drop_sink` forgets a stream that went away.

    Costs follow what arrived, not what a shard declares: missing ranks are
    listed lazily and capped, a job's open chunks are capped in count and bytes
    (reducerd.core.limits), and _open keeps the order in which chunks opened
    (OpenChunks), so expiry and GetStatus stop at the first chunk young enough.

    Completed chunks' results are kept for contributions resent after a broken
    stream, at most `max_inflight_bytes // 2` of them, and failures for the
    ranks that arrive after them (reducerd.core.results).
    """

    def __init__(self, round_timeout_s: float, max_inflight_bytes: int,
                 clock: Callable[[], float] = time.monotonic,
                 max_open_chunks_per_job: int = MAX_OPEN_CHUNKS_PER_JOB,
                 budget: MemoryBudget | None = None,
                 summing: AnySummingPool | None = None,
                 max_job_inflight_bytes: int | None = None,
                 job_forget_after_s: float = JOB_FORGET_AFTER_S,
                 max_record_bytes: int = 0) -> None:
        self.round_timeout_s, self.max_inflight_bytes = round_timeout_s, max_inflight_bytes
        self.records = ChunkRecords(max_inflight_bytes, max_record_bytes)  # and names
        self.max_open_chunks_per_job = max_open_chunks_per_job
        # What one job's open chunks may hold (Config.job_inflight_bytes; limits.job_refusal).
        self.max_job_inflight_bytes = job_inflight_limit(max_inflight_bytes,
                                                         max_job_inflight_bytes or 0)
        # Shared with the transports when the daemon builds it (their buffers count too).
        self.budget = budget or MemoryBudget(max_inflight_bytes)
        self.jobs = JobRecords(max(job_forget_after_s, round_timeout_s))
        self._clock = clock
        self._open = OpenChunks()
        self._failed = FailedChunks()
        self._results = ResultCache(max_inflight_bytes // 2)
        self._scratch = accumulate.WideningBuffer()
        self.accepting_new_chunks = True
        # None: the loop thread sums inline. Else pooled chunks land via on_deliveries.
        self._pooled = PooledSums(summing, self) if summing is not None else None
        self.on_deliveries: Callable[[list[Delivery]], None] = _undelivered

    # -- queries -------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        """Bytes of the open chunks' accumulators."""
        return self.budget.accumulator_bytes

    @property
    def cached_bytes(self) -> int:
        """Bytes of the completed chunks' results kept for resent contributions."""
        return self._results.bytes

    @property
    def open_chunk_count(self) -> int:
        return len(self._open)

    @property
    def sums_off_loop(self) -> bool:
        """Whether summing threads sum (results land later, via on_deliveries)."""
        return self._pooled is not None

    def completing(self, chunks: Iterable[ChunkId]) -> bool:
        """Whether one of `chunks` has all its contributions, its result not yet out."""
        return self._open.completing(chunks)

    def open_chunks(self, older_than_s: float = 0.0, at_most: int | None = None,
                    job: str = "") -> list[tuple[ChunkId, int, list[int], float]]:
        """(chunk, world_size, missing ranks, age in seconds), oldest first (OpenChunks.rows)."""
        return self._open.rows(self._clock(), older_than_s, at_most, job)

    def stalled_count(self, older_than_s: float) -> int:
        """Open chunks at least `older_than_s` old (without listing them)."""
        return self._open.stalled_count(self._clock(), older_than_s)

    # -- updates -------------------------------------------------------------

    def contribute(self, chunk: ChunkId, part: Contribution, sink: Hashable,
                   ) -> list[Delivery]:
        """Count `part` towards `chunk`; return the deliveries this causes."""
        now = self._clock()
        job = self.jobs.admit(chunk.job)
        if job is None:  # every job it keeps has chunks open
            return [self._error(chunk, part, (sink,), RESOURCE_EXHAUSTED,
                                f"{chunk.describe()}: the daemon holds open chunks of "
                                f"{len(self.jobs)} jobs, as many as it keeps")]
        if part.incarnation:  # an old client's 0 is never checked (reducerd.core.incarnations)
            verdict = job.incarnations.check(part.rank, part.incarnation, part.world_size)
            if isinstance(verdict, str):
                return [self._error(chunk, part, (sink,), FAILED_PRECONDITION,
                                    f"{chunk.describe()}: {verdict}", repeat=True)]
            if verdict is not None:
                return [*self._restart(chunk.job, job, verdict),
                        *self.contribute(chunk, part, sink)]
        if len(job.world_sizes) < WORLD_SIZES_KEPT:
            job.world_sizes.add(part.world_size)
        job.bytes_in += len(part.data)
        job.last_active_s = now
        if part.layout:
            if not job.layout or not job.open_chunks:
                job.layout, job.layout_rank = part.layout, part.rank
            elif part.layout != job.layout:
                return self._layout_mismatch(chunk, part, sink, job)

        failure = self._failed.get(chunk)
        if failure is not None:
            return [self._error(chunk, part, (sink,), failure.code, failure.message,
                                repeat=True)]
        result = self._results.get(chunk)
        if result is not None:  # answered from the cache, not counted
            error = disagreeing_resend(chunk, part, sink, result.dtype, result.numel,
                                       result.world_size)
            return [error or Delivery(chunk, result.dtype, result.op, result.world_size,
                                      (sink,), reply=result.reply, repeat=True)]

        open_chunk = self._open.get(chunk)
        if open_chunk is None:
            return self._open_chunk(chunk, part, sink, now, job)
        if open_chunk.sums is not None and open_chunk.sums.ended:  # complete, being summed
            return self._pooled.resent(chunk, open_chunk, part, sink)  # type: ignore[union-attr]

        disagreement = mismatch(open_chunk, part)
        if disagreement:
            message = f"{chunk.describe()}: {disagreement}"
            sinks = (*open_chunk.sinks, sink)
            return [self._fail(chunk, INVALID_ARGUMENT, message, sinks, part)]

        open_chunk.sinks[sink] = None
        if part.rank in open_chunk.ranks:
            return []  # a retry: already counted, this stream just waits too
        if open_chunk.sums is not None:
            self._pooled.add(open_chunk, part)  # type: ignore[union-attr] # in counted order
        else:
            accumulate.add_wire_into(open_chunk.acc, part.data, part.dtype,
                                     self._scratch.for_part(part.dtype, part.numel))
        open_chunk.ranks.add(part.rank)
        if len(open_chunk.ranks) < open_chunk.world_size:
            return []
        return self._complete(chunk, open_chunk, job)

    def expire(self) -> list[Delivery]:
        """Fail open chunks older than the round timeout; forget old failures."""
        now = self._clock()
        self._failed.expire(now)
        self._results.expire(now)
        self.jobs.forget_idle(now)  # their counters would otherwise pile up for ever
        deliveries = []
        for cid in self._open.late(now, self.round_timeout_s):
            chunk = self._open[cid]
            message = (f"{cid.describe()}: no contribution from rank(s) "
                       f"{describe_missing(chunk.world_size, chunk.ranks)} "
                       f"within the round timeout of {self.round_timeout_s:g} s")
            deliveries.append(self._fail(cid, DEADLINE_EXCEEDED, message,
                                         tuple(chunk.sinks)))
        return deliveries

    def fail_all(self, code: str, reason: str) -> list[Delivery]:
        """Fail every open chunk (used when the daemon shuts down)."""
        return [self._fail(cid, code, f"{cid.describe()}: {reason}", tuple(c.sinks))
                for cid, c in list(self._open.items())]

    def drop_sink(self, sink: Hashable, chunks: Iterable[ChunkId] | None = None) -> None:
        """Forget a stream that ended; its counted contributions stay counted.
        `chunks`: those it waits for (Stream.waiting), so that the cost follows
        them, not every open chunk; None looks in every open chunk."""
        for cid in self._open if chunks is None else chunks:
            chunk = self._open.get(cid)
            if chunk is not None:
                chunk.sinks.pop(sink, None)

    def land_result(self, cid: ChunkId, chunk: OpenChunk, reply: Reply) -> None:
        """A summing thread finished `chunk` (loop thread): deliver its result."""
        if self._open.get(cid) is not chunk:
            return  # failed meanwhile (round timeout, shutdown): its streams were told
        resent = self._pooled.resend_deliveries(cid, chunk, reply)  # type: ignore[union-attr]
        self.on_deliveries([self._completed(cid, chunk, self.jobs[cid.job], reply), *resent])

    def summing_failed(self, cid: ChunkId, chunk: OpenChunk, message: str) -> None:
        """A summing thread failed on `chunk` (our fault, logged): INTERNAL for all."""
        if self._open.get(cid) is chunk:
            self.on_deliveries([self._fail(cid, INTERNAL, message, tuple(chunk.sinks))])

    # -- internals -----------------------------------------------------------

    def _reclaimed(self, nbytes: int) -> bool:
        """Room for an accumulator once the loop took back what finished C sums freed."""
        if self._pooled is not None:
            self._pooled.reclaim()
        return self._pooled is not None and self.budget.take_accumulator(nbytes)

    def _open_chunk(self, cid: ChunkId, part: Contribution, sink: Hashable,
                    now: float, job: JobStats) -> list[Delivery]:
        nbytes = accumulate.accumulator_nbytes(part.dtype, part.numel)
        if not self.accepting_new_chunks:
            return [self._fail(cid, UNAVAILABLE, f"{cid.describe()}: daemon is shutting "
                               "down and opens no new chunks", (sink,), part)]
        refusal = job_refusal(job.open_chunks, job.open_chunk_bytes, nbytes,
                              self.max_open_chunks_per_job, self.max_job_inflight_bytes)
        refusal = refusal or self.records.refusal(job.record_bytes, record := self.records.of(cid))
        if refusal is not None:
            self.budget.note_pressure()
            return [self._fail(cid, RESOURCE_EXHAUSTED, f"{cid.describe()}: {refusal}",
                               (sink,), part)]
        if not self.budget.take_accumulator(nbytes) and not self._reclaimed(nbytes):
            message = (f"{cid.describe()}: daemon holds {self.bytes_held} bytes for open "
                       f"chunks and {self.budget.transport_bytes} for its connections; "
                       f"this chunk needs {nbytes} more, over the limit of "
                       f"{self.max_inflight_bytes} (--max-inflight-bytes)")
            return [self._fail(cid, RESOURCE_EXHAUSTED, message, (sink,), part)]
        chunk: OpenChunk | None = None
        try:
            pooled = self._pooled if self._pooled is not None and self._pooled.takes(part) else None
            acc = (pooled.array_for(part) if pooled
                   else accumulate.new_accumulator(part.dtype, part.numel))
            chunk = OpenChunk(first_rank=part.rank, world_size=part.world_size,
                              dtype=part.dtype, op=part.op, numel=part.numel, acc=acc,
                              started_s=now, ranks={part.rank}, sinks={sink: None})
            if pooled:
                pooled.open(cid, chunk, part)  # its last task gives the room back
            else:
                accumulate.copy_wire_into(acc, part.data, part.dtype)
        except BaseException:
            if chunk is None or chunk.sums is None:  # not opened: the room goes back
                self.budget.give_accumulator(nbytes)
            raise
        job.open_chunks += 1
        self.records.take(job, chunk, record)
        job.open_chunk_bytes += nbytes
        self._open[cid] = chunk
        if part.world_size == 1:
            return self._complete(cid, chunk, job)
        return []

    def _complete(self, cid: ChunkId, chunk: OpenChunk, job: JobStats) -> list[Delivery]:
        if chunk.sums is not None:  # open until its summing thread lands the result
            self._pooled.finish(chunk)  # type: ignore[union-attr]
            return []
        return [self._completed(cid, chunk, job, narrow_result(cid, chunk))]

    def _completed(self, cid: ChunkId, chunk: OpenChunk, job: JobStats,
                   reply: Reply) -> Delivery:
        self._release(cid, chunk, job)
        self._cache_result(cid, chunk, reply)
        job.chunks_completed += 1
        job.bytes_out += len(reply.payload) * len(chunk.sinks)
        return Delivery(cid, chunk.dtype, chunk.op, chunk.world_size,
                        tuple(chunk.sinks), reply=reply,
                        latency_s=self._clock() - chunk.started_s)

    def _fail(self, cid: ChunkId, code: str, message: str, sinks: tuple[Hashable, ...],
              part: Contribution | None = None) -> Delivery:
        chunk = self._open.get(cid)
        job = self.jobs[cid.job]
        if chunk is not None:
            if chunk.sums is not None:  # resent while summed: told too, not left waiting
                sinks = (*sinks, *(sink for sink, _ in chunk.sums.resends))
            self._release(cid, chunk, job)
        job.chunks_failed += 1
        self._failed.put(cid, Failure(code, message, self._clock() + self.round_timeout_s))
        ref = chunk or part
        assert ref is not None
        latency_s = self._clock() - chunk.started_s if chunk is not None else 0.0
        return Delivery(cid, ref.dtype, ref.op, ref.world_size, sinks,
                        error_code=code, error_message=message, latency_s=latency_s)

    def _error(self, cid: ChunkId, part: Contribution, sinks: tuple[Hashable, ...],
               code: str, message: str, repeat: bool = False) -> Delivery:
        return Delivery(cid, part.dtype, part.op, part.world_size, sinks,
                        error_code=code, error_message=message, repeat=repeat)

    def _layout_mismatch(self, cid: ChunkId, part: Contribution, sink: Hashable,
                         job: JobStats) -> list[Delivery]:
        """Fail the job's open chunks: its ranks disagree on the daemon list."""
        message = (f"job {short_name(cid.job)}: ranks {part.rank} and {job.layout_rank} disagree "
                   "on the chunk layout (the daemon list, its order, chunk_bytes, or a "
                   "client version that cuts keys by another rule); give every worker the "
                   "same REDUCER_ADDRESSES in the same order and the same reducer_client")
        deliveries = [self._fail(open_id, INVALID_ARGUMENT, message, tuple(c.sinks))
                      for open_id, c in self._open.of_job(cid.job)]
        if cid in self._open or cid in self._failed:
            deliveries.append(self._error(cid, part, (sink,), INVALID_ARGUMENT, message))
        else:
            deliveries.append(self._fail(cid, INVALID_ARGUMENT, message, (sink,), part))
        return deliveries

    def _restart(self, name: str, job: JobStats, verdict: Restart) -> list[Delivery]:
        """Drop what the job's earlier incarnation left: fail its open chunks,
        forget its failures and cached results (a new era began)."""
        message = (f"job {short_name(name)} restarted (rank {verdict.rank}: {verdict.reason}): "
                   "this round of the earlier incarnation is abandoned")
        failed = [self._fail(open_id, FAILED_PRECONDITION, f"{open_id.describe()}: {message}",
                             tuple(c.sinks))
                  for open_id, c in self._open.of_job(name)]
        if failed and self._pooled is not None:
            # A failed pooled chunk's room goes back once its summing thread ran its
            # last task (queued behind adds that now skip): let them run, so that the
            # new era's first contribution is not refused for the old era's memory.
            self._pooled.pool.wait_idle(RESTART_DRAIN_S)
            self._pooled.reclaim()  # C tasks' room comes back on this (the loop) thread
        self._failed.drop_job(name)  # the earlier incarnation's (and those just made)
        dropped = self._results.drop_job(name)
        log.info("job %s restarted (rank %d: %s; era %d): %d open chunk(s) failed, %d cached "
                 "result(s) dropped", short_name(name), verdict.rank, verdict.reason,
                 job.incarnations.era, len(failed), dropped)
        return failed

    def _cache_result(self, cid: ChunkId, chunk: OpenChunk, reply: Reply) -> None:
        self._results.put(cid, CachedResult(chunk.dtype, chunk.op, chunk.world_size,
                                            chunk.numel, reply,
                                            self._clock() + self.round_timeout_s))

    def _release(self, cid: ChunkId, chunk: OpenChunk, job: JobStats) -> None:
        if self._open.pop(cid, None) is not None:
            if chunk.sums is None:
                self.budget.give_accumulator(
                    accumulate.accumulator_nbytes(chunk.dtype, chunk.numel))
            else:  # its summing thread gives the room back after its last task
                assert self._pooled is not None
                self._pooled.release(chunk)
                chunk.sums = None  # no cycle: all goes once the last task ran, not at a GC pass
            job.open_chunks -= 1
            job.open_chunk_bytes -= accumulate.accumulator_nbytes(chunk.dtype, chunk.numel)
            self.records.give(job, chunk)


def _undelivered(deliveries: list[Delivery]) -> None:
    raise RuntimeError("a summed chunk landed, but the table has no on_deliveries "
                       "(the Session sets it)")
