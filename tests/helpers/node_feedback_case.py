"""The node-local error-feedback case the core, torch and TF tests share.

One node of `world` workers on the int8 wire, STEPS steps of gradients that
int8 rounds away on every step (small values beside a +-1 outlier in each
128-block): with the residue kept by the node's slice senders, the sum of
what the node sent over all steps stays within one residual of the true sum;
without feedback it drifts far past that.
"""

import numpy as np

NUMEL = 1 << 17  # 2 slices of the node's sum (MIN_SLICE_BYTES of int8 each)
BLOCK = 128
STEPS = 40
EPS24 = 2.0 ** -24


def gradient(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + step)
    values = rng.uniform(0.5e-3, 1.5e-3, NUMEL).astype(np.float32)
    values[::BLOCK] = np.where(rng.random(NUMEL // BLOCK) < 0.5, -1.0, 1.0)
    return values


def check_sums(results: list[dict], world: int) -> None:
    """Each rank's {"on": sum, "off": sum} over the steps against the float64 truth."""
    truth = sum(gradient(r, s).astype(np.float64) for r in range(world)
                for s in range(STEPS))
    amax = 2.0 + 2.0 / 254 * 1.01  # node sum's outlier plus at most one residual
    e_in = amax / 254 * (1 + 2.0 ** -14) + 2.0 ** -142
    bound = e_in + STEPS * 3 * EPS24 * amax
    for rank, sums in enumerate(results):
        on_error = np.abs(sums["on"] - truth).max()
        off_error = np.abs(sums["off"] - truth).max()
        print(f"rank {rank}: error of the sum over {STEPS} steps: feedback on "
              f"{on_error:.3g}, off {off_error:.3g}, bound {bound:.3g}")
        assert on_error <= bound, (rank, on_error, bound)
        assert off_error > 5 * bound, (rank, off_error, bound)  # what feedback carried
        np.testing.assert_array_equal(sums["on"], results[0]["on"])  # one node, one answer
