"""The DistributedOptimizer's presence flags stay out of int8's blocks.

A bucket carries one presence flag (0 or 1) per parameter after its
gradients. int8 scales each block of 128 elements by its largest value, so a
flag sharing a block with the bucket's last gradients set their scale to
1/127: gradients 1000 times smaller than 1 then rounded to zero (or to
+-1/127). The flags now start a block of their own; the last parameter's
averaged gradient is within int8's own bound of its float64 mean.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402

pytestmark = pytest.mark.timeout(60)

WORLD = 2
# Sizes whose last block is partial, so that before the fix it took flags too.
SIZES = (300, 70)


def _gradient(rank: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1e-3, 1e-3, size) * (rank + 1)


def _one_step(rank: int, reducer) -> list[np.ndarray]:
    rt.set_error_feedback(False, reducer)  # the first step's rounding alone
    params = [torch.nn.Parameter(torch.zeros(size)) for size in SIZES]
    opt = rt.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), reducer=reducer,
                                  named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
    for index, param in enumerate(params):
        param.grad = torch.from_numpy(_gradient(rank, param.numel(), index).astype(np.float32))
    opt.step()  # starts the bucket with the gradients as they are, then p -= grad
    return [-param.detach().double().numpy() for param in params]


def test_small_gradients_at_a_buckets_end_keep_int8s_precision():
    group = LocalGroup(WORLD, wire_dtype="int8", timeout=30)
    with ThreadPoolExecutor(WORLD) as pool:
        results = [f.result(30) for f in [pool.submit(_one_step, r, group.client(r))
                                          for r in range(WORLD)]]
    for index, size in enumerate(SIZES):
        grads = [_gradient(r, size, index) for r in range(WORLD)]
        mean = np.mean(grads, axis=0)
        # quant.ERROR_BOUND_DOC's MEAN bound, with each block's largest value
        # taken as the tensor's (every block here is at most that).
        e_in = sum(np.max(np.abs(g)) for g in grads) / WORLD / 254 * (1 + 2.0 ** -14)
        e_out = (np.max(np.abs(mean)) + e_in) / 254 * (1 + 2.0 ** -14)
        bound = e_in + e_out + 2.0 ** -22 * (np.max(np.abs(mean)) + e_in)
        for rank in range(WORLD):
            error = float(np.max(np.abs(results[rank][index] - mean)))
            assert error <= bound, (f"parameter {index} ({size} elements) on rank {rank}: "
                                    f"error {error:.3g} against int8's bound {bound:.3g}")
