"""One daemon summing on 1 and on N threads (issue 19 item 1): GB per wall- and per CPU-second.

For each thread count, in turn and `--repeats` times (so that the machine's
other load falls on every count alike), it starts a fresh daemon with
`--threads N` on loopback, drives it with the load generator
(reducerd.bench.loadgen: every contributor a data-plane connection, a few
worker processes, prepared float16 chunks, every result checked bit for
bit) and reads /proc over the timed rounds: the daemon's CPU (its event-loop
thread and all its other threads), the load generator's CPU, and the whole
machine's busy time (what neither of them used is other load). Then it
prints each run and, per thread count, the medians and their ratio to the
first count's: input GB per wall-second (target: 1.8x with 2 threads on a
2-core machine) and input GB per daemon CPU-second (target: no lower).

    .venv/bin/python scripts/daemon_threads.py --threads 1,2 --repeats 3 --json out.json
    .venv/bin/python scripts/daemon_threads.py --mode table --repeats 3

`--mode table` leaves the sockets and the load generator out: a fresh
process per run hands prepared contributions straight to a ReductionTable
(with a SummingPool for N > 1) on its main thread, which runs the results'
posts as the daemon's loop would: the daemon's summing path alone
(bookkeeping, adds, narrowing), the part that summing threads spread.

Big chunks (1 MiB by default) keep the per-message Python work small beside
the per-byte work, which is what summing threads spread. The load generator
runs on the same machine and takes its share of the cores; the machine's
other load changes every figure (the busy column says how much there was).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from many_contributors import _DATA_RE, other_threads_cpu_s
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.dtypes import WIRE_DTYPES, wire_nbytes, wire_numpy_dtype

from reducerd.bench.loadgen import LoadSpec, run_load
from reducerd.bench.procs import cpu_seconds as cpu_s
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.core.summing_c import summing_pool
from reducerd.ops.local import start_daemon
from reducerd.ops.memory import tune_malloc

_TICKS = os.sysconf("SC_CLK_TCK")
_SHARED_RE = re.compile(r"summing threads: (\d+) of (\d+) copies and adds summed in passes"
                        r".*?(\d+) finishes in those passes")


def machine_busy_s() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICKS, sum(fields[:8]) / _TICKS


def live_children_cpu_s(but: int) -> float:
    """CPU seconds so far of this process's live children other than `but`
    (the load generator's workers, not the daemon)."""
    total = 0.0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for child in (task / "children").read_text().split():
            if int(child) != but:
                try:
                    total += cpu_s(int(child))
                except FileNotFoundError:  # it just exited
                    pass
    return total


def reaped_children_cpu_s() -> float:
    """CPU seconds of every child this process has reaped so far."""
    times = os.times()
    return times.children_user + times.children_system


def measure(threads: int, args: argparse.Namespace) -> dict[str, Any]:
    daemon = start_daemon("--threads", str(threads), "--pool-chunk-bytes", "0",
                          "--round-timeout", "120",
                          "--max-inflight-bytes", str(args.max_inflight_bytes))
    try:
        deadline = time.monotonic() + 10
        while not (match := _DATA_RE.search(daemon.log())) and time.monotonic() < deadline:
            time.sleep(0.02)
        if match is None:
            raise RuntimeError(f"no data port in the daemon's log:\n{daemon.log()}")
        pid = daemon.process.pid
        rounds = max(2, round(args.input_bytes / (args.contributors * args.key_bytes)))
        spec = LoadSpec("127.0.0.1", int(match.group(2)), args.contributors,
                        key_bytes=args.key_bytes, chunk_bytes=args.chunk_bytes,
                        rounds=rounds, warmup=1, timeout_s=120)
        start: dict[str, float] = {"reaped": reaped_children_cpu_s()}

        def on_ready() -> None:  # just before the timed rounds
            start.update(cpu=cpu_s(pid), loop=cpu_s(pid, pid), load=live_children_cpu_s(pid))
            start["busy"], start["all"] = machine_busy_s()

        end: dict[str, float] = {}

        def on_timed() -> None:  # every timed round answered, no connection closed yet
            end.update(cpu=cpu_s(pid), loop=cpu_s(pid, pid))
            end["busy"], end["all"] = machine_busy_s()

        result = run_load(spec, args.processes, on_ready=on_ready, on_timed=on_timed)
        end_busy, end_all = end["busy"], end["all"]
        daemon_cpu = end["cpu"] - start["cpu"]
        loop_cpu = end["loop"] - start["loop"]
        # The workers have exited (the daemon not yet): their whole lives, less
        # what they had used when the timed rounds began (their closing included).
        load_cpu = reaped_children_cpu_s() - start["reaped"] - start["load"]
    finally:
        daemon.stop()
    shared = _SHARED_RE.search(daemon.log())  # the pool's line at its close (threads > 1)
    wall_s = result["wall_s"]
    cores = (end_all - start["all"]) / wall_s if wall_s else 0.0
    return {
        "threads": threads, "contributors": args.contributors, "rounds": rounds,
        "key_bytes": args.key_bytes, "chunk_bytes": args.chunk_bytes,
        "input_bytes": result["input_bytes"], "wall_s": wall_s, "errors": result["errors"],
        "daemon_cpu_s": daemon_cpu, "daemon_loop_thread_cpu_s": loop_cpu,
        "daemon_other_threads_cpu_s": other_threads_cpu_s(daemon_cpu, loop_cpu),
        "loadgen_cpu_s": load_cpu,
        "machine_busy_cores": (end_busy - start["busy"]) / wall_s if wall_s else 0.0,
        "machine_cores": round(cores),
        "GB_per_wall_s": result["input_bytes"] / wall_s / 1e9,
        "GB_per_daemon_cpu_s": result["input_bytes"] / daemon_cpu / 1e9 if daemon_cpu else 0.0,
        "chunk_latency_p50_s": result["chunk_latency_s"].get("p50", 0.0),
        "sums": int(shared.group(2)) if shared else 0,
        "sums_coalesced": int(shared.group(1)) if shared else 0,
        "finishes_in_passes": int(shared.group(3)) if shared else 0,
    }


def measure_table(threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One --mode table run in a fresh process (the pool sets the GIL's switch
    interval for the whole process: runs must not inherit it)."""
    options = {k: getattr(args, k) for k in ("contributors", "chunk_bytes", "key_bytes",
                                             "input_bytes", "max_inflight_bytes", "coalesce",
                                             "wire_dtype")}
    done = subprocess.run([sys.executable, __file__, "--one-table", str(threads),
                           json.dumps(options)], capture_output=True, text=True, timeout=600,
                          check=True)
    return json.loads(done.stdout)


def table_run(threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """The summing path alone: prepared contributions into a ReductionTable."""
    tune_malloc()  # the daemon's allocator settings, as it sets them before its threads start
    dtype = WIRE_DTYPES[args.wire_dtype]
    # Elements per chunk: chunk_bytes of the wire (an 8-bit wire's scales on top).
    world, numel = args.contributors, args.chunk_bytes // wire_numpy_dtype(dtype).itemsize
    wire_bytes = wire_nbytes(dtype, numel)
    chunks = max(1, args.key_bytes // args.chunk_bytes)
    rounds = max(2, round(args.input_bytes / (world * chunks * wire_bytes)))
    posted: queue.SimpleQueue = queue.SimpleQueue()
    pool = summing_pool(threads, coalesce_at_most=args.coalesce) if threads > 1 else None
    # As the daemon's loop does: finished sums wake this thread through the
    # pool's eventfd, and the summing threads never take the GIL to say so.
    readers: dict[int, Any] = {}
    if pool is not None:
        pool.start(lambda fn, *a: posted.put((fn, a)), readers.__setitem__)
    table = ReductionTable(120.0, args.max_inflight_bytes, summing=pool)
    landed = [0]
    table.on_deliveries = lambda deliveries: landed.__setitem__(0, landed[0] + len(deliveries))
    data = [convert.to_wire(np.random.default_rng(rank).standard_normal(numel).astype(np.float32),
                            dtype).tobytes() for rank in range(world)]

    def run_posts(until: int) -> None:  # as the daemon's loop runs them
        while landed[0] < until:
            try:
                fn, post_args = posted.get_nowait()
            except queue.Empty:
                ready, _, _ = select.select(list(readers), [], [], 60)
                if not ready:
                    raise TimeoutError("no summing task finished in 60 s") from None
                for fd in ready:
                    readers[fd]()
                continue
            fn(*post_args)

    started_s, started_cpu_s, loop_started_s = (time.perf_counter(), time.process_time(),
                                                time.thread_time())
    for round_ in range(rounds):
        for chunk in range(chunks):
            cid = ChunkId("bench", "grad", round_, chunk * numel)
            for rank in range(world):
                part = Contribution(rank, world, dtype, pb.REDUCE_OP_SUM, data[rank])
                landed[0] += len(table.contribute(cid, part, rank))
        run_posts((round_ - 1) * chunks)  # at most two rounds open, as a pipeline would
    run_posts(rounds * chunks)
    wall_s = time.perf_counter() - started_s
    cpu = time.process_time() - started_cpu_s
    loop = time.thread_time() - loop_started_s
    summed = coalesced = finished_in_pass = 0
    if pool is not None:
        pool.close()
        summed, coalesced, finished_in_pass = pool.summed, pool.coalesced, pool.finished_in_pass
    input_bytes = rounds * chunks * world * wire_bytes
    return {"threads": threads, "contributors": world, "rounds": rounds,
            "key_bytes": chunks * args.chunk_bytes, "chunk_bytes": args.chunk_bytes,
            "input_bytes": input_bytes, "wall_s": wall_s, "errors": [],
            "daemon_cpu_s": cpu, "daemon_loop_thread_cpu_s": loop,
            "daemon_other_threads_cpu_s": cpu - loop, "loadgen_cpu_s": 0.0,
            "machine_busy_cores": 0.0, "machine_cores": os.cpu_count() or 0,
            "GB_per_wall_s": input_bytes / wall_s / 1e9,
            "GB_per_daemon_cpu_s": input_bytes / cpu / 1e9, "chunk_latency_p50_s": 0.0,
            "coalesce_at_most": args.coalesce, "sums": summed, "sums_coalesced": coalesced,
            "finishes_in_passes": finished_in_pass,
            "wire_dtype": args.wire_dtype}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| threads | GB/wall-s | GB/daemon-CPU-s | daemon cores (loop + others) | "
             "load generator cores | machine busy cores | chunk p50 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wall = r["wall_s"]
        lines.append(
            f"| {r['threads']} | {r['GB_per_wall_s']:.3f} | {r['GB_per_daemon_cpu_s']:.3f} | "
            f"{r['daemon_cpu_s'] / wall:.2f} ({r['daemon_loop_thread_cpu_s'] / wall:.2f} + "
            f"{r['daemon_other_threads_cpu_s'] / wall:.2f}) | {r['loadgen_cpu_s'] / wall:.2f} | "
            f"{r['machine_busy_cores']:.2f} of {r['machine_cores']} | "
            f"{r['chunk_latency_p50_s'] * 1e3:.1f} | {len(r['errors'])} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict[str, Any]], counts: list[int]) -> tuple[str, dict[str, Any]]:
    medians = {n: {key: statistics.median(r[key] for r in rows if r["threads"] == n)
                   for key in ("GB_per_wall_s", "GB_per_daemon_cpu_s")} for n in counts}
    base = medians[counts[0]]
    lines = [f"medians over {len(rows) // len(counts)} run(s) each:"]
    ratios: dict[str, Any] = {}
    for n in counts:
        m = medians[n]
        wall_ratio = m["GB_per_wall_s"] / base["GB_per_wall_s"]
        cpu_ratio = m["GB_per_daemon_cpu_s"] / base["GB_per_daemon_cpu_s"]
        ratios[str(n)] = {**m, "wall_ratio": wall_ratio, "cpu_ratio": cpu_ratio}
        lines.append(f"  --threads {n}: {m['GB_per_wall_s']:.3f} GB/wall-s "
                     f"({wall_ratio:.2f}x), {m['GB_per_daemon_cpu_s']:.3f} GB/daemon-CPU-s "
                     f"({cpu_ratio:.2f}x)")
    return "\n".join(lines) + "\n", ratios


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one-table"]:
        print(json.dumps(table_run(int(argv[1]), argparse.Namespace(**json.loads(argv[2])))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, the first the base")
    parser.add_argument("--mode", choices=("daemon", "table"), default="daemon",
                        help="a daemon driven by the load generator, or the table alone")
    parser.add_argument("--repeats", type=int, default=3, help="runs per thread count")
    parser.add_argument("--contributors", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2, help="load worker processes")
    parser.add_argument("--key-bytes", type=int, default=8 << 20,
                        help="float16 bytes each contributor sends per round (default 8 MiB)")
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--input-bytes", type=int, default=1 << 30,
                        help="daemon input per run, about (default 1 GiB)")
    parser.add_argument("--max-inflight-bytes", type=int, default=4 << 30)
    parser.add_argument("--wire-dtype", choices=sorted(WIRE_DTYPES), default="float16",
                        help="table mode: the contributions' wire dtype (the daemon mode's "
                             "load generator sends float16)")
    parser.add_argument("--coalesce", type=int, default=None,
                        help="table mode: a chunk's queued adds a summing thread takes in one "
                             "pass, at most (1: each alone; default: the pool's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.mode == "daemon" and args.wire_dtype != "float16":
        parser.error("--wire-dtype: the daemon mode's load generator sends float16 only")
    counts = [int(n) for n in args.threads.split(",")]
    rows = []
    for repeat in range(args.repeats):
        for n in counts:
            rows.append((measure if args.mode == "daemon" else measure_table)(n, args))
            r = rows[-1]
            shared = (f", {r['sums_coalesced']} of {r['sums']} sums in shared passes"
                      f" ({r['finishes_in_passes']} finishes)" if r["sums"] else "")
            print(f"run {repeat + 1}, --threads {n}: {r['GB_per_wall_s']:.3f} GB/wall-s, "
                  f"{r['GB_per_daemon_cpu_s']:.3f} GB/daemon-CPU-s, {len(r['errors'])} errors"
                  f"{shared}", file=sys.stderr, flush=True)
    sys.stdout.write(table(rows))
    text, ratios = summary(rows, counts)
    sys.stdout.write(text)
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "medians": ratios}, indent=2) + "\n")
    return 0 if not any(r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
