"""Limits that hold whatever a client declares: world sizes, missing ranks, held bytes.

A shard's world_size is only a number the client wrote: the daemon's cost
must follow what arrived (the ranks that contributed, the bytes received),
never what was declared. So missing ranks are computed lazily and at most
MISSING_LISTED_AT_MOST of them are named, in messages and in GetStatus.

MemoryBudget is the one count of the bytes the daemon holds against
--max-inflight-bytes: float32 accumulators (the table, on the loop thread),
and the transports' receive buffers and replies not yet sent (any thread).
Of the transports' bytes, one job holds at most 1/JOB_TRANSPORT_SHARE of the
limit: a job whose clients do not read their replies pauses its own streams
(their readers wait for its share to come free), and cannot take the room
every other job needs (a stream counts against its token's job, else the job
of its first shard).
"""

from __future__ import annotations

import heapq
import queue
import threading
from collections.abc import Collection, Mapping
from typing import Any

from reducerd.core.names import short_name

__all__ = ["MAX_OPEN_CHUNKS_PER_JOB", "MISSING_LISTED_AT_MOST", "WORLD_SIZES_KEPT",
           "TRANSPORT_RESERVE_SHARE", "JOB_TRANSPORT_SHARE", "FAILURES_KEPT", "missing_ranks",
           "describe_missing", "job_refusal", "job_inflight_limit", "JOB_ACCUMULATOR_SHARE",
           "JOB_CACHE_SHARE", "JOB_STREAM_SHARE", "JOBS_KEPT", "idle_jobs_to_forget",
           "FAILURE_BYTES_KEPT",
           "StreamCount", "MemoryBudget", "PyMemoryBudget", "Credit"]

# Open chunks one job may hold (the default of --max-open-chunks-per-job).
MAX_OPEN_CHUNKS_PER_JOB = 65536
# Ranks named per chunk in a failure message and in GetStatus.
MISSING_LISTED_AT_MOST = 64
# Distinct world sizes remembered per job (GetStatus lists them).
WORLD_SIZES_KEPT = 16
# The daemon's accumulators leave 1/8 of --max-inflight-bytes to its connections.
TRANSPORT_RESERVE_SHARE = 8
# One job's receive buffers and unsent replies hold at most 1/2 of the limit.
JOB_TRANSPORT_SHARE = 2
# One job's open chunks hold at most 1/2 of --max-inflight-bytes in
# accumulators unless --max-inflight-bytes-per-job says otherwise.
JOB_ACCUMULATOR_SHARE = 2
# One job's results kept for resends take at most 1/2 of the result cache.
JOB_CACHE_SHARE = 2
# One job's streams (its token's: the job is known when they open) take at most
# 1/2 of a plane's cap, so one tenant cannot take every connection or call.
JOB_STREAM_SHARE = 2
# Jobs the table keeps records of (counters, incarnations, layout: about 3 KiB
# each). Beyond, the least recently active eighth of those with nothing open
# is forgotten before its --job-idle-expiry: a tenant naming a new job in every shard
# cannot grow the table without bound.
JOBS_KEPT = 16384
# Failed chunks remembered (a late contributor hears the failure, for a round
# timeout), the oldest forgotten first beyond this: a tenant whose every shard
# is refused (limits, mismatches) cannot grow the table without bound (each
# record holds its message and chunk id: FAILURE_BYTES_KEPT bounds their bytes).
FAILURES_KEPT = 8192
# And at most this many bytes of them (with their chunk ids: 1,000 four-byte
# characters of job and of key are 8 KiB a record).
FAILURE_BYTES_KEPT = 16 << 20


def missing_ranks(world_size: int, present: Collection[int],
                  at_most: int = MISSING_LISTED_AT_MOST) -> tuple[list[int], int]:
    """The lowest `at_most` ranks below `world_size` not in `present`, and how
    many are missing in all. At most at_most + len(present) steps, whatever
    world_size says."""
    total = world_size - len(present)
    wanted = min(at_most, total)
    listed: list[int] = []
    rank = 0
    while len(listed) < wanted:
        if rank not in present:
            listed.append(rank)
        rank += 1
    return listed, total


