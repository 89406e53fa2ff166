"""DDP with no comm hook over init_process_group("reducer"), against one process.

Two torchrun-style workers each train DDP(MLP) with plain SGD on their own
half of every batch; DDP, with no hook, averages the gradient buckets with
the group's all_reduce, so they go through the daemons. One process then
trains the same model in float64 on the full batches (both halves): the
full batch's mean loss is the mean of the halves' mean losses, so its
gradient is the average DDP computes. The parameters must agree within
test_torch_ddp.tolerance: the float16 / bfloat16 rounding of every rank's
contribution and of the mean, STEPS times, from the largest gradient any
rank had (1e-5 for the float32 wire, which only reorders the sum). The
8-bit wires take the same form with their rounding (test_quant_wire's
bound): for int8 half a step of a 128-block, at most G / 254 for every
rank's pre-divided contribution together and again for the mean; for FP8
the relative u of the format on each and half its smallest subnormal a
per rounding (world + 1 of them). The two workers share a host, so the
node's sum is what is rounded (node-local aggregation): no error feedback.
"""

from __future__ import annotations

import copy
import datetime

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from backend_workers import init_worker, torchrun_env  # noqa: E402
from support import run_workers  # noqa: E402
from test_quant_wire import FP8  # noqa: E402
from test_torch_ddp import LR, STEPS, tolerance  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

pytestmark = pytest.mark.timeout(240)

WIRES = ("float16", "bfloat16", "float32", "int8", "fp8_e4m3")


def wire_tolerance(wire: str, max_grad: float, world: int) -> float:
    """test_torch_ddp.tolerance, with the 8-bit wires' rounding (module doc)."""
    if wire == "int8":
        per_step = 2 * max_grad / 254 * (1 + 2.0 ** -14)
    elif wire in FP8:
        u, a, _ = FP8[wire]
        per_step = 2 * u * max_grad + (world + 1) * a / 2
    else:
        return tolerance(wire, max_grad)
    return 2 * STEPS * LR * per_step


def ddp_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    init_worker(rank, world, env)
    from reducer_client.torch.backend import ReducerOptions, ReducerProcessGroup
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=60))
    out: dict = {}
    try:
        base = make_model("mlp")
        for wire in WIRES:
            group = dist.new_group(backend="reducer", pg_options=ReducerOptions(wire))
            calls = []
            original = ReducerProcessGroup.allreduce

            def counting(self, tensors, opts=None, _original=original, _calls=calls):
                _calls.append(sum(t.numel() for t in tensors))
                return _original(self, tensors, opts)
            group.allreduce = counting.__get__(group)  # count DDP's buckets on this group
            model = DDP(copy.deepcopy(base), process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            max_grad = 0.0
            for step in range(STEPS):
                x, y = batch("mlp", step, rank)
                opt.zero_grad()
                loss_of("mlp", model(x), y).backward()
                local = torch.autograd.grad(loss_of("mlp", model.module(x), y),
                                            list(model.module.parameters()))
                max_grad = max(max_grad, *(g.abs().max().item() for g in local))
                opt.step()
            out[wire] = {"params": [p.detach().numpy().copy() for p in model.parameters()],
                         "max_grad": max_grad, "allreduced": calls}
    finally:
        dist.destroy_process_group()
    return out


def full_batch_reference(world: int) -> list[np.ndarray]:
    """One process, float64, on every rank's half of each batch."""
    model = make_model("mlp").double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        halves = [batch("mlp", step, r) for r in range(world)]
        x = torch.cat([h[0] for h in halves]).double()
        y = torch.cat([h[1] for h in halves])
        y = y.double() if y.is_floating_point() else y
        opt.zero_grad()
        loss_of("mlp", model(x), y).backward()
        opt.step()
    return [p.detach().numpy() for p in model.parameters()]


def test_ddp_without_a_hook_matches_one_process_on_the_full_batch(daemons):
    world = 2
    with daemons(2, round_timeout=60) as d:
        results = run_workers(ddp_worker, world, (torchrun_env(d.addresses),), timeout=200)
    reference = full_batch_reference(world)
    numel = sum(p.size for p in reference)
    max_grad = max(r[w]["max_grad"] for r in results for w in WIRES)
    for wire in WIRES:
        for r in results:  # every rank ends with the same parameters
            for a, b in zip(r[wire]["params"], results[0][wire]["params"], strict=True):
                np.testing.assert_array_equal(a, b)
        # Every step's gradients went through the group's all_reduce: STEPS times all of them.
        assert sum(results[0][wire]["allreduced"]) == STEPS * numel, wire
        diff = max(float(np.abs(a - b).max())
                   for a, b in zip(results[0][wire]["params"], reference, strict=True))
        tol = wire_tolerance(wire, max_grad, world)
        print(f"{wire}: max |param - full-batch float64| = {diff:.2e} (tolerance {tol:.2e})")
        assert diff <= tol, (wire, diff, tol)
    # The lossy wires really were used: their parameters differ from float32's.
    for wire in ("float16", "bfloat16", "int8", "fp8_e4m3"):
        assert any(not np.array_equal(a, b) for a, b in
                   zip(results[0][wire]["params"], results[0]["float32"]["params"], strict=True))
