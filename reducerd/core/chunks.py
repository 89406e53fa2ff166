"""What the reduction table keeps: chunk ids, contributions, open chunks, results, failures.

Plain records (reducerd.core.reduction holds the logic), so that the table reads
as what it does with them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any, NamedTuple

import numpy as np
from reducer_wire import dtypes
from reducer_wire.dtypes import DTYPE_NAMES, OP_NAMES

from reducerd.core.incarnations import JobIncarnations
from reducerd.core.limits import MISSING_LISTED_AT_MOST, missing_ranks
from reducerd.core.names import short_name
from reducerd.core.replies import Reply

__all__ = ["ChunkId", "Contribution", "Delivery", "JobStats", "OpenChunk", "OpenChunks",
           "CachedResult", "Failure", "mismatch", "disagreeing_resend",
           "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
           "INTERNAL", "FAILED_PRECONDITION"]

# Status code names a Delivery's error carries (the session maps them to grpc.StatusCode).
INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNAVAILABLE, INTERNAL = (
    "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL")
FAILED_PRECONDITION = "FAILED_PRECONDITION"


class ChunkId(NamedTuple):
    job: str
    key: str
    round: int
    offset: int

    def describe(self) -> str:
        return (f"job {short_name(self.job)} key {short_name(self.key)} round {self.round} "
                f"offset {self.offset}")


@dataclass(frozen=True)
class Contribution:
    """One rank's data for one chunk, already checked on its own."""

    rank: int
    world_size: int
    dtype: int
    op: int
    data: bytes | memoryview  # a view into the received message
    layout: int = 0  # the sender's layout fingerprint (0: not checked)
    incarnation: int = 0  # the sending client instance's id (0: an old client)

    @property
    def numel(self) -> int:
        numel = dtypes.wire_numel(self.dtype, len(self.data))  # int8 carries its scales
        if numel is None:
            raise ValueError(f"{len(self.data)} bytes are not whole {self.dtype} elements "
                             "(session.check_shard admits no such shard)")
        return numel


@dataclass(frozen=True)
class Delivery:
    """What to send to `sinks`: the result's `reply`, or an error code and message."""

    chunk: ChunkId
    dtype: int
    op: int
    world_size: int
    sinks: tuple[Hashable, ...]
    reply: Reply | None = None  # the result's reply message, the same for every sink
    error_code: str = ""
    error_message: str = ""
    # Seconds from the chunk's first contribution to this delivery (0 if it never opened).
    latency_s: float = 0.0
    # A result sent again from the cache to a resent contribution (not a new completion).
    repeat: bool = False

    @property
    def data(self) -> memoryview:
        """The result in the wire dtype (a view into the reply), empty for a failure."""
        return self.reply.payload if self.reply is not None else memoryview(b"")


@dataclass
class JobStats:
    first_seen_s: float
    world_sizes: set[int] = field(default_factory=set)
    chunks_completed: int = 0
    chunks_failed: int = 0
    open_chunks: int = 0
    open_chunk_bytes: int = 0  # the open chunks' accumulators
    record_bytes: int = 0  # the open chunks' records and names (limits.chunk_record_bytes)
    bytes_in: int = 0
    bytes_out: int = 0
    last_active_s: float = 0.0  # table clock
    # The layout fingerprint of the job's open chunks and the rank that set it.
    layout: int = 0
    layout_rank: int = 0
    # The client instance each rank last contributed with (reducerd.core.incarnations).
    incarnations: JobIncarnations = field(default_factory=JobIncarnations)


@dataclass
class OpenChunk:
    first_rank: int
    world_size: int
    dtype: int
    op: int
    numel: int
    acc: np.ndarray
    started_s: float
    ranks: set[int] = field(default_factory=set)
    # Streams waiting for the result, in arrival order (a dict: a stream that
    # ends is dropped in O(1)); a retry on another stream adds that one too.
    sinks: dict[Hashable, None] = field(default_factory=dict)
    # Its state on the summing pool (reducerd.core.chunk_sums.ChunkSums), None when
    # the loop thread sums it inline (--threads 1).
    sums: Any = None
    # Its bookkeeping's cost, counted in the table's record_bytes while open.
    record_bytes: int = 0


