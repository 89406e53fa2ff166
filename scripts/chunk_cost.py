"""CPU per key for many small keys in flight: one worker, D daemons, loopback.

Each timed pass starts 50 allreduces of NUMEL float32 elements at once
(keys b0..b49, as a training step's buckets) and waits for them; the
figures are the client's and the daemons' CPU (user + system, from
/proc) and the wall time per key. It shows what a key's chunk count costs
(reducer_wire.layout): a chunk costs CPU whatever its size.

    .venv/bin/python scripts/chunk_cost.py --daemons 8 --numel 65536 --passes 20
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from reducer_client.client import ReducerClient

from reducerd.bench.procs import cpu_seconds
from reducerd.ops.local import start_daemon

_KEYS = 50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemons", type=int, default=8)
    parser.add_argument("--numel", type=int, default=1 << 16)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--wire-dtype", default="float16")
    args = parser.parse_args(argv)
    daemons = [start_daemon() for _ in range(args.daemons)]
    try:
        with ReducerClient([d.address for d in daemons], job="chunk-cost", rank=0,
                           world_size=1, wire_dtype=args.wire_dtype,
                           data_plane="tcp") as client:
            x = np.random.default_rng(0).standard_normal(args.numel).astype(np.float32)
            out = np.empty_like(x)
            keys = [f"b{i}" for i in range(_KEYS)]
            for key in keys:  # connect and warm up
                client.allreduce(x, key=key, out=out)
            cpu0, wall0 = time.process_time(), time.monotonic()
            daemons0 = sum(cpu_seconds(d.process.pid) for d in daemons)
            for _ in range(args.passes):
                for future in [client.allreduce_async(x, key=k, out=out) for k in keys]:
                    future.result()
            cpu1, wall1 = time.process_time(), time.monotonic()
            daemons1 = sum(cpu_seconds(d.process.pid) for d in daemons)
    finally:
        for d in daemons:
            d.stop()
    n = args.passes * _KEYS
    print(f"D={args.daemons} numel={args.numel} keys={n}: wall {1e3 * (wall1 - wall0) / n:.3f} "
          f"ms/key, client CPU {1e3 * (cpu1 - cpu0) / n:.3f} ms/key, daemons' CPU "
          f"{1e3 * (daemons1 - daemons0) / n:.3f} ms/key")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
