"""The wire conversions, C (reducer_wire._kernels) against NumPy, same run.

    python scripts/wire_speed.py [--mib 64] [--repeat 5]

Times, per 1 MiB chunk as the client and daemon use them, float32 -> float16
of a --mib MiB float32 gradient, float16 -> float32 of the result, and the
daemon's float16 widen-and-add into a float32 accumulator; prints the best of
--repeat for each implementation and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd import accumulate

F16 = pb.DTYPE_FLOAT16
CHUNK = 1 << 19  # float16 elements in a 1 MiB chunk


def best_of(repeat: int, fn) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not convert.accelerated():
        print("reducer_wire._kernels is not built (no C compiler?)", file=sys.stderr)
        return 1
    x = np.random.default_rng(0).standard_normal(args.mib << 18).astype(np.float32)
    out = np.empty_like(x)
    acc = np.zeros(CHUNK, dtype=np.float32)
    starts = range(0, x.size, CHUNK)
    encoded = [convert.to_wire(x[i:i + CHUNK], F16).tobytes() for i in starts]

    def narrow():
        for i in starts:
            convert.to_wire(x[i:i + CHUNK], F16)

    def widen():
        for i, data in zip(starts, encoded, strict=True):
            convert.from_wire(data, F16, out[i:i + CHUNK])

    def add():
        scratch = np.empty(CHUNK, dtype=np.float32)
        for data in encoded:
            accumulate.add_wire_into(acc[:len(data) // 2], data, F16, scratch)

    print(f"{args.mib} MiB float32 gradient, 1 MiB float16 chunks, best of {args.repeat}:")
    for name, fn in (("float32 -> float16", narrow), ("float16 -> float32", widen),
                     ("float16 add into float32", add)):
        convert.use_accelerator(True)
        fast = best_of(args.repeat, fn)
        convert.use_accelerator(False)
        slow = best_of(args.repeat, fn)
        convert.use_accelerator(True)
        print(f"  {name:<26} C {fast * 1e3:6.1f} ms   NumPy {slow * 1e3:6.1f} ms   "
              f"{slow / fast:4.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
