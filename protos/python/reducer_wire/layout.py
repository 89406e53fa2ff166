"""Chunk layout: how a flat tensor is cut into chunks and spread over daemons.

One rule for both sides: the client cuts its keys with it, the daemon's
planner (reducerd plan) counts the chunks a model makes with it.

The layout depends only on the element count, the wire bytes per block (an
element, or int8's block of elements with its scale), the chunk size and the
number of daemons, plus the key (which daemon gets the first
chunk), so every worker computes the same layout without talking. Every
element belongs to exactly one chunk and every chunk to exactly one daemon.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass

from reducer_wire import dtypes

__all__ = ["Chunk", "KeyLayout", "chunk_count", "plan_chunks", "plan_wire_chunks",
           "layout_fingerprint", "pipelined_chunk_bytes", "chunk_cost_bytes", "DEFAULT_CHUNK_BYTES",
           "CHUNK_COST_BYTES", "DAEMON_BYTES_PER_S", "LAYOUT_RULE", "MIN_CHUNK_BYTES",
           "SLOW_LINK_MIN_CHUNK_BYTES"]

# Wire bytes per chunk at most, by default: well under gRPC's 4 MiB message
# limit; on loopback 512 KiB to 3.5 MiB chunks gave the same daemon CPU per
# byte, so the largest that still pipelines well.
DEFAULT_CHUNK_BYTES = 1 << 20
# A daemon answers a chunk only when every worker has sent it, and with
# D = N every link is saturated, so its answers run one chunk behind its
# input from the first chunk to the last: the pipeline's ends cost one chunk
# through a daemon's link, N x chunk / rate, beyond the transfer. Graded
# chunks (small at both ends, large in the middle) do not shorten that: a
# daemon whose link both takes and answers at the same rate idles for every
# byte a chunk grows by, so the end is one largest chunk late either way
# (measured: 1.08x the line-rate bound for both at 64 MiB), and smaller
# chunks cost CPU per chunk. So: uniform chunks. With the links kept in step
# (transport/order.py) 16, 32 and 64 per daemon took 1.15x, 1.08x and 1.08x
# the bound on the emulated 200 Mbit cluster (N = D = 4, 64 MiB float16):
# never more than 32 per daemon, and never under MIN_CHUNK_BYTES, or on a
# slow link its floor (pipelined_chunk_bytes).
PIPELINE_CHUNKS_PER_DAEMON = 32
MIN_CHUNK_BYTES = 64 << 10
# Rule v5: on a link slow enough that a chunk's fixed cost (c R below) is
# under MIN_CHUNK_BYTES, a key of MIN_CHUNK_BYTES per daemon or more gets
# that cost as its floor, down to SLOW_LINK_MIN_CHUNK_BYTES: the ends, not
# the CPU, set the best size there. Emulated 200 Mbit/s (c R = 2,185
# bytes), float16 keys of 512 KiB on the wire, 2 vCPUs for every process:
# N = 8, D = 4 took 80-82 ms in 64 KiB chunks, 71-73 in 32 KiB, 54-56 in 16
# KiB and 58-59 in 8 KiB (there the per-chunk CPU shows again); N = 4,
# D = 4 41-44, 37, 29-30 ms. Smaller keys keep 64 KiB (cut for every daemon,
# the training bench's 128 KiB buckets cost its 2 cores 3.7 % more a step),
# and a fast network keeps v4's sizes.
SLOW_LINK_MIN_CHUNK_BYTES = 16 << 10
# Each chunk also costs a daemon fixed work (reading the frame, its
# bookkeeping, a reply per worker): about 88 us of CPU per contribution on
# an Intel Xeon (family 6 model 167), the time it sums 128 KiB of float16
# input in (1.45 GB per CPU-second). Both scale with the CPU, so the ratio is
# the daemon's, not the machine's. With B bytes of a key per daemon and
# chunks of x bytes, the ends add 2x / B of the transfer and the fixed costs
# c R / x (c: the fixed cost in seconds, R: the rate the daemon is fed at),
# least at x = sqrt(c R B / 2): 1 MiB chunks for a 64 MiB float16 key over
# 2 daemons on a fast network (N = 8 on loopback, where no link's ends are
# waited for: 512 KiB, 1 MiB and 2 MiB chunks took 280, 250 and 232 ms).
# The total is flat near its least (2x too large or small: +25 % of a few
# per cent), so the rate need not be exact. c R is CHUNK_COST_BYTES when the
# daemon's CPU sets the pace (a link of DAEMON_BYTES_PER_S or more, or no
# link rate given), less on a slower link, where the fixed cost hides
# behind the transfer.
CHUNK_COST_BYTES = 128 << 10
DAEMON_BYTES_PER_S = 1.5e9
# Named in the layout fingerprint: a client that cuts keys by another rule
# (v1: 16 chunks per daemon; v2: every key over every daemon, however small
# its chunks; v3: 32 chunks per daemon whatever the link; v4: never under
# 64 KiB whatever the link) is refused by the daemon instead of mixing.
LAYOUT_RULE = "reducer-layout/v5"


@dataclass(frozen=True)
class Chunk:
    """Elements [offset, offset + numel) of a key, reduced by daemon `daemon`."""

    offset: int
    numel: int
    daemon: int


def chunk_count(numel: int, itemsize: int, num_daemons: int, chunk_bytes: int,
                block: int = 1) -> int:
    """How many chunks plan_chunks cuts `numel` elements into (its arguments, bar the key)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if num_daemons < 1:
        raise ValueError("need at least one daemon")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if itemsize < 1 or chunk_bytes < itemsize:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must hold at least one "
                         + (f"element of {itemsize} bytes" if block == 1 else
                            f"block of {block} elements ({itemsize} bytes)"))
    if numel == 0:
        return 0
    blocks = -(-numel // block)
    max_chunk_blocks = chunk_bytes // itemsize
    count = -(-blocks // max_chunk_blocks)  # ceil
    floor_blocks = max(1, min(MIN_CHUNK_BYTES, chunk_bytes) // itemsize)
    if blocks >= num_daemons * floor_blocks:
        count = -(-count // num_daemons) * num_daemons  # round up to a multiple of D
    else:  # a small key: chunks of at least the floor, at most one per daemon
        count = max(count, blocks // floor_blocks, 1)
    return min(count, blocks)


def plan_chunks(numel: int, itemsize: int, num_daemons: int, chunk_bytes: int,
                key: str = "", block: int = 1) -> list[Chunk]:
    """Cut `numel` elements into balanced chunks spread round-robin over daemons.

    Chunks hold whole blocks of `block` elements (reducer_wire.dtypes.wire_block:
    128 for int8, whose scales are per block; 1 otherwise), only the last may
    end in a partial one; `itemsize` is the wire bytes of one whole block
    (dtypes.wire_nbytes(dtype, block)). Chunk sizes differ by at most one
    block. Round-robin starts at a daemon picked from a CRC of the key, so
    many small keys do not all land on daemon 0.

    A key that fills `num_daemons` chunks of the floor (MIN_CHUNK_BYTES, or
    `chunk_bytes` if smaller) is spread over every daemon: the chunk count is
    the smallest multiple of `num_daemons` whose chunks fit in `chunk_bytes`,
    so each daemon gets the same bytes to within one block per chunk. A
    smaller key gets only as many chunks as it fills at the floor (at least
    one, and at least what `chunk_bytes` needs), one per daemon: cutting it
    for every daemon would make chunks whose fixed cost (about 0.3 ms of the
    client's and the daemon's CPU each, whatever their size) outweighs their
    bytes. Across a step's many small keys the CRC spreads them.
    """
    count = chunk_count(numel, itemsize, num_daemons, chunk_bytes, block)
    if count == 0:
        return []
    blocks = -(-numel // block)
    base, extra = divmod(blocks, count)
    first_daemon = zlib.crc32(key.encode()) % num_daemons
    chunks = []
    offset = 0
    for i in range(count):
        size = min((base + (1 if i < extra else 0)) * block, numel - offset)
        chunks.append(Chunk(offset, size, (first_daemon + i) % num_daemons))
        offset += size
    return chunks


def plan_wire_chunks(numel: int, dtype: int, num_daemons: int, chunk_bytes: int,
                     key: str = "") -> list[Chunk]:
    """plan_chunks for wire dtype `dtype`: whole blocks of dtypes.wire_block(dtype)."""
    block = dtypes.wire_block(dtype)
    return plan_chunks(numel, dtypes.wire_nbytes(dtype, block), num_daemons, chunk_bytes,
                       key, block)


def chunk_cost_bytes(link_bytes_per_s: float | None = None) -> int:
    """A chunk's fixed cost to its daemon, in bytes of summing (c R above), for
    workers whose links carry `link_bytes_per_s` each way (None: a fast network)."""
    if link_bytes_per_s is None:
        return CHUNK_COST_BYTES
    if not link_bytes_per_s > 0:
        raise ValueError(f"the link rate must be > 0 bytes per second, got {link_bytes_per_s}")
    return max(1, round(CHUNK_COST_BYTES * min(1.0, link_bytes_per_s / DAEMON_BYTES_PER_S)))


def pipelined_chunk_bytes(total_bytes: int, num_daemons: int,
                          max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                          cost_bytes: int = CHUNK_COST_BYTES) -> int:
    """The default chunk size for a key of `total_bytes` on the wire.

    sqrt(cost_bytes x bytes per daemon / 2) (see CHUNK_COST_BYTES; cost_bytes
    from chunk_cost_bytes(link rate)), but small enough for at most
    PIPELINE_CHUNKS_PER_DAEMON chunks per daemon, at least the floor
    (MIN_CHUNK_BYTES; on a slow link, for a key of MIN_CHUNK_BYTES per daemon
    or more, cost_bytes, but SLOW_LINK_MIN_CHUNK_BYTES at least), at most
    max_chunk_bytes: a function of the key's size, the daemon count and the
    link rate only, so every worker that is given the same rate picks the same.
    """
    if cost_bytes < 1:
        raise ValueError(f"cost_bytes must be >= 1, got {cost_bytes}")
    per_daemon = -(-total_bytes // num_daemons)
    wanted = max(math.isqrt(cost_bytes * per_daemon // 2),
                 -(-per_daemon // PIPELINE_CHUNKS_PER_DAEMON))
    floor = MIN_CHUNK_BYTES
    if per_daemon >= MIN_CHUNK_BYTES:  # a small key keeps v4's few chunks (plan_chunks)
        floor = max(SLOW_LINK_MIN_CHUNK_BYTES, min(MIN_CHUNK_BYTES, cost_bytes))
    return max(min(floor, max_chunk_bytes), min(max_chunk_bytes, wanted))


def layout_fingerprint(num_daemons: int, daemon: int, chunk_bytes: int,
                       cost_bytes: int | None) -> int:
    """A non-zero 64-bit digest of what fixes the layout as daemon `daemon` sees it.

    Workers that agree on the layout rule (LAYOUT_RULE, this module's), the
    number of daemons, this daemon's place in the list, the chunk size and
    how keys get theirs (cost_bytes: pipelined_chunk_bytes' with the link's
    chunk_cost_bytes; None: every key cut at chunk_bytes) send the same value;
    any disagreement would make their chunks miss each other, so the daemon
    refuses it (Shard.layout). Addresses themselves are left out: one worker
    may name a daemon by IP and another by host name.
    """
    sizing = "fixed" if cost_bytes is None else f"cost={cost_bytes}"
    text = f"{LAYOUT_RULE} {num_daemons} {daemon} {chunk_bytes} {sizing}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") or 1


@dataclass(frozen=True)
class KeyLayout:
    """How a client cuts every key over `num_daemons`: with `cost_bytes`
    (chunk_cost_bytes of its link), chunks sized by pipelined_chunk_bytes, at
    most `chunk_bytes`; with cost_bytes None, chunks of `chunk_bytes` for every key."""

    num_daemons: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    cost_bytes: int | None = CHUNK_COST_BYTES

    @classmethod
    def for_link(cls, num_daemons: int, chunk_bytes: int | None = None,
                 link_bytes_per_s: float | None = None) -> KeyLayout:
        """A client's layout: chunk_bytes if given, else sized for its link (None: fast)."""
        if chunk_bytes is not None:
            return cls(num_daemons, chunk_bytes, None)
        return cls(num_daemons, DEFAULT_CHUNK_BYTES, chunk_cost_bytes(link_bytes_per_s))

    def chunk_bytes_of(self, numel: int, dtype: int) -> int:
        """The chunk size of a key of `numel` elements on wire dtype `dtype`."""
        if self.cost_bytes is None:
            return self.chunk_bytes
        return pipelined_chunk_bytes(dtypes.wire_nbytes(dtype, numel), self.num_daemons,
                                     self.chunk_bytes, self.cost_bytes)

    def plan(self, numel: int, dtype: int, key: str = "") -> list[Chunk]:
        return plan_wire_chunks(numel, dtype, self.num_daemons,
                                self.chunk_bytes_of(numel, dtype), key)

    def fingerprint(self, daemon: int) -> int:
        return layout_fingerprint(self.num_daemons, daemon, self.chunk_bytes, self.cost_bytes)