@dataclass
class CachedResult:
    dtype: int
    op: int
    world_size: int
    numel: int
    reply: Reply
    expires_s: float


@dataclass
class Failure:
    code: str
    message: str
    expires_s: float
    nbytes: int = 0  # what the record and its chunk id hold (limits.FAILURE_BYTES_KEPT)


def mismatch(chunk: OpenChunk, part: Contribution) -> str:
    """Describe how `part` disagrees with the chunk's first contribution, or ''."""
    for name, ours, theirs in (
        ("dtype", DTYPE_NAMES[chunk.dtype], DTYPE_NAMES[part.dtype]),
        ("op", OP_NAMES[chunk.op], OP_NAMES[part.op]),
        ("world_size", chunk.world_size, part.world_size),
        ("length", chunk.numel, part.numel),
    ):
        if ours != theirs:
            return (f"rank {part.rank} sent {name} {theirs} but rank {chunk.first_rank} "
                    f"sent {name} {ours}")
    return ""


def disagreeing_resend(cid: ChunkId, part: Contribution, sink: Hashable, dtype: int,
                       numel: int, world_size: int) -> Delivery | None:
    """The error for a contribution resent to a completed chunk (of `dtype`,
    `numel`, `world_size`) that disagrees with it, or None."""
    if (part.dtype, part.numel, part.world_size) == (dtype, numel, world_size):
        return None
    return Delivery(cid, part.dtype, part.op, part.world_size, (sink,),
                    error_code=INVALID_ARGUMENT, error_message=(
                        f"{cid.describe()}: rank {part.rank} resent a contribution that "
                        "disagrees with the completed chunk (dtype, length or world_size)"))


class OpenChunks(dict[ChunkId, OpenChunk]):
    """The open chunks in the order they opened, oldest first: so expiry and
    GetStatus stop at the first chunk young enough."""

    def rows(self, now: float, older_than_s: float, at_most: int | None,
             job: str) -> list[tuple[ChunkId, int, list[int], float]]:
        """(chunk, world_size, missing ranks, age in seconds), oldest first: the chunks
        (of `job`, if given) open at least `older_than_s`, at most `at_most` of
        them, each with at most MISSING_LISTED_AT_MOST missing ranks named."""
        rows: list[tuple[ChunkId, int, list[int], float]] = []
        for cid, c in self.items():
            age_s = now - c.started_s
            if age_s < older_than_s or (at_most is not None and len(rows) >= at_most):
                break  # opened in order: the rest are younger
            if job and cid.job != job:
                continue
            listed, _ = missing_ranks(c.world_size, c.ranks, MISSING_LISTED_AT_MOST)
            rows.append((cid, c.world_size, listed, age_s))
        return rows

    def stalled_count(self, now: float, older_than_s: float) -> int:
        """Open chunks at least `older_than_s` old (without listing them)."""
        # opened in order: count up to the first younger one
        return sum(1 for _ in takewhile(lambda c: now - c.started_s >= older_than_s,
                                        self.values()))

    def late(self, now: float, timeout_s: float) -> list[ChunkId]:
        """The chunks open `timeout_s` or longer with contributions still missing."""
        late = []
        for cid, c in self.items():
            if now - c.started_s < timeout_s:
                break  # opened in order: the rest are younger
            if len(c.ranks) < c.world_size:  # a complete one is being summed: it lands
                late.append(cid)
        return late

    def completing(self, chunks: Iterable[ChunkId]) -> bool:
        """Whether one of `chunks` has all its contributions, its result not yet out."""
        for cid in chunks:
            chunk = self.get(cid)
            if chunk is not None and len(chunk.ranks) >= chunk.world_size:
                return True
        return False

    def of_job(self, name: str) -> list[tuple[ChunkId, OpenChunk]]:
        """The job's open chunks (a list: the caller may fail them meanwhile)."""
        return [(cid, c) for cid, c in self.items() if cid.job == name]