def describe_missing(world_size: int, present: Collection[int]) -> str:
    """'1, 3 of 4', or '0, 1, ... 63 and 4294967231 more of 4294967295'."""
    listed, total = missing_ranks(world_size, present)
    more = f" and {total - len(listed)} more" if total > len(listed) else ""
    return f"{', '.join(map(str, listed))}{more} of {world_size}"


def job_inflight_limit(max_inflight_bytes: int, per_job: int = 0) -> int:
    """The accumulator bytes one job's open chunks may hold: `per_job`
    (--max-inflight-bytes-per-job), or by default 1/JOB_ACCUMULATOR_SHARE
    of `max_inflight_bytes`."""
    return per_job or max_inflight_bytes // JOB_ACCUMULATOR_SHARE


def job_refusal(open_chunks: int, open_bytes: int, nbytes: int, max_chunks: int,
                max_bytes: int) -> str | None:
    """Why a job that holds `open_chunks` open chunks of `open_bytes` accumulator
    bytes may not open one more of `nbytes`, or None. A job that opens chunks
    it never completes holds them until the round timeout: these per-job
    limits leave the rest of --max-inflight-bytes to the other jobs."""
    if open_chunks >= max_chunks:
        return f"job has {open_chunks} open chunks, the limit (--max-open-chunks-per-job)"
    if open_bytes + nbytes > max_bytes:
        return (f"job holds {open_bytes} bytes in {open_chunks} open chunks; this chunk "
                f"needs {nbytes} more, over its limit of {max_bytes} "
                f"(--max-inflight-bytes-per-job; by default half of --max-inflight-bytes, "
                f"so that other jobs keep room)")
    return None


def idle_jobs_to_forget(jobs: Mapping[str, Any], at_most: int) -> list[str]:
    """The names of at most `at_most` jobs with nothing open, least recently
    active first (`jobs`: name -> JobStats)."""
    idle = ((job.last_active_s, name) for name, job in jobs.items() if not job.open_chunks)
    return [name for _, name in heapq.nsmallest(at_most, idle)]


