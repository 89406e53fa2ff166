"""Prometheus metrics: the collector on a bare table, a real daemon scraped mid-run, the dashboard.

Scenarios: bytes by dtype, completions, failures by reason (a late rank's
repeat of a failure is not a second failed chunk), latency histogram, open
chunks and bytes held while a round waits, job labels capped at
metrics_max_jobs with the rest under "other"; the Grafana dashboard only
queries series that the daemon exports.
"""

import json
import re
import threading
import time

import numpy as np
from conftest import DEPLOY, metrics_url, scrape, shard
from prometheus_client import generate_latest
from reducer_client import ReducerClient
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from support import start_daemon

from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.ops.metrics import OTHER_JOB, BootTimeProcessCollector, Metrics

F16, F32 = pb.DTYPE_FLOAT16, pb.DTYPE_FLOAT32


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def contribute(table, metrics, job, rank, world_size, key="w", round_=0, dtype=F16,
               numel=8):
    part = Contribution(rank, world_size, dtype, pb.REDUCE_OP_SUM,
                        np.ones(numel, dtype="<f2" if dtype == F16 else "<f4").tobytes())
    metrics.shard_in(job, dtype, len(part.data))
    for delivery in table.contribute(ChunkId(job, key, round_, 0), part, sink=(job, rank)):
        metrics.delivered(delivery)


def test_collector_on_a_bare_table():
    clock = FakeClock()
    table = ReductionTable(round_timeout_s=10, max_inflight_bytes=1 << 20, clock=clock)
    metrics = Metrics(table, max_jobs=2, stalled_after_s=1.0)
    for rank in range(2):  # job a: one float16 round, 0.25 s from first to last
        contribute(table, metrics, "a", rank, 2)
        clock.now += 0.25
    contribute(table, metrics, "b", 0, 1, dtype=F32, numel=4)  # world size 1: at once
    contribute(table, metrics, "c", 0, 2)  # third job: "other"; waits for rank 1
    contribute(table, metrics, "a", 0, 2, key="bad")
    contribute(table, metrics, "a", 1, 2, key="bad", numel=9)  # length mismatch
    contribute(table, metrics, "a", 0, 2, key="bad")  # a retry: told again, counted once
    contribute(table, metrics, "a", 1, 2)  # a resend after reconnecting: the cached result
    clock.now += 2.0
    samples = scrape_registry(metrics)

    assert value(samples, "reducerd_bytes_in_total", reducer_job="a", dtype="float16") == (
        2 * 16 + 16 + 18 + 16 + 16)
    assert value(samples, "reducerd_bytes_in_total", reducer_job="b", dtype="float32") == 16
    assert value(samples, "reducerd_bytes_out_total", reducer_job="a", dtype="float16") == 48
    assert value(samples, "reducerd_chunks_completed_total", reducer_job="a") == 1
    assert value(samples, "reducerd_chunks_failed_total", reducer_job="a",
                 reason="invalid_argument") == 1
    assert value(samples, "reducerd_round_latency_seconds_count", reducer_job="a") == 1
    assert value(samples, "reducerd_round_latency_seconds_sum", reducer_job="a") == 0.25
    assert value(samples, "reducerd_round_latency_seconds_bucket", reducer_job="a",
                 le="0.1") == 0
    assert value(samples, "reducerd_round_latency_seconds_bucket", reducer_job="a",
                 le="0.25") == 1
    assert value(samples, "reducerd_open_chunks", reducer_job=OTHER_JOB) == 1
    assert value(samples, "reducerd_bytes_in_total", reducer_job=OTHER_JOB,
                 dtype="float16") == 16
    assert not any(dict(labels).get("reducer_job") == "c" for _, labels in samples)
    assert value(samples, "reducerd_bytes_held") == 8 * 4
    assert value(samples, "reducerd_stalled_chunks") == 1
    assert value(samples, "reducerd_jobs") == 3


def scrape_registry(metrics):
    from conftest import parse_exposition

    return parse_exposition(generate_latest(metrics.registry).decode())


def _allreduce_worker(address, rank, rounds, results):
    with ReducerClient([address], job="train", rank=rank, world_size=2,
                       wire_dtype="float16", timeout=20) as client:
        for i in range(rounds):
            results[rank] = client.allreduce(np.full(50_000, rank + i, np.float32), key="g")


