"""What the table keeps of chunks that ended: results for resends, failures for latecomers.

A result is kept until the next round of the same chunk completes (or one
round timeout passes, or the cache needs room: the oldest goes first), so a
contribution resent after a broken stream gets the result again instead of
opening the round anew. One job's results take at most 1/JOB_CACHE_SHARE of
the cache (beyond, its own oldest go): a job that completes chunk after
chunk of new keys cannot push the other jobs' results out. Every method runs
on the event loop's thread.

A failed chunk is remembered for one round timeout (FailedChunks), so ranks
that arrive after the failure get the same error instead of waiting for
nothing; at most FAILURES_KEPT of them, the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from reducerd.core.chunks import CachedResult, ChunkId, Failure
from reducerd.core.limits import FAILURE_BYTES_KEPT, FAILURES_KEPT, JOB_CACHE_SHARE
from reducerd.core.records import failure_record_bytes

__all__ = ["ResultCache", "FailedChunks", "JOB_CACHE_SHARE", "ENTRY_BYTES"]

# Beside its reply, what an entry holds: its records here and in the table
# (the ChunkId, CachedResult, Reply, three dict entries), measured at about
# 1.5 KiB, plus its key and job names. Counted, so that many tiny results
# cannot hold several times the cache's bound (3.4x uncounted, 1 KiB keys).
ENTRY_BYTES = 1536


def _entry_bytes(cid: ChunkId, result: CachedResult) -> int:
    return result.reply.held_bytes + len(cid.key) + len(cid.job) + ENTRY_BYTES


class _JobResults:
    """One job's cached results, oldest first, and their bytes."""

    __slots__ = ("ids", "bytes")

    def __init__(self) -> None:
        self.ids: OrderedDict[ChunkId, None] = OrderedDict()
        self.bytes = 0


class ResultCache:
    """At most `max_bytes` of entries: reply messages (the very bytes sent the
    first time) and what each entry holds beside them (ENTRY_BYTES)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._results: OrderedDict[ChunkId, CachedResult] = OrderedDict()  # oldest first
        # (job, key, offset) -> round of the cached result, to drop older rounds.
        self._latest_round: dict[tuple[str, str, int], int] = {}
        self._jobs: dict[str, _JobResults] = {}

    def __contains__(self, cid: object) -> bool:
        return cid in self._results

    def __iter__(self) -> Iterator[ChunkId]:
        return iter(self._results)

    def get(self, cid: ChunkId) -> CachedResult | None:
        return self._results.get(cid)

    def put(self, cid: ChunkId, result: CachedResult) -> None:
        """Keep `result`, dropping the chunk's older round and, for room, the job's
        own oldest (over its share), then the oldest of all."""
        self.drop(cid)  # a result put again is counted once
        slot = (cid.job, cid.key, cid.offset)
        previous = self._latest_round.get(slot)
        if previous is not None and previous < cid.round:
            self.drop(ChunkId(cid.job, cid.key, previous, cid.offset))
        nbytes = _entry_bytes(cid, result)
        job_max = self.max_bytes // JOB_CACHE_SHARE
        if nbytes > job_max:
            return
        own = self._jobs.get(cid.job)
        while own is not None and own.bytes + nbytes > job_max:
            self.drop(next(iter(own.ids)))
            own = self._jobs.get(cid.job)
        while self.bytes + nbytes > self.max_bytes and self._results:
            self.drop(next(iter(self._results)))
        own = self._jobs.setdefault(cid.job, _JobResults())
        self._results[cid] = result
        self._latest_round[slot] = cid.round
        own.ids[cid] = None
        own.bytes += nbytes
        self.bytes += nbytes

    def drop(self, cid: ChunkId) -> None:
        result = self._results.pop(cid, None)
        if result is not None:
            nbytes = _entry_bytes(cid, result)
            self.bytes -= nbytes
            own = self._jobs[cid.job]
            del own.ids[cid]
            own.bytes -= nbytes
            if not own.ids:
                del self._jobs[cid.job]
            slot = (cid.job, cid.key, cid.offset)
            if self._latest_round.get(slot) == cid.round:
                del self._latest_round[slot]

    def drop_job(self, name: str) -> int:
        """Drop the job's results; how many there were."""
        own = self._jobs.get(name)
        ids = list(own.ids) if own is not None else []
        for cid in ids:
            self.drop(cid)
        return len(ids)

    def expire(self, now: float) -> None:
        """Drop the results kept past their expiry (table clock)."""
        for cid in [cid for cid, r in self._results.items() if r.expires_s <= now]:
            self.drop(cid)

    def clear(self) -> None:
        for cid in list(self._results):
            self.drop(cid)


class FailedChunks:
    """The failures of recent chunks, oldest first, at most FAILURES_KEPT and
    FAILURE_BYTES_KEPT of them (Failure.nbytes)."""

    def __init__(self) -> None:
        self._failures: dict[ChunkId, Failure] = {}
        self.nbytes = 0  # the sum of their nbytes

    def __contains__(self, cid: object) -> bool:
        return cid in self._failures

    def __len__(self) -> int:
        return len(self._failures)

    def get(self, cid: ChunkId) -> Failure | None:
        return self._failures.get(cid)

    def put(self, cid: ChunkId, failure: Failure) -> None:
        failure.nbytes = failure.nbytes or failure_record_bytes(cid.job, cid.key, failure.message)
        old = self._failures.pop(cid, None)
        self.nbytes += failure.nbytes - (old.nbytes if old is not None else 0)
        self._failures[cid] = failure
        while len(self._failures) > FAILURES_KEPT or self.nbytes > FAILURE_BYTES_KEPT:
            self.nbytes -= self._failures.pop(next(iter(self._failures))).nbytes  # oldest

    def expire(self, now: float) -> None:
        """Forget the failures past their expiry (table clock)."""
        self._failures = {cid: f for cid, f in self._failures.items() if f.expires_s > now}
        self.nbytes = sum(f.nbytes for f in self._failures.values())

    def drop_job(self, name: str) -> None:
        for cid in [cid for cid in self._failures if cid.job == name]:
            self.nbytes -= self._failures.pop(cid).nbytes
