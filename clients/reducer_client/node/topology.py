"""Where a worker sits for node-local aggregation, and which slice is whose.

Node-major ranks (torchrun's layout) are assumed: node k runs ranks
k L .. k L + L - 1, so node = rank // L and local_rank = rank % L, and every
node runs the same number L of workers. REDUCER_NODE_RANK (node_rank) names
the node when ranks are laid out otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeTopology", "node_topology", "slice_bounds", "node_slice", "MIN_SLICE_BYTES"]

# A slice smaller than this (in wire bytes) costs more in messages (L D chunks
# instead of D) than it saves in summing, so small tensors use fewer slices.
MIN_SLICE_BYTES = 64 << 10


@dataclass(frozen=True)
class NodeTopology:
    """Where this worker sits: local rank among local_size, node among nodes."""

    local_rank: int
    local_size: int
    node: int
    nodes: int


def node_topology(rank: int, world_size: int, local_rank: int, local_size: int,
                  node_rank: int | None = None) -> NodeTopology:
    """Derive node index and count, assuming node-major ranks unless node_rank is given.

    Node-major (torchrun's layout): node k runs ranks k L .. k L + L - 1, so
    node = rank // L and local_rank = rank % L. Every node must run the same L.
    """
    if local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank {local_rank} must be in [0, local_size={local_size})")
    if world_size % local_size:
        raise ValueError(f"world_size {world_size} is not a multiple of local_size "
                         f"{local_size}: node-local aggregation needs the same number of "
                         "workers on every node (or turn it off: REDUCER_NODE_LOCAL=0)")
    nodes = world_size // local_size
    if node_rank is None:
        if rank % local_size != local_rank:
            raise ValueError(f"rank {rank} has local rank {local_rank}, but rank % "
                             f"local_size = {rank % local_size}: ranks are not laid out "
                             "node by node; set REDUCER_NODE_RANK (the node's index) or "
                             "REDUCER_NODE_LOCAL=0")
        node_rank = rank // local_size
    if not 0 <= node_rank < nodes:
        raise ValueError(f"node_rank {node_rank} must be in [0, {nodes})")
    return NodeTopology(local_rank, local_size, node_rank, nodes)


def slice_bounds(numel: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of slice `index` of `parts`; sizes differ by at most one."""
    base, extra = divmod(numel, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def node_slice(numel: int, itemsize: int, local_size: int, local_rank: int,
               ) -> tuple[int, int]:
    """The slice of a tensor that `local_rank` sums and sends for its node.

    Up to local_size slices of at least MIN_SLICE_BYTES (at least one);
    local ranks past the last slice get an empty one. Every local rank
    computes the same split from (numel, itemsize, local_size).
    """
    parts = max(1, min(local_size, numel * itemsize // MIN_SLICE_BYTES))
    if local_rank >= parts:
        return numel, numel
    return slice_bounds(numel, parts, local_rank)
