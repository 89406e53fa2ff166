"""What two cores of this machine give against one, for the work a summing thread does.

Each workload runs in 1 process, then in 2 processes at once; the figure is
their summed rate over the one's. It separates what the machine allows (two
vCPUs that are one core's threads, or memory that two cores share) from what
the daemon's summing pool adds on top (scripts/daemon_threads.py):

- spin: a Python integer loop (the cores themselves);
- add-in-cache: the float16 add kernel, 1 MiB into a 2 MiB float32
  accumulator, over and over (a working set in L2/L3);
- add-past-cache: the same kernel over 16 accumulators of 2 MiB and 8
  contributions of 1 MiB (40 MiB, past most L3s), as the table run sums;
- copy: NumPy copying 128 MiB (memory bandwidth).

    .venv/bin/python scripts/core_scaling.py --repeats 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Process, Queue
from pathlib import Path

import numpy as np


def spin(q: Queue) -> None:
    started, total = time.perf_counter(), 0
    for i in range(20_000_000):
        total += i
    q.put(20e6 / (time.perf_counter() - started) / 1e9)  # G iterations per second


def _add_rate(accumulators: int, contributions: int, passes: int) -> float:
    from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

    from reducerd.core.accumulate import add_wire_into

    numel = 1 << 19
    accs = [np.zeros(numel, np.float32) for _ in range(accumulators)]
    datas = [np.ones(numel, np.float16).tobytes() for _ in range(contributions)]
    add_wire_into(accs[0], datas[0], pb.DTYPE_FLOAT16)
    started, added = time.perf_counter(), 0
    for _ in range(passes):
        for acc in accs:
            for data in datas:
                add_wire_into(acc, data, pb.DTYPE_FLOAT16)
                added += len(data)
    return added / (time.perf_counter() - started) / 1e9  # GB of float16 input per second


def add_in_cache(q: Queue) -> None:
    q.put(_add_rate(1, 1, 3000))


def add_past_cache(q: Queue) -> None:
    q.put(_add_rate(16, 8, 40))


def copy(q: Queue) -> None:
    src = np.ones(32 << 20, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    started = time.perf_counter()
    for _ in range(20):
        np.copyto(dst, src)
    q.put(20 * 2 * src.nbytes / (time.perf_counter() - started) / 1e9)  # GB moved per second


WORKLOADS = {"spin": spin, "add-in-cache": add_in_cache, "add-past-cache": add_past_cache,
             "copy": copy}


def run(target, processes: int) -> list[float]:
    results: Queue = Queue()
    procs = [Process(target=target, args=(results,)) for _ in range(processes)]
    for proc in procs:
        proc.start()
    rates = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join()
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for name in args.workloads.split(","):
        for _ in range(args.repeats):
            one, two = run(WORKLOADS[name], 1)[0], run(WORKLOADS[name], 2)
            rows.append({"workload": name, "one": one, "two": two, "ratio": sum(two) / one})
            print(f"{name}: 1 process {one:.2f}; 2 at once {two[0]:.2f} + {two[1]:.2f} "
                  f"= {sum(two) / one:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
