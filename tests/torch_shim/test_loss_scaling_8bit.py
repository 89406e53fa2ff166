"""torch.amp.GradScaler over the 8-bit wires: an overflow reaches every rank's scaler.

A value beyond a wire's finite range arrives non-finite on every rank (FP8:
E4M3 above 464, E5M2 from 61440; int8 has float32's range), so each rank's
GradScaler skips that step and halves its scale, together. Real daemons on
127.0.0.1, two spawned workers, GradScaler's defaults (init_scale 2^16,
growth_interval 2000), SGD, for both paths: DDP with the comm hook and the
DistributedOptimizer (Horovod's loss-scaling idiom: synchronize, unscale_,
step under skip_synchronize), on int8, fp8_e4m3 and fp8_e5m2, error
feedback on (the default).

The model is a Linear layer whose loss is linear in its output, so its
gradients are the batch's data and their magnitudes are designed: the
largest is G = 0.0403 at scale 1 on both ranks, i.e. 2641 at 2^16, which
E4M3 cannot carry (nor 1320 at 2^15, 660 at 2^14), while 330 at 2^13 it
can; E5M2 and int8 carry them all. Every value keeps a margin of 29 % or
more from E4M3's 464. Scenarios: none injected; Inf, NaN, or a finite
scaled gradient of 1e5 (beyond both FP8 formats, within int8) on rank 1 at
step INJECT.

The reference is the same training over Gloo float32 (an explicit
all_reduce and division by 2), where a step overflows when a gradient is
non-finite, or when some rank's scaled gradient, or the mean, reaches the
wire's overflow threshold (quant.fp8_overflow): the wire's range, stated
as the contract has it. Plain Gloo would never skip for 1e5 or for 2641:
float32 holds them. Checked: the scale's history is the same on both ranks
and equal to the reference's; the parameters are within the derived bound
of the reference's (bound_per_step).
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import ReducerClient  # noqa: E402
from reducer_wire import quant  # noqa: E402
from support import run_workers  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WIRES = ("int8", "fp8_e4m3", "fp8_e5m2")
SCENARIOS = ("none", "inf", "nan", "large")
STEPS = 10
INJECT = 6  # the step whose gradient rank 1 poisons
LARGE = 1e5  # the injected finite scaled gradient
LR = 0.5
G = 0.0403  # the largest |gradient| at scale 1 (see the module docstring)
C = torch.tensor([1.0, -0.5, 0.25, -0.75])  # the loss's weights per output
IN, OUT = 16, 4
WORLD = 2
# Per wire: e_in(v) <= RHO * (largest |v|) + ALPHA (quant.ERROR_BOUND_DOC; for
# int8 the block's largest, at most the largest), and the overflow threshold.
RHO = {"int8": (1 + 2.0 ** -14) / 254, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}
ALPHA = {"int8": 2.0 ** -142, "fp8_e4m3": 2.0 ** -10, "fp8_e5m2": 2.0 ** -17}
OVERFLOW = {"int8": math.inf, "fp8_e4m3": quant.fp8_overflow(quant.E4M3),
            "fp8_e5m2": quant.fp8_overflow(quant.E5M2)}


def make_model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Linear(IN, OUT)


def batch(step: int, rank: int, scenario: str, scale: float) -> torch.Tensor:
    """One input row; the gradient of weight[j, i] is G * C[j] * x[i], of bias[j] G * C[j]."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.rand(1, IN, generator=gen) * 2 - 1
    x[0, 0] = 1.0  # the largest gradient, G, on both ranks
    if rank == 1 and step == INJECT and scenario != "none":
        x[0, 1] = {"inf": math.inf, "nan": math.nan, "large": LARGE / (G * scale)}[scenario]
    return x


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return G * (model(x) * C).sum()


def scaled_extremes(step: int, scenario: str, scale: float,
                    wire: str) -> list[tuple[float, bool]]:
    """Per rank at this step (known: the data): the largest |scaled gradient|
    the wire carries, and whether some gradient is beyond its range."""
    out = []
    for rank in range(WORLD):
        natural = scale * G * batch(step, rank, "none", scale).abs().max().item()
        injected = (batch(step, rank, scenario, scale)[0, 1].item() * scale * G
                    if rank == 1 and step == INJECT and scenario != "none" else 0.0)
        carried = abs(injected) < OVERFLOW[wire]  # False for NaN
        out.append((max(natural, abs(injected)) if carried else natural,
                    natural >= OVERFLOW[wire] or not carried))
    return out


def bound_per_step(wire: str, history: list[float], scenario: str) -> float:
    """What the wire may move the parameters from the reference's, at most, per element.

    Worker r sends v = g + r_prev (scaled gradients: the residue is kept as
    sent, at the scale of its step, and added as it is) and keeps
    r = v - Q(v), |r| <= RHO |v|max + ALPHA, or 0 where v is non-finite.
    The daemon's mean of the Q(v) differs from the mean of the g by at most
    the mean of |r_prev| + |r|, plus its float32 sum (2^-24 relative, twice:
    sum and division) and its own rounding e_out. A skipped step's residue
    enters the next step too. Each applied step moves the parameters by LR
    times that difference over the step's scale: the bound adds those over
    the applied steps, plus the float32 rounding of each update on either
    side (2^-24 |p|, |p| < 2).
    """
    rho, alpha = RHO[wire], ALPHA[wire]
    total, prev_residue = 0.0, [0.0] * WORLD  # bounds of |r|, as sent
    scale = 2.0 ** 16
    for step in range(STEPS):
        grads = [largest for largest, _ in scaled_extremes(step, scenario, scale, wire)]
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


