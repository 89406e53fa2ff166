"""Error of an 8-worker float16 MEAN through reducerd, next to a float16 ring's.

    python scripts/fp16_error.py [--workers 8] [--numel 1000000]

Starts 2 daemons on 127.0.0.1 and N workers whose gradients are standard
normal float32 values. reducerd rounds each input to float16 once, sums in
float32, divides in float32 and rounds once. A ring (or any float16 reduction)
adds the float16 values one by one in float16 and divides in float16. Both are
compared with the float64 mean of the float32 inputs. Printed: the largest
and the median elementwise relative error |result - reference| / |reference|
over elements with |reference| >= 0.1 (smaller means measure only
cancellation), and the normwise error max|result - reference| / max|reference|.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT / "tests" / "integration")]


def worker(rank: int, world_size: int, addresses: list[str], numel: int) -> bytes | None:
    from core_cases import make_input
    from reducer_client import ReducerClient

    with ReducerClient(addresses, job="fp16-error", rank=rank, world_size=world_size,
                       wire_dtype="float16") as client:
        out = client.allreduce(make_input(99, rank, 0, numel), key="g", op="mean")
    return out.tobytes() if rank == 0 else None


def relative_errors(result: np.ndarray, reference: np.ndarray) -> tuple[float, float, float]:
    error = np.abs(result.astype(np.float64) - reference)
    mask = np.abs(reference) >= 0.1
    rel = error[mask] / np.abs(reference[mask])
    return float(rel.max()), float(np.median(rel)), float(error.max() / np.abs(reference).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--numel", type=int, default=1_000_000)
    args = parser.parse_args()
    from core_cases import make_input
    from support import run_workers

    from reducerd.ops.local import running_daemons

    with running_daemons(2) as daemons:
        results = run_workers(worker, args.workers, (daemons.addresses, args.numel),
                              timeout=300)
    ours = np.frombuffer(results[0], dtype=np.float32)
    inputs = [make_input(99, r, 0, args.numel) for r in range(args.workers)]
    reference = sum(x.astype(np.float64) for x in inputs) / args.workers
    ring = inputs[0].astype(np.float16)
    for x in inputs[1:]:
        ring = ring + x.astype(np.float16)  # float16 + float16 -> float16, as a ring does
    ring = ring / np.float16(args.workers)
    for name, result in (("reducerd (float16 wire, float32 sum)", ours),
                         ("float16 sum one by one (ring)", ring)):
        worst, median, normwise = relative_errors(result, reference)
        print(f"{name:38s} max rel {worst:.3e}  median rel {median:.3e}  "
              f"normwise {normwise:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
