"""The capacity model: bytes per link, daemons needed, communication time per step.

Symbols (docs/explanation/performance.md derives each line):

    N  worker nodes, G GPUs each (K = N x G ranks)
    M  the model's gradient in the wire dtype, bytes (params x wire bytes each)
    Rw a worker node's link rate, Rd a daemon's (bytes per second, each way)
    D  daemons, each with its own link and c summing cores
    r  what one core sums: wire input bytes per CPU-second (reducerd's own
       figure, `reducerd bench` prints it: 1.20-1.28 GB/s of float16 on the
       project's 2-core loopback runs)
    C  chunk bytes on the wire (the client's default for M, D and Rw:
       reducer_wire.layout.pipelined_chunk_bytes), the mean of the layout's
    K  a chunk's fixed cost to its daemon (reading it, its bookkeeping, its
       replies) in bytes of summing: reducer_wire.layout.CHUNK_COST_BYTES,
       128 KiB; each byte a daemon takes costs it w = 1 + K / C bytes of work
    e  the payload's share of the link: (MTU - 52) / (MTU + 38), TCP/IP
       headers and Ethernet framing (0.990 at MTU 9000)
    a  one-way latency per message hop

reducerd (node-local aggregation first, so a node sends the model once):

    worker link, each way:   M
    daemon link, each way:   N M / D
    daemon CPU per step:     N M w / (D c r) seconds on each daemon
    time = max(M / Rw, N M / (D Rd)) / e  max  N M w / (D c r)
           + C max(D / Rw, N / Rd) + C (N - 1) / Rd   (pipeline fill and drain)
           + 2 a
    daemons to keep the workers' links full: the smallest D whose daemon
    link and CPU terms are at most the worker link's, D >= N Rw / min(Rd, c r / (e w))
    (w depends on D through C: the least D that satisfies it);
    summing cores for that, in all: N Rw e w / r.

Fill and drain: a daemon answers a chunk only once all N workers sent it,
so nothing comes back before the first chunk is in: one chunk through the
slower end of its path, C max(D / Rw, N / Rd) (a worker sends to all D
daemons at once, a daemon takes from all N workers at once). At the other
end the last chunk's N contributions come into one daemon link as N TCP
flows, which share it by packets, not by chunks: the last of them lands up
to (N - 1) C / Rd after the first, and its result still has to go out. On
the emulated 200 Mbit cluster with credits per link (docs/explanation/performance.md,
"Validation") that is within 10 % of all 27 runs at N = 2, 4, 8, D = 1,
2, 4 and 1, 16, 64 MiB, on an Intel and an AMD machine; twice the first
term, the model until the twenty-first session, overstated the ends by up
to a third where a daemon has only 2-8 chunks of a small key and few
workers (1 MiB at N = 2 with D = 1 and D = 4).

Ring (ranks placed node by node, so one ring edge in and one out per node):

    worker link, each way:   2 (K - 1) / K x M   (0 with one node)
    time = that / (Rw e) + 2 (K - 1) a
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from reducer_wire.layout import (
    CHUNK_COST_BYTES,
    MIN_CHUNK_BYTES,
    chunk_cost_bytes,
    chunk_count,
    pipelined_chunk_bytes,
)

__all__ = ["ClusterSpec", "ReducerdPlan", "RingPlan", "plan_reducerd", "plan_ring",
           "daemons_needed", "cores_to_fill_link", "default_chunk_bytes", "layout_chunk_bytes",
           "chunk_of", "chunk_work", "daemons_for", "fill_and_drain_s",
           "link_efficiency",
           "efficiency",
           "MIN_CHUNK_BYTES"]

# Per packet: IPv4 20 + TCP 20 + timestamps 12 inside the MTU; Ethernet header
# 14, FCS 4, preamble 8 and inter-frame gap 12 outside it.
TCP_IP_HEADER_BYTES = 52
ETHERNET_FRAMING_BYTES = 38


@dataclass(frozen=True)
class ClusterSpec:
    """Everything a plan depends on; validated by `check()`."""

    params: int
    # Wire bytes per parameter: 2 for float16 and bfloat16, 4 for float32, 1
    # for fp8, 1 + 4/128 for int8 (a float32 scale per block of 128).
    wire_bytes_per_param: float
    nodes: int  # N
    gpus_per_node: int  # G
    link_Bps: float  # Rw, bytes per second each way
    daemon_link_Bps: float  # Rd
    daemon_rate_Bps_per_core: float  # r: wire input bytes per CPU-second
    daemon_cores: int = 1  # c: summing cores per daemon
    daemons: int | None = None  # D; None: as many as keep the workers' links full
    chunk_bytes: int | None = None  # None: the client's default for M and D
    # The layout cuts keys into whole blocks: int8's are 128 elements of 132
    # bytes (dtypes.wire_block, wire_nbytes); 1 element for the others.
    wire_block: int = 1
    wire_block_bytes: int | None = None  # None: wire_bytes_per_param (one element)
    latency_s: float = 0.0  # a: one-way, per message hop
    mtu: int = 9000

    @property
    def model_bytes(self) -> int:
        return math.ceil(self.params * self.wire_bytes_per_param)

    @property
    def wire_itemsize(self) -> int:
        """Bytes of one block of wire_block elements, as the client's layout counts them."""
        if self.wire_block_bytes is not None:
            return self.wire_block_bytes
        return max(1, int(self.wire_bytes_per_param))

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def check(self) -> None:
        """ValueError naming the first bad field (as the command line's flag)."""
        for flag, value, low in (("--model", self.params, 1), ("--workers", self.nodes, 1),
                                 ("--gpus-per-node", self.gpus_per_node, 1),
                                 ("--daemon-cores", self.daemon_cores, 1),
                                 ("--daemons", self.daemons, 1),
                                 ("--chunk-bytes", self.chunk_bytes, self.wire_itemsize),
                                 ("--mtu", self.mtu, 576)):
            if value is not None and value < low:
                raise ValueError(f"{flag} must be at least {low}, got {value}")
        for flag, rate in (("--link", self.link_Bps), ("--daemon-link", self.daemon_link_Bps),
                           ("--daemon-rate", self.daemon_rate_Bps_per_core)):
            if not (rate > 0 and math.isfinite(rate)):
                raise ValueError(f"{flag} must be a positive rate, got {rate}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"--latency must be >= 0, got {self.latency_s}")
        if not (0 < self.wire_bytes_per_param <= 8):
            raise ValueError("wire bytes per parameter must be in (0, 8], got "
                             f"{self.wire_bytes_per_param}")


@dataclass(frozen=True)
class ReducerdPlan:
    daemons: int
    daemons_needed: int
    chunk_bytes: float  # the mean chunk of the client's layout
    worker_link_bytes: float  # each way, per step
    daemon_link_bytes: float  # each way, per step, on every daemon's link
    daemon_input_bytes: float  # summed by each daemon per step
    daemon_cpu_s: float  # CPU-seconds per step on each daemon
    daemon_work_per_byte: float  # w: 1 + K / C, each chunk's fixed cost counted in
    total_cpu_s: float  # over all daemons
    cores_to_fill_links: float  # summing cores that keep every worker link full
    worker_link_s: float
    daemon_link_s: float
    daemon_cpu_wall_s: float  # daemon_cpu_s spread over its c cores
    pipeline_s: float
    latency_s: float
    time_s: float
    bottleneck: str  # "worker link", "daemon link" or "daemon CPU"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RingPlan:
    ranks: int
    worker_link_bytes: float  # each way, per step, on every node's link
    bandwidth_s: float
    latency_s: float
    time_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fill_and_drain_s(chunk: float, nodes: int, daemons: int, link_Bps: float,
                     daemon_link_Bps: float) -> float:
    """The pipeline's ends beyond the transfer: the first chunk through the
    slower end of its path, then the last chunk's N flows into one daemon
    link landing apart (see the module docstring)."""
    return (chunk * max(daemons / link_Bps, nodes / daemon_link_Bps)
            + chunk * (nodes - 1) / daemon_link_Bps)


def link_efficiency(mtu: int) -> float:
    """The payload's share of a link's bytes at this MTU (TCP over Ethernet)."""
    return (mtu - TCP_IP_HEADER_BYTES) / (mtu + ETHERNET_FRAMING_BYTES)


def default_chunk_bytes(model_bytes: int, daemons: int, link_Bps: float | None = None) -> int:
    """The client's default chunk size for one key of `model_bytes` over
    `daemons`, its link given as `link_Bps` (ReducerClient's link_gbit)."""
    return pipelined_chunk_bytes(model_bytes, daemons, cost_bytes=chunk_cost_bytes(link_Bps))


def layout_chunk_bytes(model_bytes: int, daemons: int, chunk_bytes: int,
                       itemsize: int = 2, block: int = 1) -> float:
    """The mean chunk the client's layout (reducer_wire.layout) makes of one
    key of `model_bytes` with at most `chunk_bytes` per chunk, the wire
    carrying blocks of `block` elements in `itemsize` bytes each."""
    numel = max(1, model_bytes * block // itemsize)
    return model_bytes / chunk_count(numel, itemsize, daemons, max(chunk_bytes, itemsize),
                                     block)


def cores_to_fill_link(daemon_link_Bps: float, rate_Bps_per_core: float, mtu: int,
                       work: float = 1.0) -> int:
    """Summing cores that keep one daemon link full: ceil(Rd e w / r)."""
    return max(1, math.ceil(daemon_link_Bps * link_efficiency(mtu) * work / rate_Bps_per_core
                            - 1e-9))


def chunk_of(spec: ClusterSpec, daemons: int) -> float:
    """The mean chunk of the model's layout over `daemons` (C)."""
    m = spec.model_bytes
    return layout_chunk_bytes(m, daemons,
                              spec.chunk_bytes or default_chunk_bytes(m, daemons, spec.link_Bps),
                              spec.wire_itemsize, spec.wire_block)


def chunk_work(chunk_bytes: float) -> float:
    """w: a daemon's work per byte taken, each chunk's fixed cost counted in."""
    return 1 + CHUNK_COST_BYTES / chunk_bytes


def daemons_for(spec: ClusterSpec, per_daemon_Bps: float) -> int:
    """Daemons that take the workers' N Rw when each takes `per_daemon_Bps`."""
    # Rounding guard: 256 x 12.5e9 / 12.5e9 must be 256, not 257.
    return max(1, math.ceil(spec.nodes * spec.link_Bps / per_daemon_Bps - 1e-9))


def daemons_needed(spec: ClusterSpec) -> int:
    """The fewest daemons whose links and cores keep every worker link full.

    A daemon's link carries N M / D each way and its cores do N M w / D of
    work per step: both must take no longer than a worker link's M / Rw, so
    D >= N Rw / Rd and D >= N Rw e w / (c r) (the CPU figure is payload, the
    links lose e to headers). w grows with D (more daemons, smaller chunks),
    not always smoothly (a chunk count rounded to a multiple of D), so D is
    searched upwards from what w = 1 would need.
    """
    e = link_efficiency(spec.mtu)

    def needed(work: float) -> int:
        return daemons_for(spec, min(spec.daemon_link_Bps, spec.daemon_cores
                                     * spec.daemon_rate_Bps_per_core / (e * work)))

    d = needed(1.0)
    while needed(chunk_work(chunk_of(spec, d))) > d:
        d += 1
    return d


def plan_reducerd(spec: ClusterSpec) -> ReducerdPlan:
    """Bytes, CPU and time per step for reducerd on `spec` (see the module docstring)."""
    spec.check()
    needed = daemons_needed(spec)
    d = spec.daemons or needed
    n, m = spec.nodes, spec.model_bytes
    e = link_efficiency(spec.mtu)
    chunk = chunk_of(spec, d)
    work = chunk_work(chunk)
    daemon_bytes = n * m / d
    cpu_s = daemon_bytes * work / spec.daemon_rate_Bps_per_core
    terms = {"worker link": m / (spec.link_Bps * e),
             "daemon link": daemon_bytes / (spec.daemon_link_Bps * e),
             "daemon CPU": cpu_s / spec.daemon_cores}
    bottleneck = max(terms, key=lambda name: terms[name])
    pipeline_s = fill_and_drain_s(chunk, n, d, spec.link_Bps, spec.daemon_link_Bps)
    latency_s = 2 * spec.latency_s
    return ReducerdPlan(
        daemons=d, daemons_needed=needed, chunk_bytes=chunk,
        worker_link_bytes=float(m), daemon_link_bytes=daemon_bytes,
        daemon_input_bytes=daemon_bytes, daemon_cpu_s=cpu_s, daemon_work_per_byte=work,
        total_cpu_s=cpu_s * d,
        cores_to_fill_links=n * spec.link_Bps * e * work / spec.daemon_rate_Bps_per_core,
        worker_link_s=terms["worker link"], daemon_link_s=terms["daemon link"],
        daemon_cpu_wall_s=terms["daemon CPU"], pipeline_s=pipeline_s, latency_s=latency_s,
        time_s=terms[bottleneck] + pipeline_s + latency_s, bottleneck=bottleneck)


def plan_ring(spec: ClusterSpec) -> RingPlan:
    """A ring allreduce over all K = N G ranks, in the same wire dtype."""
    spec.check()
    k = spec.ranks
    link_bytes = 2 * (k - 1) / k * spec.model_bytes if spec.nodes > 1 else 0.0
    bandwidth_s = link_bytes / (spec.link_Bps * link_efficiency(spec.mtu))
    latency_s = 2 * (k - 1) * spec.latency_s
    return RingPlan(ranks=k, worker_link_bytes=link_bytes, bandwidth_s=bandwidth_s,
                    latency_s=latency_s, time_s=bandwidth_s + latency_s)


def efficiency(compute_s: float, comm_s: float, overlap: float = 0.0) -> float:
    """Scaling efficiency of a step: compute / (compute + the communication not hidden).

    `overlap` is the share of the compute that communication can run beside
    (0: none; about 2/3 when every bucket is reduced during backward).
    """
    exposed = max(0.0, comm_s - overlap * compute_s)
    return compute_s / (compute_s + exposed)
