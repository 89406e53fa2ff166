"""The wire conversions, C (reducer_wire._kernels) against NumPy and the bare instruction, same run.

    python scripts/wire_speed.py [--mib 64] [--repeat 5]

Times, per 1 MiB chunk as the client and daemon use them, float32 -> float16
of a --mib MiB float32 gradient (into one reused message buffer, as the send
path does with to_wire(out=), and into a new array per chunk), float16 ->
float32 of the result, and the daemon's float16 widen-and-add into a float32
accumulator. Each runs with every instruction set the CPU has (AVX-512,
F16C) and with NumPy; the narrowing is also compared with a bare vcvtps2ph
loop of the same width (no NaN handling, so not a wire conversion): the ratio
"ours / bare" is what the NaN handling costs. Then the replies widened into
the whole output with plain and with streaming stores (float16, bfloat16,
int8, FP8), as an operation with a large output widens them, and the 8-bit
encodings of the gradient into a message. Prints the best of --repeat.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.dtypes import wire_nbytes

from reducerd.bench.host import cpu_model
from reducerd.core import accumulate

F16 = pb.DTYPE_FLOAT16
CHUNK = 1 << 19  # float16 elements in a 1 MiB chunk


def best_of(repeat: int, fn: Callable[[], None]) -> float:
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
    kernels = convert.kernels()
    if kernels is None:
        print("reducer_wire._kernels is not built (no C compiler?)", file=sys.stderr)
        return 1
    x = np.random.default_rng(0).standard_normal(args.mib << 18).astype(np.float32)
    out = np.empty_like(x)
    acc = np.zeros(CHUNK, dtype=np.float32)
    message = np.empty(CHUNK * 2, dtype=np.uint8)  # one chunk's payload, reused
    starts = range(0, x.size, CHUNK)
    encoded = [convert.to_wire(x[i:i + CHUNK], F16).tobytes() for i in starts]

    def narrow_into_message() -> None:
        for i in starts:
            convert.to_wire(x[i:i + CHUNK], F16, out=message[:2 * x[i:i + CHUNK].size])

    def narrow_new_array() -> None:
        for i in starts:
            convert.to_wire(x[i:i + CHUNK], F16)

    def bare() -> None:
        for i in starts:
            chunk = x[i:i + CHUNK]
            kernels.f32_to_f16_bare(chunk, message[:2 * chunk.size])

    def widen() -> None:
        for i, data in zip(starts, encoded, strict=True):
            convert.from_wire(data, F16, out[i:i + CHUNK])

    def add() -> None:
        scratch = np.empty(CHUNK, dtype=np.float32)
        for data in encoded:
            accumulate.add_wire_into(acc[:len(data) // 2], data, F16, scratch)

    isas = []
    for name in ("avx512", "f16c"):
        if kernels.set_isa(name) == name:
            isas.append(name)
    kernels.set_isa("best")
    print(f"{cpu_model()}; {args.mib} MiB float32 gradient, 1 MiB float16 chunks, "
          f"best of {args.repeat} (ms):")
    print(f"  {'':<34}" + "".join(f"{'C ' + name:>12}" for name in isas) + f"{'NumPy':>12}")
    for label, fn in (("float32 -> float16 into a message", narrow_into_message),
                      ("float32 -> float16, new array", narrow_new_array),
                      ("float16 -> float32", widen),
                      ("float16 add into float32", add)):
        row = []
        convert.use_accelerator(True)
        for name in isas:
            kernels.set_isa(name)
            row.append(best_of(args.repeat, fn))
        kernels.set_isa("best")
        convert.use_accelerator(False)
        row.append(best_of(args.repeat, fn))
        convert.use_accelerator(True)
        print(f"  {label:<34}" + "".join(f"{t * 1e3:12.2f}" for t in row))
    # Replies widened into the whole output, plain against streaming stores
    # (convert.from_wire(stream=True), what an Operation with a large output uses).
    bf16, int8 = pb.DTYPE_BFLOAT16, pb.DTYPE_INT8_BLOCK128
    e4m3, e5m2 = pb.DTYPE_FP8_E4M3, pb.DTYPE_FP8_E5M2
    widened = (("float16", F16), ("bfloat16", bf16), ("int8 (blocks of 128)", int8),
               ("fp8_e4m3", e4m3), ("fp8_e5m2", e5m2))
    replies = {dtype: [convert.to_wire(x[i:i + CHUNK], dtype).tobytes() for i in starts]
               for _, dtype in widened}

    def widen_replies(dtype: int, stream: bool) -> Callable[[], None]:
        def run() -> None:
            for i, data in zip(starts, replies[dtype], strict=True):
                convert.from_wire(data, dtype, out[i:i + CHUNK], stream=stream)
        return run

    print(f"  replies widened into the {args.mib} MiB output (C, best instruction set):"
          f"{'plain':>10}{'streaming':>11}")
    for label, dtype in widened:
        plain, streamed = (best_of(args.repeat, widen_replies(dtype, s)) for s in (False, True))
        print(f"  {label:<34}{'':>24}{plain * 1e3:10.2f}{streamed * 1e3:11.2f}")

    def encode_chunks(dtype: int) -> Callable[[], None]:
        def run() -> None:
            for i in starts:
                part = x[i:i + CHUNK]
                convert.to_wire(part, dtype, out=message[:wire_nbytes(dtype, part.size)])
        return run

    print("  8-bit encodings into a message (C, best instruction set):")
    for label, dtype in widened[2:]:
        print(f"  {label:<34}{'':>24}{best_of(args.repeat, encode_chunks(dtype)) * 1e3:10.2f}")
    if isas:
        # Alternating runs of the two, so that drift on a busy machine hits both alike.
        bares, ours = [], []
        for name in isas:
            kernels.set_isa(name)
            pairs = [(best_of(1, bare), best_of(1, narrow_into_message))
                     for _ in range(args.repeat)]
            bares.append(min(b for b, _ in pairs))
            ours.append(min(o for _, o in pairs))
        kernels.set_isa("best")
        print(f"  {'ours (alternating with bare)':<34}"
              + "".join(f"{t * 1e3:12.2f}" for t in ours))
        print(f"  {'bare vcvtps2ph loop':<34}" + "".join(f"{t * 1e3:12.2f}" for t in bares))
        print(f"  {'ours / bare (narrowing)':<34}"
              + "".join(f"{o / b:12.2f}" for o, b in zip(ours, bares, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
