"""From the workers' raw records to the reported figures, and the theory beside them.

Timing: every iteration counts as long as its slowest rank; median, min and
max are over the timed iterations. algbw = size / median time (GB/s, 1e9
bytes). busbw = algbw * 2(N-1)/N, nccl-tests' allreduce factor, applied to
every system alike (reducerd included), so busbw compares with nccl-tests
figures and the ratios between systems equal the algbw ratios. What each
system really puts on a link is in the byte counts of --emulate-cluster.

Paired (the DDP hook): the core's allreduce(op="mean", out=) of the same
bucket, timed in every iteration beside the hook in alternating order on
the same workers and daemons; "paired_core" holds its times and the hook's
time over the core's, per iteration (median, min, max).

Bytes (emulated cluster only): a node's link counters, read by its local rank
0 around each timed allreduce (after a barrier that every rank of the run
passes once done; one barrier's own bytes are subtracted), averaged over the
iterations and over the nodes; per worker = per node / workers per node.
"""

from __future__ import annotations

import statistics
from typing import Any

from reducerd.bench.config import CHUNKED_SYSTEMS, REDUCERD_SYSTEMS, BenchConfig, wire_nbytes

__all__ = ["aggregate", "theory_bytes_per_node", "daemon_link_bytes", "line_rate_bound_s",
           "time_ratios"]

# MXNet splits an array over all servers only from this many elements on
# (MXNET_KVSTORE_BIGARRAY_BOUND); a smaller one lives on one server.
MXNET_BIGARRAY_BOUND = 1_000_000


def _model_bytes(system: str, size_bytes: int, config: BenchConfig) -> int:
    """Bytes of one float32 gradient of `size_bytes` in the system's wire dtype."""
    if system in CHUNKED_SYSTEMS:
        wire = config.wire_dtype_of(system)
    elif system == "mxnet-ps":
        wire = config.mxnet_dtype
    else:
        wire = system.removeprefix("gloo-")
    return wire_nbytes(wire, size_bytes // 4)


def _aggregates(system: str, node_aggregation: bool | None) -> bool:
    """reducerd's client reduces inside a node first (on whenever L > 1); ps-lite does not."""
    return system in REDUCERD_SYSTEMS if node_aggregation is None else node_aggregation


def theory_bytes_per_node(system: str, size_bytes: int, config: BenchConfig,
                          node_aggregation: bool | None = None) -> float:
    """Bytes a node's link carries each way for one allreduce, in theory (payload only).

    Parameter servers (reducerd, ps-lite): the model once per node with
    node-local aggregation (reducerd's default), else once per worker on the
    node. Ring: only the ring's
    edges between nodes use the link, one out and one in per node (ranks are
    placed node by node), each carrying 2(N-1)/N of the model.
    """
    model = _model_bytes(system, size_bytes, config)
    if system.startswith("gloo-"):
        n = config.workers
        return 2 * (n - 1) / n * model if config.nodes > 1 else 0.0
    return model * (1 if _aggregates(system, node_aggregation) else config.workers_per_node)


def daemon_link_bytes(system: str, size_bytes: int, config: BenchConfig) -> float:
    """Bytes the busiest daemon (or server) link carries each way; 0 for the ring."""
    if system.startswith("gloo-"):
        return 0.0
    model = _model_bytes(system, size_bytes, config)
    share = config.daemons
    if system == "mxnet-ps" and size_bytes // 4 < MXNET_BIGARRAY_BOUND:
        share = 1
    senders = config.nodes if _aggregates(system, None) else config.workers
    return senders * model / share


def line_rate_bound_s(system: str, size_bytes: int, config: BenchConfig) -> float:
    """Fastest possible time at line rate: the busiest link's bytes / RATE.

    That is the worker's (node's) link unless the daemons carry more: with
    D < N daemons each daemon link carries N/D models, which bounds the time.
    """
    assert config.rate_bytes_per_s
    busiest = max(theory_bytes_per_node(system, size_bytes, config),
                  daemon_link_bytes(system, size_bytes, config))
    return busiest / config.rate_bytes_per_s


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _paired(slowest: list[float], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The core's times in the same iterations (each its slowest rank's), and
    this system's time over the core's, iteration by iteration."""
    core = [max(times) for times in zip(*(r["reference_times_s"] for r in records),
                                        strict=True)]
    ratios = [ours / theirs for ours, theirs in zip(slowest, core, strict=True)]
    return {"time_s": {"median": statistics.median(core), "min": min(core), "max": max(core)},
            "ratio": {"median": statistics.median(ratios), "min": min(ratios),
                      "max": max(ratios)}}


def _result(system: str, size_bytes: int, records: list[dict[str, Any]],
            config: BenchConfig) -> dict[str, Any]:
    iterations = zip(*(r["times_s"] for r in records), strict=True)
    slowest = [max(times) for times in iterations]
    median = statistics.median(slowest)
    algbw = size_bytes / median / 1e9
    result: dict[str, Any] = {
        "system": system, "size_bytes": size_bytes,
        "time_s": {"median": median, "min": min(slowest), "max": max(slowest)},
        "algbw_GBps": algbw, "busbw_GBps": algbw * config.busbw_factor,
    }
    if records[0].get("reference_times_s"):
        result["paired_core"] = _paired(slowest, records)
    if config.emulate_cluster:
        per_node = config.workers_per_node
        node_records = records[::per_node]  # local rank 0 of every node
        sent = _mean([_mean(r["bytes_sent"]) for r in node_records])
        received = _mean([_mean(r["bytes_received"]) for r in node_records])
        theory = theory_bytes_per_node(system, size_bytes, config)
        result.update({
            "bytes_sent_per_worker": round(sent / per_node),
            "bytes_received_per_worker": round(received / per_node),
            "theory_bytes_per_worker": round(theory / per_node),
            "line_rate_bound_s": line_rate_bound_s(system, size_bytes, config),
        })
        if per_node > 1:
            result["bytes_sent_per_node"] = round(sent)
            result["bytes_received_per_node"] = round(received)
    return result


def aggregate(config: BenchConfig, records: dict[str, dict[int, list[dict[str, Any]]]],
              ) -> list[dict[str, Any]]:
    """Contract results, one per (system, size) that every rank finished, in run order."""
    results = []
    for system, by_rank in records.items():
        if len(by_rank) < config.workers:
            continue
        by_size: dict[int, list[dict[str, Any]]] = {}
        for rank in range(config.workers):
            for record in by_rank[rank]:
                by_size.setdefault(record["size_bytes"], []).append(record)
        for size_bytes in config.sizes_bytes:
            size_records = by_size.get(size_bytes, [])
            if len(size_records) == config.workers:
                results.append(_result(system, size_bytes, size_records, config))
    return results


def time_ratios(results: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(system, size) -> reducerd's median time / that system's (< 1: reducerd faster)."""
    ours = {r["size_bytes"]: r["time_s"]["median"] for r in results
            if r["system"] == "reducerd"}
    return {(r["system"], r["size_bytes"]): ours[r["size_bytes"]] / r["time_s"]["median"]
            for r in results if r["size_bytes"] in ours}