def test_scrape_a_real_daemon_during_a_reduction(tmp_path, raw_streams):
    daemon = start_daemon("--metrics-listen", "127.0.0.1:0", "--metrics-max-jobs", "1",
                          "--round-timeout", "1.5", "--stalled-after", "0.2", log_dir=tmp_path)
    try:
        url = metrics_url(daemon)
        # First job "held" (it keeps the one job label): rank 0 of 2 opens a round.
        rank0, rank1 = raw_streams(daemon.address), raw_streams(daemon.address)
        rank0.send(shard("held", 0, 2, numel=1000))
        held = _wait_for(url, lambda s: value(s, "reducerd_stalled_chunks"))
        assert value(held, "reducerd_open_chunks", reducer_job="held") == 1
        assert value(held, "reducerd_open_chunk_bytes", reducer_job="held") == 1000 * 4
        assert value(held, "reducerd_bytes_held") == 1000 * 4
        assert value(held, "reducerd_open_streams") == 2

        # Second job "train" (counted as "other"): two ranks, three rounds each.
        results = {}
        workers = [threading.Thread(target=_allreduce_worker,
                                    args=(daemon.address, rank, 3, results))
                   for rank in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=30)
        np.testing.assert_allclose(results[0], np.full(50_000, 5.0))
        during = scrape(url)
        completed = value(during, "reducerd_chunks_completed_total", reducer_job=OTHER_JOB)
        assert completed >= 3
        assert value(during, "reducerd_round_latency_seconds_count",
                     reducer_job=OTHER_JOB) == completed
        # Both ranks send 3 rounds of 50,000 float16 elements; each gets every result back.
        for name in ("reducerd_bytes_in_total", "reducerd_bytes_out_total"):
            assert value(during, name, reducer_job=OTHER_JOB, dtype="float16") == (
                2 * 3 * 50_000 * 2)
        assert value(during, "reducerd_open_chunks", reducer_job="held") == 1

        # Rank 1 completes the held round; the next held round times out.
        rank1.send(shard("held", 1, 2, numel=1000))
        assert rank0.next_reply().data
        rank0.send(shard("held", 0, 2, numel=1000, round_=1))
        after = _wait_for(url, lambda s: value(s, "reducerd_chunks_failed_total",
                                               reducer_job="held", reason="deadline_exceeded"))
        assert value(after, "reducerd_chunks_completed_total", reducer_job="held") == 1
        assert value(after, "reducerd_round_latency_seconds_sum", reducer_job="held") > 0.2
        assert value(after, "reducerd_open_chunks", reducer_job="held") == 0
        assert value(after, "reducerd_open_chunk_bytes", reducer_job="held") == 0
        assert value(after, "reducerd_bytes_held") == 0
        assert value(after, "reducerd_jobs") == 2
        assert value(after, "process_resident_memory_bytes") > 0
    finally:
        assert daemon.stop() == 0, daemon.log()


def _wait_for(url, predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if predicate(samples) or time.monotonic() > deadline:
            assert predicate(samples), f"not seen within {timeout_s} s: {samples}"
            return samples
        time.sleep(0.05)


def test_dashboard_queries_only_exported_series():
    dashboard = json.loads((DEPLOY / "grafana" / "reducerd.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = set(re.findall(r"\b((?:reducerd|process)_[a-z_]+)", " ".join(queries)))

    table = ReductionTable(round_timeout_s=10, max_inflight_bytes=1 << 20)
    metrics = Metrics(table)
    contribute(table, metrics, "a", 0, 1)
    contribute(table, metrics, "a", 0, 2, key="bad")
    contribute(table, metrics, "a", 1, 2, key="bad", numel=9)
    exported = {name for name, _ in scrape_registry(metrics)}
    assert used and used <= exported, used - exported
    assert {p["id"] for p in dashboard["panels"]} == set(range(1, len(dashboard["panels"]) + 1))


def test_process_metrics_without_proc_stat(tmp_path):
    """Under ProcSubset=pid only /proc/PID is visible: no /proc/stat for the boot time."""
    (tmp_path / "self").symlink_to("/proc/self")
    collector = BootTimeProcessCollector(proc=str(tmp_path), pid=lambda: "self", registry=None)
    names = {sample.name for family in collector.collect() for sample in family.samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
