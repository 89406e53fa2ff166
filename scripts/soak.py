"""Soak: many workers, two jobs, mixed sizes, for a bounded time.

    python scripts/soak.py --duration 600 --workers 8 --daemons 2 [--json FILE]

Two jobs of workers/2 ranks each share the daemons. Every worker runs
allreduces of mixed sizes (1 KiB to 4 MiB of float32, float16 wire) and checks
each result exactly (the inputs are small integers, exact in float16 and in
any summation order). At the end it prints rounds completed, errors (must be
0), each daemon's RSS after the warm-up and at the end, and p50 / p99 latency.
Exit status 1 if any error occurred. Talks only to daemons it starts on
127.0.0.1 and stops them before it exits.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

from reducerd.bench.procs import proc_status

SIZES = [256, 4096, 65_536, 262_144, 1 << 20]  # elements of float32


def worker(job: int, rank: int, world: int, addresses: list[str], stop_at: float,
           results: mp.Queue) -> None:
    from reducer_client import ReducerClient, ReducerError

    latencies, errors, rounds = [], [], 0
    rng = np.random.default_rng(job)  # the same size sequence on every rank of a job
    try:
        with ReducerClient(addresses, job=f"soak-{job}", rank=rank, world_size=world,
                           wire_dtype="float16", timeout=60) as client:
            while True:
                # Ranks must stop at the same round: each votes with its own
                # clock, and all go on only while every rank votes to.
                vote = np.array([1.0 if time.time() < stop_at else 0.0], dtype=np.float32)
                if client.allreduce(vote, key="go", op="sum")[0] < world:
                    break
                size = int(rng.choice(SIZES))
                value = (rounds % 7) + rank
                x = np.full(size, value, dtype=np.float32)
                start = time.perf_counter()
                try:
                    out = client.allreduce(x, key=f"grad/{size}", op="sum")
                except ReducerError as exc:
                    errors.append(repr(exc))
                    break
                latencies.append(time.perf_counter() - start)
                expected = world * (rounds % 7) + world * (world - 1) / 2
                if not np.all(out == expected):
                    errors.append(f"rank {rank} round {rounds}: wrong result {out[:3]}")
                rounds += 1
    except Exception as exc:
        errors.append(repr(exc))
    results.put((job, rank, rounds, latencies, errors))


def run(duration_s: float, workers: int, daemons: int, warmup_s: float) -> dict:
    from reducerd.ops.local import running_daemons

    with running_daemons(daemons, "--round-timeout", "60") as started:
        procs, addresses = started.processes, started.addresses
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        start = time.time()
        stop_at = start + duration_s
        per_job = workers // 2
        children = [ctx.Process(target=worker, args=(job, rank, per_job, addresses, stop_at,
                                                     results))
                    for job in range(2) for rank in range(per_job)]
        for child in children:
            child.start()
        time.sleep(min(warmup_s, duration_s / 2))
        rss_start = [proc_status(d.process.pid)["VmRSS"] for d in procs]
        collected = [results.get(timeout=duration_s + 120) for _ in children]
        rss_end = [proc_status(d.process.pid)["VmRSS"] for d in procs]
        for child in children:
            child.join(30)
    latencies = np.array([x for r in collected for x in r[3]]) * 1e3
    errors = [e for r in collected for e in r[4]]
    return {
        "duration_s": round(time.time() - start, 1), "workers": workers, "daemons": daemons,
        "jobs": 2, "rounds_completed": int(sum(r[2] for r in collected)),
        "errors": len(errors), "error_samples": errors[:5],
        "daemon_rss_start_bytes": rss_start, "daemon_rss_end_bytes": rss_end,
        "daemon_rss_growth": [round(e / s - 1, 4) for s, e in zip(rss_start, rss_end,
                                                                   strict=True)],
        "latency_ms_p50": round(float(np.percentile(latencies, 50)), 2) if latencies.size else None,
        "latency_ms_p99": round(float(np.percentile(latencies, 99)), 2) if latencies.size else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--daemons", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds before the starting RSS is taken")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args(argv)
    report = run(args.duration, args.workers, args.daemons, args.warmup)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