class StreamCount:
    """The open streams of one plane (data connections, Reduce calls), in all and
    per job, against `cap` in all and cap // JOB_STREAM_SHARE per job; one
    thread at a time (the caller's lock, or the event loop)."""

    def __init__(self, cap: int, what: str) -> None:
        self.cap, self.what = cap, what
        self.total = 0
        self._jobs: dict[str, int] = {}

    @property
    def job_cap(self) -> int:
        return max(1, self.cap // JOB_STREAM_SHARE)

    def refusal(self, job: str | None) -> str | None:
        """Why one more stream (of `job`, None: not known yet) may not open, or None."""
        if self.total >= self.cap:
            return f"too many {self.what} ({self.cap})"
        held = self._jobs.get(job, 0) if job is not None else 0
        if held >= self.job_cap:
            return (f"job {short_name(job)} holds {held} {self.what}, its share of the "
                    f"{self.cap} this daemon takes")
        return None

    def add(self, job: str | None) -> None:
        self.total += 1
        if job is not None:
            self._jobs[job] = self._jobs.get(job, 0) + 1

    def remove(self, job: str | None) -> None:
        self.total -= 1
        if job is not None:
            held = self._jobs.pop(job, 0) - 1
            if held > 0:
                self._jobs[job] = held


class PyMemoryBudget:
    """Bytes held against one limit (--max-inflight-bytes); thread-safe.

    (MemoryBudget is this class's counters in C where reducerd.core._budget
    was built, with the same methods and semantics and a C API for the C data
    loop; this one is the fallback and the Python data plane's.)

    accumulators: the table's float32 accumulators (taken on the loop thread
    when a chunk opens, refused beyond the limit). transport: receive buffers
    (a data-plane frame is reserved at its declared size before it is read)
    and replies queued but not yet sent. Accumulators always leave
    `transport_reserve` bytes to the transports, so that contributions to
    chunks already open can still be received when accumulators are at their
    most (else chunks would wait for frames that wait for memory).

    A transport's bytes may name the job they count against (`job`; None:
    the limit alone applies): each job's come to job_share_bytes at most,
    where a reservation has to wait (a job holding nothing may always take
    one frame, whatever its size), and job_has_room() says when a stream of
    it may read on.
    """

    def __init__(self, limit_bytes: int, transport_reserve_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes
        self.transport_reserve_bytes = min(transport_reserve_bytes, limit_bytes)
        self.job_share_bytes = limit_bytes // JOB_TRANSPORT_SHARE
        # _lock guards the two counts and _waiting; taken by the loop thread,
        # the summing threads and the data plane's threads (several times a
        # frame: held without the Condition's Python wrapper). Waiters are
        # woken whenever bytes are given back while one waits.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0
        self._accumulators = 0
        self._transport = 0
        self._jobs: dict[str, int] = {}  # transport bytes by job; none at 0 kept
        # Times anything waited for room or was refused it, here or by a job's
        # own limits (note_pressure): memory.HeapTrimmer trims after them.
        self.pressure = 0

    @property
    def accumulator_bytes(self) -> int:
        return self._accumulators

    @property
    def transport_bytes(self) -> int:
        return self._transport

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._accumulators + self._transport

    def take_accumulator(self, nbytes: int) -> bool:
        """Take room for an accumulator; False when that would pass the limit."""
        with self._lock:
            used = self._accumulators + max(self._transport, self.transport_reserve_bytes)
            if used + nbytes > self.limit_bytes:
                self.pressure += 1
                return False
            self._accumulators += nbytes
            return True

    def note_pressure(self) -> None:
        """Count a refusal for memory decided elsewhere (a job's own limits)."""
        with self._lock:
            self.pressure += 1

    def give_accumulator(self, nbytes: int) -> None:
        with self._lock:
            self._accumulators -= nbytes
            if self._waiting:
                self._cond.notify_all()

    def fits_transport(self, nbytes: int) -> bool:
        """Whether `nbytes` more for a transport would stay within the limit."""
        with self._lock:
            return self._accumulators + self._transport + nbytes <= self.limit_bytes

    def reserve(self, nbytes: int, timeout_s: float, job: str | None = None) -> bool:
        """Reserve `nbytes` of receive buffer (for `job`), waiting up to
        `timeout_s` for room; False if none came (or it can never fit)."""
        if nbytes > self.limit_bytes:
            return False

        def fits() -> bool:
            return (self._accumulators + self._transport + nbytes <= self.limit_bytes
                    and self.job_fits(job, nbytes))

        with self._lock:
            if not fits():
                self.pressure += 1
                self._waiting += 1
                try:
                    if not self._cond.wait_for(fits, timeout_s):
                        return False
                finally:
                    self._waiting -= 1
            self._add(nbytes, job)
            return True

    def try_reserve(self, nbytes: int, job: str | None = None) -> bool:
        """reserve() without waiting: whether `nbytes` (for `job`) were taken."""
        with self._lock:
            if not (self._accumulators + self._transport + nbytes <= self.limit_bytes
                    and self.job_fits(job, nbytes)):
                return False
            self._add(nbytes, job)
            return True

    def take_transport(self, nbytes: int, job: str | None = None) -> None:
        """Count `nbytes` a transport holds anyway (a reply queued for sending)."""
        with self._lock:
            self._add(nbytes, job)

    def give_transport(self, nbytes: int, job: str | None = None) -> None:
        if nbytes:
            with self._lock:
                self._add(-nbytes, job)
                if self._waiting:
                    self._cond.notify_all()

    def job_transport_bytes(self, job: str | None) -> int:
        return self._jobs.get(job, 0) if job is not None else 0

    def job_has_room(self, job: str | None) -> bool:
        """Whether `job` holds less than its share: its streams may read on."""
        return job is None or self._jobs.get(job, 0) < self.job_share_bytes

    def wait_job_room(self, job: str | None, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until job_has_room(job); whether it has."""
        with self._lock:
            if self.job_has_room(job):
                return True
            self.pressure += 1
            self._waiting += 1
            try:
                return self._cond.wait_for(lambda: self.job_has_room(job), timeout_s)
            finally:
                self._waiting -= 1

    def job_share_refusal(self, job: str, nbytes: int) -> str:
        """Why a new stream of `job` whose first shard holds `nbytes` is refused
        (that shard's reply would not fit the job's share), or ''."""
        if self.job_fits(job, nbytes):
            return ""
        return f"{self.describe_job_share(job)}: no new stream of it until they read"

    def describe_job_share(self, job: str) -> str:
        return (f"job {short_name(job)} holds {self.job_transport_bytes(job)} bytes of "
                f"this daemon's "
                f"memory in frames and replies its clients have not read, its share of at "
                f"most {self.job_share_bytes} (1/{JOB_TRANSPORT_SHARE} of "
                f"--max-inflight-bytes)")

    def no_room(self, nbytes: int, job: str | None, waited_s: float) -> str:
        """Why a frame of `nbytes` (for `job`) was refused after `waited_s`."""
        if job is not None and not self.job_fits(job, nbytes):
            return (f"a frame of {nbytes} bytes does not fit: {self.describe_job_share(job)}, "
                    f"and none came free within {waited_s:g} s; try again later")
        return (f"a frame of {nbytes} bytes does not fit: the daemon holds {self.held_bytes} "
                f"of its {self.limit_bytes} bytes (--max-inflight-bytes) and none came free "
                f"within {waited_s:g} s; try again later")

    def job_fits(self, job: str | None, nbytes: int) -> bool:
        """Whether `nbytes` more for `job` stay within its share."""
        held = self.job_transport_bytes(job)
        return held == 0 or held + nbytes <= self.job_share_bytes

    def _add(self, nbytes: int, job: str | None) -> None:
        """Count `nbytes` (negative: give back) of transport, and of `job`'s (lock held)."""
        self._transport += nbytes
        if job is not None:
            held = self._jobs.get(job, 0) + nbytes
            if held > 0:
                self._jobs[job] = held
            else:
                self._jobs.pop(job, None)


try:
    from reducerd.core._budget import Budget as _CBudget
except ImportError:  # built without a C compiler
    _CBudget = None


if _CBudget is not None:
    class MemoryBudget(_CBudget):  # type: ignore[misc,valid-type]
        """PyMemoryBudget's counters in C (reducerd/core/_budget.c): the same
        methods and semantics, and a C API through which the C data loop
        reserves and gives back without the GIL. The messages are Python's."""

        job_share_refusal = PyMemoryBudget.job_share_refusal
        describe_job_share = PyMemoryBudget.describe_job_share
        no_room = PyMemoryBudget.no_room
else:
    MemoryBudget = PyMemoryBudget  # type: ignore[misc,assignment]


class Credit:
    """How many frames (of a connection, of the plane) may wait for the loop
    thread: a semaphore in C (queue.SimpleQueue of tokens), as
    threading.Semaphore's Python Condition costs several microseconds a frame."""

    def __init__(self, frames: int) -> None:
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(frames):
            self._tokens.put(None)

    def acquire(self, timeout: float) -> bool:
        try:
            self._tokens.get(timeout=timeout)
            return True
        except queue.Empty:
            return False

    def release(self) -> None:
        self._tokens.put(None)
