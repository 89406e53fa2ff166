"""The loss-scaling case over the 8-bit wires, shared by the torch and TF tests.

A value beyond a wire's finite range arrives non-finite on every rank (FP8:
E4M3 above 464, E5M2 from 61440; int8 has float32's range), so every rank's
loss scaler skips that step and halves its scale, together.

The model is one linear layer whose loss, G * sum_j C[j] * y[j], is linear
in its output, so its gradients are the data: weight[j, i] gets G C[j] x[i],
bias[j] G C[j], times the loss scale. x[0] = 1 on every rank, so the largest
|gradient| is G = 0.0403 at scale 1: 2641 at 2^16, 1320 at 2^15, 660 at
2^14, which E4M3 cannot carry, and 330 at 2^13, which it can (29 % or more
from 464 either way, more than any residue error feedback adds); E5M2 and
int8 carry them all. Scenarios: nothing injected; Inf, NaN, or a large
finite scaled gradient (beyond both FP8 formats, within int8: the caller
picks it, within its gradients' dtype) on rank 1 at step INJECT, in x[1].

The reference is the same training in float32 (Gloo, or one process),
where a step overflows when a gradient is non-finite or some rank's scaled
gradient reaches the wire's overflow threshold (quant.fp8_overflow): the
wire's range as the contract states it (plain float32 would carry 1e5 and
2641). expected_history says what the scaler must then do, from the data;
bound() how far the parameters may drift from the reference's.
"""

from __future__ import annotations

import math

import numpy as np
from reducer_wire import quant

WIRES = ("int8", "fp8_e4m3", "fp8_e5m2")
SCENARIOS = ("none", "inf", "nan", "large")
STEPS = 10
INJECT = 6  # the step whose gradient rank 1 poisons
LR = 0.5
G = 0.0403  # the largest |gradient| at scale 1
C = np.array([1.0, -0.5, 0.25, -0.75], np.float32)  # the loss's weights per output
IN, OUT = 16, 4
WORLD = 2
# Per wire: e_in(v) <= RHO * (largest |v|) + ALPHA (quant.ERROR_BOUND_DOC; for
# int8 the block's largest, at most the largest), and the overflow threshold.
RHO = {"int8": (1 + 2.0 ** -14) / 254, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}
ALPHA = {"int8": 2.0 ** -142, "fp8_e4m3": 2.0 ** -10, "fp8_e5m2": 2.0 ** -17}
OVERFLOW = {"int8": math.inf, "fp8_e4m3": quant.fp8_overflow(quant.E4M3),
            "fp8_e5m2": quant.fp8_overflow(quant.E5M2)}


def batch(step: int, rank: int, scenario: str, scale: float, large: float) -> np.ndarray:
    """One input row (float32, shape (1, IN)) of this rank's step."""
    x = np.random.default_rng([step, rank]).uniform(-1.0, 1.0, (1, IN)).astype(np.float32)
    x[0, 0] = 1.0  # the largest gradient, G, on both ranks
    if rank == 1 and step == INJECT and scenario != "none":
        x[0, 1] = {"inf": math.inf, "nan": math.nan, "large": large / (G * scale)}[scenario]
    return x


def scaled_extremes(step: int, scenario: str, scale: float, wire: str,
                    large: float) -> list[tuple[float, bool]]:
    """Per rank at this step: the largest |scaled gradient| the wire carries,
    and whether some gradient is beyond its range."""
    out = []
    for rank in range(WORLD):
        natural = scale * G * float(np.abs(batch(step, rank, "none", scale, large)).max())
        injected = (float(batch(step, rank, scenario, scale, large)[0, 1]) * scale * G
                    if rank == 1 and step == INJECT and scenario != "none" else 0.0)
        carried = abs(injected) < OVERFLOW[wire]  # False for NaN
        out.append((max(natural, abs(injected)) if carried else natural,
                    natural >= OVERFLOW[wire] or not carried))
    return out


def expected_history(wire: str, scenario: str, initial_scale: float,
                     large: float) -> list[float]:
    """The scale after each step: halved where the wire overflows (the
    growth interval, 2000 steps by default, is never reached)."""
    scale, out = initial_scale, []
    for step in range(STEPS):
        if any(beyond for _, beyond in scaled_extremes(step, scenario, scale, wire, large)):
            scale /= 2
        out.append(scale)
    return out


def bound(wire: str, history: list[float], scenario: str, initial_scale: float,
          large: float) -> float:
    """How far the wire may move a parameter from the reference's, at most.

    Worker r sends v = g + r_prev (scaled gradients: a residue is kept as
    sent, at the scale of its step, and added as it is) and keeps
    r = v - Q(v), |r| <= RHO |v|max + ALPHA, or 0 where v is not carried.
    The daemon's mean of the Q(v) differs from the mean of the g by at most
    the mean of |r_prev| + |r|, plus its float32 sum and division (2^-24
    relative each) and its own rounding e_out. A skipped step's residue
    enters the next step too. Each applied step moves the parameters by LR
    times that difference over the step's scale: the bound adds those over
    the applied steps, plus the float32 rounding of each update on either
    side (2^-24 |p|, |p| < 2).
    """
    rho, alpha = RHO[wire], ALPHA[wire]
    total, prev_residue = 0.0, [0.0] * WORLD  # bounds of |r|, as sent
    scale = initial_scale
    for step in range(STEPS):
        grads = [top for top, _ in scaled_extremes(step, scenario, scale, wire, large)]
        sent = [g + p for g, p in zip(grads, prev_residue, strict=True)]
        residue = [rho * v + alpha for v in sent]  # of the carried elements; others 0
        if history[step] >= scale:  # the scale was kept (no overflow): applied
            mean_error = sum(p + r for p, r in zip(prev_residue, residue, strict=True)) / WORLD
            y = max(sent) * (1 + rho) + alpha  # the mean of the Q(v), at most
            e_out = rho * y + alpha + 2 * 2.0 ** -24 * y
            total += LR * (mean_error + e_out) / scale + 2 * 2.0 ** -23
        prev_residue = residue
        scale = history[step]
    return total


def overflows(wire: str, per_rank_grads: list[list[np.ndarray]]) -> bool:
    """The reference's test: some rank's gradient non-finite or beyond the wire's range."""
    for grads in per_rank_grads:
        for g in grads:
            largest = float(np.abs(g).max())
            if not largest < OVERFLOW[wire]:  # NaN too
                return True
    return False
