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
import zlib
from dataclasses import dataclass

from reducer_wire import dtypes

__all__ = ["Chunk", "chunk_count", "plan_chunks", "plan_wire_chunks", "layout_fingerprint",
           "pipelined_chunk_bytes", "DEFAULT_CHUNK_BYTES", "LAYOUT_RULE"]

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
# chunks cost CPU per chunk. So: uniform chunks, more of them. With the
# links kept in step (transport/order.py) 16, 32 and 64 per daemon took
# 1.15x, 1.08x and 1.08x the bound on the emulated 200 Mbit cluster (N = D =
# 4, 64 MiB float16); without, 16 took 1.15-1.20x. By default a key gets at
# least this many chunks per daemon, down to MIN_CHUNK_BYTES (a chunk costs
# the client about 0.3 ms of CPU here, whatever its size).
PIPELINE_CHUNKS_PER_DAEMON = 32
MIN_CHUNK_BYTES = 64 << 10
# Named in the layout fingerprint: a client that cuts keys by another rule
# (v1: 16 chunks per daemon; v2: every key over every daemon, however small
# its chunks) is refused by the daemon instead of mixing.
LAYOUT_RULE = "reducer-layout/v3"


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


def pipelined_chunk_bytes(total_bytes: int, num_daemons: int,
                          max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The default chunk size for a key of `total_bytes` on the wire.

    Small enough for PIPELINE_CHUNKS_PER_DAEMON chunks per daemon, at least
    MIN_CHUNK_BYTES, at most max_chunk_bytes; a function of the key's size
    and the daemon count only, so every worker picks the same.
    """
    wanted = -(-total_bytes // (num_daemons * PIPELINE_CHUNKS_PER_DAEMON))
    return max(min(MIN_CHUNK_BYTES, max_chunk_bytes), min(max_chunk_bytes, wanted))


def layout_fingerprint(num_daemons: int, daemon: int, chunk_bytes: int) -> int:
    """A non-zero 64-bit digest of what fixes the layout as daemon `daemon` sees it.

    Workers that agree on the layout rule (LAYOUT_RULE, this module's), the
    number of daemons, this daemon's place in the list and the chunk size send
    the same value; any disagreement would make their chunks miss each other,
    so the daemon refuses it (Shard.layout). Addresses themselves are left
    out: one worker may name a daemon by IP and another by host name.
    """
    text = f"{LAYOUT_RULE} {num_daemons} {daemon} {chunk_bytes}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") or 1
