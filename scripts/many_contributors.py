"""Many contributors against one daemon (issue 19): latency, memory and CPU per contributor.

For each contributor count it starts a fresh daemon on loopback, drives it
with reducerd.bench.loadgen (every contributor a data-plane connection, a
few worker processes), and reads the daemon's /proc/PID: VmRSS idle, with
every connection open, and its peak during the timed rounds (sampled every
20 ms), its threads, and its CPU time over the timed rounds (read once every
timed round is answered and before any connection closes: ending hundreds of
streams is a cost per connection, reported apart, which in a short run would
pass for a cost per round). The input per count is about the same
(--input-bytes), so CPU per contributor-round and GB per CPU-second compare
directly.

    .venv/bin/python scripts/many_contributors.py --contributors 8,64,256 --json out.json

The machine's other load changes every figure; runs are meant to be short.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from reducerd.bench.loadgen import LoadSpec, run_load
from reducerd.bench.procs import cpu_seconds as cpu_s
from reducerd.bench.procs import proc_status
from reducerd.ops.local import start_daemon

_DATA_RE = re.compile(r"data plane on (\S+):(\d+)")


class _PeakRss:
    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.pid, self.period_s, self.peak, self.threads = pid, period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            status = proc_status(self.pid)
            self.peak = max(self.peak, status["VmRSS"])
            self.threads = max(self.threads, status["Threads"])

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def other_threads_cpu_s(process_cpu_s: float, loop_cpu_s: float) -> float:
    """The daemon's CPU outside its loop thread. Both figures are /proc's 10 ms
    clock ticks, read a moment apart: a difference below zero is rounding."""
    return max(0.0, process_cpu_s - loop_cpu_s)


def measure(contributors: int, args: argparse.Namespace) -> dict[str, Any]:
    daemon = start_daemon("--round-timeout", "120", *args.daemon_args)
    try:
        deadline = time.monotonic() + 10
        while not (match := _DATA_RE.search(daemon.log())) and time.monotonic() < deadline:
            time.sleep(0.02)
        if match is None:
            raise RuntimeError(f"no data port in the daemon's log:\n{daemon.log()}")
        pid = daemon.process.pid
        rounds = max(2, round(args.input_bytes / (contributors * args.key_bytes)))
        spec = LoadSpec("127.0.0.1", int(match.group(2)), contributors,
                        key_bytes=args.key_bytes, chunk_bytes=args.chunk_bytes,
                        rounds=rounds, warmup=1, timeout_s=120)
        idle = proc_status(pid)
        connected: dict[str, Any] = {}
        ready: dict[str, Any] = {}

        def on_ready() -> None:
            # The main thread is the event loop's, which alone sums (reducerd.daemon.server).
            ready.update(proc_status(pid), cpu_s=cpu_s(pid), loop_cpu_s=cpu_s(pid, pid))

        timed: dict[str, Any] = {}

        def on_timed() -> None:  # before the connections close: ending streams is
            # a cost per connection, not per round
            timed.update(proc_status(pid), cpu_s=cpu_s(pid), loop_cpu_s=cpu_s(pid, pid))

        with _PeakRss(pid) as peak:
            result = run_load(spec, args.processes,
                              lambda: connected.update(proc_status(pid)), on_ready, on_timed)
        cpu = timed["cpu_s"] - ready["cpu_s"]
        loop_cpu = timed["loop_cpu_s"] - ready["loop_cpu_s"]
        end = proc_status(pid)
        time.sleep(0.2)  # the last streams' ends (their status frames went out already)
        closing_cpu = cpu_s(pid) - timed["cpu_s"]  # once per connection, not per round
    finally:
        daemon.stop()
    chunks = len(spec.chunk_numels)
    # What the open chunks need: a float32 accumulator per chunk of the key, and
    # the cached result (a wire-size reply) kept until the next round completes.
    open_chunk_bytes = 2 * args.key_bytes + args.key_bytes
    return {
        **result, "rounds": rounds, "key_bytes": args.key_bytes,
        "chunk_bytes": args.chunk_bytes, "chunks_per_round": chunks,
        "daemon_cpu_s": cpu, "daemon_loop_thread_cpu_s": loop_cpu,
        "daemon_other_threads_cpu_s": other_threads_cpu_s(cpu, loop_cpu),
        "daemon_closing_cpu_ms_per_connection": closing_cpu / contributors * 1e3,
        "cpu_ms_per_contributor_round": cpu / (contributors * rounds) * 1e3,
        "input_GB_per_cpu_s": result["input_bytes"] / cpu / 1e9 if cpu else None,
        "rss_idle_bytes": idle["VmRSS"], "rss_connected_bytes": connected["VmRSS"],
        "rss_per_connection_bytes": (connected["VmRSS"] - idle["VmRSS"]) / contributors,
        "rss_warm_bytes": ready["VmRSS"], "rss_peak_bytes": max(peak.peak, ready["VmRSS"]),
        "rss_hwm_bytes": end["VmHWM"], "open_chunk_bytes": open_chunk_bytes,
        "threads_idle": idle["Threads"], "threads_running": ready["Threads"],
        "threads_peak": peak.threads,
    }


def per(row: dict[str, Any], part: str) -> str:
    """One part's CPU ms per contributor-round."""
    name = "daemon_loop_thread_cpu_s" if part == "loop" else "daemon_other_threads_cpu_s"
    return f"{row[name] / (row['contributors'] * row['rounds']) * 1e3:.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    mib = 1 << 20
    lines = ["| contributors | rounds | round ms (median) | chunk latency p50 / p99 ms | "
             "daemon CPU ms per contributor-round (loop thread + others) | GB per CPU-s | "
             "threads | "
             "RSS idle / connected / peak MiB | peak - idle over open-chunk need | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lat = r["chunk_latency_s"]
        growth = (r["rss_peak_bytes"] - r["rss_idle_bytes"]) / r["open_chunk_bytes"]
        lines.append(
            f"| {r['contributors']} | {r['rounds']} | {r['round_s']['median'] * 1e3:.1f} | "
            f"{lat.get('p50', 0) * 1e3:.1f} / {lat.get('p99', 0) * 1e3:.1f} | "
            f"{r['cpu_ms_per_contributor_round']:.3f} ({per(r, 'loop')} + "
            f"{per(r, 'other')}) | {r['input_GB_per_cpu_s']:.2f} | "
            f"{r['threads_running']} | {r['rss_idle_bytes'] / mib:.0f} / "
            f"{r['rss_connected_bytes'] / mib:.0f} / {r['rss_peak_bytes'] / mib:.0f} | "
            f"{growth:.1f}x | {len(r['errors'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contributors", default="8,64,256")
    parser.add_argument("--processes", type=int, default=4, help="load worker processes")
    parser.add_argument("--key-bytes", type=int, default=1 << 20,
                        help="float16 bytes each contributor sends per round (default 1 MiB)")
    parser.add_argument("--chunk-bytes", type=int, default=256 << 10)
    parser.add_argument("--input-bytes", type=int, default=512 << 20,
                        help="daemon input per count, about (default 512 MiB)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("daemon_args", nargs="*", metavar="-- DAEMON_ARG",
                        help="more arguments for the daemon, after --, e.g. -- --threads 1")
    args = parser.parse_args(argv)
    rows = []
    for count in (int(c) for c in args.contributors.split(",")):
        rows.append(measure(count, args))
        print(f"{count} contributors: {rows[-1]['wall_s']:.1f} s, "
              f"{len(rows[-1]['errors'])} errors", file=sys.stderr, flush=True)
    sys.stdout.write(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if not any(r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
