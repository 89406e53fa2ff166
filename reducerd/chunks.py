"""What the reduction table keeps: chunk ids, contributions, open chunks, results, failures.

Plain records (reducerd.reduction holds the logic), so that the table reads
as what it does with them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from reducer_wire import dtypes
from reducer_wire.dtypes import DTYPE_NAMES, OP_NAMES

from reducerd.incarnations import JobIncarnations
from reducerd.replies import Reply

__all__ = ["ChunkId", "Contribution", "Delivery", "JobStats", "OpenChunk", "CachedResult",
           "Failure", "mismatch"]


class ChunkId(NamedTuple):
    job: str
    key: str
    round: int
    offset: int

    def describe(self) -> str:
        return (f"job {self.job!r} key {self.key!r} round {self.round} "
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
    bytes_in: int = 0
    bytes_out: int = 0
    last_active_s: float = 0.0  # table clock
    # The layout fingerprint of the job's open chunks and the rank that set it.
    layout: int = 0
    layout_rank: int = 0
    # The client instance each rank last contributed with (reducerd.incarnations).
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
    # Its state on the summing pool (reducerd.chunk_sums.ChunkSums), None when
    # the loop thread sums it inline (--threads 1).
    sums: Any = None


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
