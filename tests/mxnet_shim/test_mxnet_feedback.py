"""Error feedback in the "reducer" KVStore on the int8 wire: real daemons, 2 workers.

Scenario: every step each worker pushpulls three keys (one alone, two
packed into one transfer) whose int8 blocks hold one outlier and 127 small
values in [0.5e-3, 1.5e-3]: below half a quantization step of the worker's
block (A / 254 with A = 1), so without feedback they round to zero on every
step. The outliers are +1 on rank 0 and -1 on rank 1 at the same place, so
the daemons' result block is small and its one rounding per step (not fed
back: no worker knows it) costs little. One client has feedback on (the
default for int8), the other off (Reducer(error_feedback=False)).

Bound, per element, for the sum over S steps of the results against the
float64 sum of the true gradients (reducer_wire.quant.ERROR_BOUND_DOC):
each worker's sent values telescope to its true ones minus its last residue
(at most e_in = A / 254 (1 + 2^-14), A <= 1 + e_in), and each step's result
is rounded once more (e_out = A_out / 254, with A_out at most the outliers'
residues 2 e_in plus the small values 2 (1.5e-3 + e_in)):
    2 e_in + S e_out (+ float32 ulps).
Without feedback the error is the small values' sum, about S x 2e-3.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

import reducer_client.mxnet as rmx  # noqa: E402
from reducer_client import ReducerClient  # noqa: E402
from support import run_workers  # noqa: E402

WORKER_ENV = {"MXNET_CPU_WORKER_NTHREADS": "1", "OMP_NUM_THREADS": "1"}
SIZES = (4096, 512, 512)  # elements per key; the two small ones share a transfer
FUSION_BYTES = 8 << 10
BLOCK, STEPS, SMALL_MAX = 128, 40, 1.5e-3


def _gradient(rank: int, step: int, key: int) -> np.ndarray:
    rng = np.random.default_rng(10_000 * rank + 100 * step + key)
    values = rng.uniform(0.5e-3, SMALL_MAX, SIZES[key]).astype(np.float32)
    values[::BLOCK] = 1.0 if rank == 0 else -1.0
    return values


def kv_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    sums = {}
    for mode in ("on", "off"):
        with ReducerClient(addresses, job=f"{job}-{mode}", rank=rank, world_size=world_size,
                           wire_dtype="int8", timeout=60.0) as client:
            kv = rmx.Reducer(fusion_bytes=FUSION_BYTES, backend=client,
                             error_feedback=None if mode == "on" else False)
            totals = [np.zeros(n) for n in SIZES]
            for step in range(STEPS):
                arrays = [mx.nd.array(_gradient(rank, step, k)) for k in range(len(SIZES))]
                kv.pushpull(list(range(len(SIZES))), arrays)
                for total, array in zip(totals, arrays, strict=True):
                    total += array.asnumpy()
            sums[mode] = totals
    return sums


def test_kvstore_feedback_carries_the_residue(daemons):
    world = 2
    with daemons(2, round_timeout=30) as d:
        results = run_workers(kv_worker, world, (d.addresses, uuid.uuid4().hex),
                              timeout=240, env=WORKER_ENV)
    e_in = (1 + 1 / 254) / 254 * (1 + 2.0 ** -14)
    e_out = (2 * e_in + 2 * (SMALL_MAX + e_in)) / 254
    bound = 2 * e_in + STEPS * e_out + STEPS * 2.0 ** -22
    for key in range(len(SIZES)):
        truth = sum(_gradient(r, s, key).astype(np.float64) for r in range(world)
                    for s in range(STEPS))
        for rank, sums in enumerate(results):
            on_error = np.abs(sums["on"][key] - truth).max()
            off_error = np.abs(sums["off"][key] - truth).max()
            assert on_error <= bound, (key, rank, on_error, bound)
            assert off_error > 3 * bound, (key, rank, off_error, bound)
