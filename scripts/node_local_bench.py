"""Node-local aggregation vs flat: time per allreduce and bytes sent to the daemons.

    .venv/bin/python scripts/node_local_bench.py [--workers 4] [--daemons 2]
        [--mib 64] [--wire-dtype float16] [--iters 5] [--warmup 2]

Starts D reducerd daemons on 127.0.0.1 and W worker processes that all play
one node (local ranks 0..W-1), then runs the same float32 allreduce with
node-local aggregation on and off. Time: the median over the iterations of
the slowest worker's allreduce (each iteration starts after the previous one
ended everywhere). Bytes: what the daemons counted in (contributions) and out
(results) for the job, per allreduce, from GetStatus. On one host this shows
the daemons' load and the bytes the node's link would carry, not a network.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from reducerd.ops.local import running_daemons


def job_bytes(addresses: list[str], job: str) -> tuple[int, int]:
    from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
    from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc

    total_in = total_out = 0
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.ReducerStub(channel).GetStatus(pb.StatusRequest(job=job), timeout=5)
        for status in reply.jobs:
            total_in += status.bytes_in
            total_out += status.bytes_out
    return total_in, total_out


def worker(rank: int, args: argparse.Namespace, addresses: list[str], job: str,
           node_local: bool, barrier, results) -> None:
    from reducer_client import ReducerClient

    x = np.full((args.mib << 20) // 4, rank + 1.0, dtype=np.float32)
    with ReducerClient(addresses, job=job, rank=rank, world_size=args.workers,
                       wire_dtype=args.wire_dtype, timeout=300, local_rank=rank,
                       local_size=args.workers, node_local=node_local) as client:
        times = []
        for i in range(args.warmup + args.iters):
            barrier.wait()
            start = time.perf_counter()
            out = client.allreduce(x, key="grad")
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        expected = args.workers * (args.workers + 1) / 2
        assert out[0] == expected and out[-1] == expected, (out[0], expected)
        barrier.wait()
    results.put((rank, times))


def run(args: argparse.Namespace, addresses: list[str], node_local: bool) -> dict:
    ctx = mp.get_context("spawn")
    job = f"bench-{'node' if node_local else 'flat'}-{time.monotonic_ns()}"
    barrier, results = ctx.Barrier(args.workers), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, addresses, job, node_local, barrier,
                                              results)) for r in range(args.workers)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    slowest = [max(per_rank[r][i] for r in per_rank) for i in range(args.iters)]
    bytes_in, bytes_out = job_bytes(addresses, job)
    calls = args.warmup + args.iters
    return {"mode": "node-local" if node_local else "flat",
            "time_s": statistics.median(slowest), "min_s": min(slowest),
            "to_daemons_MiB": bytes_in / calls / 2**20,
            "from_daemons_MiB": bytes_out / calls / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--daemons", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64, help="float32 gradient size")
    parser.add_argument("--wire-dtype", default="float16")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with running_daemons(args.daemons, log_dir=Path(tempfile.mkdtemp())) as daemons:
        rows = [run(args, daemons.addresses, node_local) for node_local in (False, True)]
    print(f"{args.workers} workers on 1 node, {args.daemons} daemons, {args.mib} MiB float32, "
          f"{args.wire_dtype} wire, median of {args.iters} (after {args.warmup} warm-up)")
    for row in rows:
        print(f"  {row['mode']:>10}: {row['time_s'] * 1e3:8.1f} ms per allreduce "
              f"(min {row['min_s'] * 1e3:.1f}), to daemons {row['to_daemons_MiB']:.1f} MiB, "
              f"from daemons {row['from_daemons_MiB']:.1f} MiB")


if __name__ == "__main__":
    main()
