"""What the table's records cost beside the bytes they describe.

An open chunk's accumulator is counted against --max-inflight-bytes; its
record (ChunkId, OpenChunk, rank set, sinks, the array object, dict entries)
and its job and key names are counted here, within a limit of their own
(ChunkRecords), and a failed chunk's record within FailedChunks' bytes
(limits.FAILURE_BYTES_KEPT). Without them a tenant opening 65,536 chunks of
2 bytes with 1,000-character names held 247-589 MiB the limit never saw.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from reducerd.core.chunks import JobStats
from reducerd.core.limits import JOBS_KEPT, idle_jobs_to_forget

__all__ = ["CHUNK_RECORD_BYTES", "FAILURE_RECORD_BYTES", "ChunkRecords", "JobRecords",
           "chunk_record_bytes",
           "failure_record_bytes", "record_refusal"]

# What an open chunk's bookkeeping costs beside its accumulator and names:
# its ChunkId, OpenChunk record, rank set, sink dict, the accumulator's array
# object, and its entries in the table's and its stream's dicts. Measured as
# the daemon's VmRSS growth per open chunk of 2 bytes with 1,000-character
# names (tests/adversarial/test_bookkeeping.py), less the names' own
# sys.getsizeof: 1.2 KiB with ASCII names, 1.8 KiB with 4-byte characters;
# counted with a margin.
CHUNK_RECORD_BYTES = 2560
# Records may hold 1/RECORD_SHARE of --max-inflight-bytes, at least
# RECORD_FLOOR_BYTES (about 1,800 chunks with short names), unless
# --max-record-bytes says otherwise; one job half of that.
RECORD_SHARE = 8
RECORD_FLOOR_BYTES = 4 << 20


# A failure record's own cost beside its names and message (Failure, its
# ChunkId, the dict entry).
FAILURE_RECORD_BYTES = 512


def failure_record_bytes(job: str, key: str, message: str) -> int:
    """What a failed chunk's record holds (FailedChunks keeps FAILURE_BYTES_KEPT)."""
    return (FAILURE_RECORD_BYTES + sys.getsizeof(job) + sys.getsizeof(key)
            + sys.getsizeof(message))


def chunk_record_bytes(job: str, key: str) -> int:
    """The memory an open chunk's bookkeeping holds, its job and key included
    (each counted once per chunk: a shard's names are its own strings)."""
    return CHUNK_RECORD_BYTES + sys.getsizeof(job) + sys.getsizeof(key)


class ChunkRecords:
    """What the open chunks' records hold, in all and per job, within a limit
    of their own: --max-record-bytes, or for 0 1/RECORD_SHARE of
    --max-inflight-bytes (RECORD_FLOOR_BYTES at least); one job half. The
    table's loop thread alone uses it."""

    def __init__(self, max_inflight_bytes: int, max_record_bytes: int = 0) -> None:
        self.limit_bytes = max_record_bytes or max(RECORD_FLOOR_BYTES,
                                                   max_inflight_bytes // RECORD_SHARE)
        self.held_bytes = 0

    @staticmethod
    def of(cid: Any) -> int:
        """What the records of chunk `cid` (a ChunkId) cost."""
        return chunk_record_bytes(cid.job, cid.key)

    def refusal(self, job_bytes: int, nbytes: int) -> str | None:
        """Why a chunk whose records cost `nbytes` may not open (its job's open
        chunks' records hold `job_bytes`), or None."""
        return record_refusal(self.held_bytes, job_bytes, nbytes, self.limit_bytes)

    def take(self, job: Any, chunk: Any, nbytes: int) -> None:
        """Count an opened chunk's records (its JobStats and OpenChunk keep them)."""
        chunk.record_bytes = nbytes
        job.record_bytes += nbytes
        self.held_bytes += nbytes

    def give(self, job: Any, chunk: Any) -> None:
        job.record_bytes -= chunk.record_bytes
        self.held_bytes -= chunk.record_bytes


def record_refusal(held_bytes: int, job_bytes: int, nbytes: int, limit_bytes: int,
                   ) -> str | None:
    """Why a chunk whose records cost `nbytes` may not open (the daemon's open
    chunks' records hold `held_bytes`, its job's `job_bytes`), or None."""
    if held_bytes + nbytes > limit_bytes:
        return (f"the daemon's open chunks' records (ids, names, bookkeeping) hold "
                f"{held_bytes} bytes; this chunk's need {nbytes} more, over the limit of "
                f"{limit_bytes} (--max-record-bytes; by default 1/{RECORD_SHARE} of "
                f"--max-inflight-bytes, 4 MiB at least)")
    if job_bytes + nbytes > limit_bytes // 2:
        return (f"job's open chunks' records (ids, names, bookkeeping) hold {job_bytes} "
                f"bytes; this chunk's need {nbytes} more, over its share of "
                f"{limit_bytes // 2} (half of --max-record-bytes)")
    return None


class JobRecords(dict[str, JobStats]):
    """The table's jobs by name: at most JOBS_KEPT (beyond, the least recently
    active eighth of those with nothing open goes first), and one with nothing
    open for `forget_after_s` (--job-idle-expiry) is forgotten, its counters
    and status row too: a tenant naming a new job in every shard cannot grow
    the table without bound."""

    def __init__(self, forget_after_s: float) -> None:
        super().__init__()
        self.forget_after_s = forget_after_s

    def admit(self, name: str) -> JobStats | None:
        """Job `name`'s record, made if new; None when JOBS_KEPT jobs all have chunks open."""
        job = self.get(name)
        if job is None:
            if len(self) >= JOBS_KEPT:
                for idle in idle_jobs_to_forget(self, max(1, JOBS_KEPT // 8)):
                    del self[idle]
                if len(self) >= JOBS_KEPT:
                    return None
            job = self[name] = JobStats(first_seen_s=time.time())
        return job

    def forget_idle(self, now: float) -> None:
        """Forget the jobs with nothing open since `forget_after_s` before `now` (table clock)."""
        for name in [name for name, job in self.items()
                     if not job.open_chunks and now - job.last_active_s > self.forget_after_s]:
            del self[name]
