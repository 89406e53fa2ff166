"""The client's CPU per chunk, on the Python send path and on the C loop, in one run.

One worker (world size 1), D daemons on loopback, float16 wire, small chunks
(--chunk-bytes) so that a key's chunk count is large: the client's CPU per
key (process CPU time: every thread of this process, none of the daemons')
is measured for keys of two sizes, and the slope between them is the CPU one
more chunk costs, its conversions included. Both paths run against the same
daemons, one after the other, --repeats times each.

    .venv/bin/python scripts/client_chunk_cpu.py --daemons 4 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from reducer_client.client import ReducerClient

from reducerd.bench.host import cpu_model
from reducerd.ops.local import start_daemon

_KEYS = 20
_PASSES = 10


def per_key_cpu_s(client: ReducerClient, numel: int) -> float:
    x = np.ones(numel, np.float32)
    out = np.empty_like(x)
    keys = [f"k{i}-{numel}" for i in range(_KEYS)]
    for _ in range(2):  # the first key goes through Python; then the loop's connections
        for key in keys:
            client.allreduce(x, key=key, out=out)
        if client.c_loop is not None:
            client.c_loop.wait_ready(10)
    start = time.process_time()
    for _ in range(_PASSES):
        for future in [client.allreduce_async(x, key=key, out=out) for key in keys]:
            future.result()
    return (time.process_time() - start) / (_PASSES * _KEYS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=4)
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    small, large = 8192, 262144
    print(f"CPU: {cpu_model()}")
    daemons = [start_daemon() for _ in range(args.daemons)]
    try:
        for repeat in range(args.repeats):
            row = []
            for name, switch in (("python", "0"), ("c-loop", "1")):
                with ReducerClient([d.address for d in daemons], job=f"cpu-{name}-{repeat}",
                                   rank=0, world_size=1, wire_dtype="float16",
                                   chunk_bytes=args.chunk_bytes, data_plane="tcp",
                                   environ={"REDUCER_CLIENT_C_LOOP": switch}) as client:
                    chunks = [len(client._layout.plan(n, 1, "k")) for n in (small, large)]
                    cpu = [per_key_cpu_s(client, n) for n in (small, large)]
                    if switch == "1" and client.c_loop is None:
                        row.append(f"{name}: not built")
                        continue
                per_chunk_us = (cpu[1] - cpu[0]) / (chunks[1] - chunks[0]) * 1e6
                row.append(f"{name} {per_chunk_us:.1f} us/chunk")
            print(f"run {repeat + 1} ({chunks[0]} -> {chunks[1]} chunks a key): " + ", ".join(row))
    finally:
        for d in daemons:
            d.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