def reference_run(rank: int, wire: str, scenario: str) -> tuple[list[float], np.ndarray]:
    """Gloo float32, the wire's range applied; returns the scales and the parameters."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    history = []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(model, batch(step, rank, scenario, scaler.get_scale()))).backward()
        grads = [p.grad for p in model.parameters()]
        largest = torch.tensor(max(g.abs().max().item() for g in grads))
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # NaN propagates: non-finite too
        for g in grads:
            dist.all_reduce(g)
            g /= WORLD
        beyond = max(g.abs().max().item() for g in grads)
        if not (largest.item() < OVERFLOW[wire] and beyond < OVERFLOW[wire]):
            grads[0].view(-1)[0] = math.inf  # what the wire's contract makes of it
        scaler.step(opt)
        scaler.update()
        history.append(scaler.get_scale())
    return history, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def wire_run(rank: int, addresses: list[str], job: str, wire: str, scenario: str,
             path: str) -> tuple[list[float], np.ndarray]:
    with ReducerClient(addresses, job=f"{job}-{wire}-{scenario}-{path}", rank=rank,
                       world_size=WORLD, wire_dtype=wire, timeout=60) as client:
        model = make_model()
        scaler = torch.amp.GradScaler("cpu")
        if path == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model)
            net.register_comm_hook(state=client, hook=rt.allreduce_hook)
            opt = torch.optim.SGD(net.parameters(), lr=LR)
        else:
            net = model
            opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                          named_parameters=model.named_parameters(),
                                          reducer=client)
        history = []
        for step in range(STEPS):
            opt.zero_grad()
            x = batch(step, rank, scenario, scaler.get_scale())
            scaler.scale(loss_of(net, x)).backward()
            if path == "ddp":
                scaler.step(opt)
            else:  # Horovod's idiom: the averaged gradients before unscale_
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
            scaler.update()
            history.append(scaler.get_scale())
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return history, params


def worker(rank: int, world: int, addresses: list[str], init_file: str, job: str) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    out = {}
    try:
        for wire in WIRES:
            for scenario in SCENARIOS:
                out[(wire, scenario, "gloo")] = reference_run(rank, wire, scenario)
                for path in ("ddp", "optimizer"):
                    out[(wire, scenario, path)] = wire_run(rank, addresses, job, wire,
                                                           scenario, path)
    finally:
        dist.destroy_process_group()
    return out


# What each wire's scaler must do, derived from the data: E4M3 overflows at
# 2^16, 2^15 and 2^14 (2641, 1320, 660 > 464), not at 2^13 (330); the
# injection always overflows but for int8's 1e5, which it carries.
def expected_history(wire: str, scenario: str) -> list[float]:
    scale, out = 2.0 ** 16, []
    for step in range(STEPS):
        overflow = any(beyond for _, beyond in scaled_extremes(step, scenario, scale, wire))
        scale = scale / 2 if overflow else scale
        out.append(scale)
    return out


def test_every_rank_skips_together_as_the_wire_range_says(daemons, tmp_path):
    with daemons(2, round_timeout=60) as d:
        results = run_workers(worker, WORLD, (d.addresses, str(tmp_path / "pg"),
                                               uuid.uuid4().hex), timeout=280)
    for wire in WIRES:
        for scenario in SCENARIOS:
            reference = results[0][(wire, scenario, "gloo")]
            assert results[1][(wire, scenario, "gloo")][0] == reference[0]
            history = reference[0]
            assert history == expected_history(wire, scenario), (wire, scenario, history)
            bound = bound_per_step(wire, history, scenario)
            for path in ("ddp", "optimizer"):
                got = [results[rank][(wire, scenario, path)] for rank in range(WORLD)]
                assert got[0][0] == got[1][0] == history, (wire, scenario, path, got[0][0])
                assert np.array_equal(got[0][1], got[1][1])  # the same model on both ranks
                error = np.abs(got[0][1].astype(np.float64) - reference[1]).max()
                assert np.isfinite(got[0][1]).all()
                print(f"{wire} {scenario} {path}: history {history}, "
                      f"error {error:.3g} <= bound {bound:.3g}")
                assert error <= bound, (wire, scenario, path, error, bound)
    # The cases the contract is about, spelled out: E4M3 halves three times
    # from the default scale, and 1e5 on one rank skips the step on FP8 only.
    e4m3 = expected_history("fp8_e4m3", "none")
    assert e4m3[:4] == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13, 2.0 ** 13]
    assert expected_history("fp8_e5m2", "large")[INJECT] == 2.0 ** 15
    assert expected_history("int8", "large")[INJECT] == 2.0 ** 16
