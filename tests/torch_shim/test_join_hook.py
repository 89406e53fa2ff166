"""join() with the DDP comm hook: uneven inputs, real workers on real daemons.

Scenario: 2 and 4 ranks hold different numbers of batches (each at least 2:
DDP rebuilds its buckets in the second forward, with a process-group
broadcast that a joined rank would not follow). Each trains a
DistributedDataParallel model whose gradients go through
rt.allreduce_hook (several buckets), with a plain torch SGD with momentum,
inside rt.Join() until it runs out of batches, then joins on leaving
it. The joined ranks send
zeros for every bucket, so at each step the gradient must be the mean over
the ranks still in (not over the world size), and after join every rank
must hold the model of one float64 process that trained, at each step, on
the union of the active ranks' batches; join() returns the last rank.
"""

from __future__ import annotations

import copy
import uuid

import numpy as np
import pytest
from support import run_workers

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

LR, MOMENTUM, BATCH = 0.1, 0.9, 5
# Several DDP buckets after the rebuild (one per parameter or so), so the
# joined ranks follow several keys per step.
BUCKET_CAP_MB = 0.00001  # 10 bytes: 1 bucket in the first step, 3 after the rebuild
EPS32 = float(np.finfo(np.float32).eps)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)


def hook_worker(rank: int, world_size: int, addresses: list[str], init_file: str,
                job: str, steps_of: list[int], inside_join: bool = True) -> dict:
    import reducer_client.torch as rt
    from reducer_client import collectives as coll
    from torch.nn.parallel import DistributedDataParallel as DDP

    control_rounds = []  # the hook's, counted: only inside rt.Join() are there any
    real_control = coll.control_async

    def counting_control(reducer, call):
        if call.kind == coll.STEP:
            control_rounds.append(call)
        return real_control(reducer, call)
    coll.control_async = counting_control

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    rt.init(addresses=addresses, job=job, rank=rank, world_size=world_size,
            wire_dtype="float32", timeout=30.0)
    buckets: set[int] = set()
    try:
        model = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)

        def counting_hook(state, bucket):
            buckets.add(bucket.index())
            return rt.allreduce_hook(state, bucket)
        model.register_comm_hook(state=None, hook=counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        with rt.Join(enable=inside_join) as joined:
            for step in range(steps_of[rank]):
                opt.zero_grad()
                x, y = _batch(rank, step)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        last = joined.last
        params = [p.detach().numpy().copy() for p in model.module.parameters()]
    finally:
        rt.shutdown()
        dist.destroy_process_group()
    return {"last": last, "params": params, "buckets": len(buckets),
            "control_rounds": len(control_rounds)}


def _reference(steps_of: list[int], divide_by_world: bool) -> tuple[list[np.ndarray], float]:
    """float64 parameters of one process on the union, and the largest gradient seen.

    divide_by_world: the wrong average (joined ranks' zeros counted), which
    the test shows its bound can tell apart.
    """
    model = copy.deepcopy(_model()).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    max_grad = 0.0
    for step in range(max(steps_of)):
        active = [r for r in range(len(steps_of)) if step < steps_of[r]]
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(x.double()), y.double())
                  for x, y in (_batch(r, step) for r in active)]
        divisor = len(steps_of) if divide_by_world else len(active)
        (sum(losses) / divisor).backward()
        max_grad = max(max_grad, *(p.grad.abs().max().item() for p in model.parameters()))
        opt.step()
    return [p.detach().numpy() for p in model.parameters()], max_grad


@pytest.mark.parametrize("steps_of", [[3, 6], [2, 6, 3, 4]], ids=["2ranks", "4ranks"])
def test_hook_join_matches_one_process_on_the_union(daemons, tmp_path, steps_of):
    world = len(steps_of)
    with daemons(2) as d:
        results = run_workers(hook_worker, world,
                              (d.addresses, str(tmp_path / "pg"), uuid.uuid4().hex, steps_of),
                              timeout=180)
    want, max_grad = _reference(steps_of, divide_by_world=False)
    wrong, _ = _reference(steps_of, divide_by_world=True)
    # Bound: the workers compute in float32. Each gradient element has a
    # relative rounding error of at most ~32 u (u = EPS32 / 2: fan-in 8,
    # a batch of 5, 4 ranks summed in float32 by the daemons, the mean scaled
    # once by world / active), so each step's update errs by at most
    # LR x 32u x max_grad / (1 - MOMENTUM) (the momentum's geometric sum);
    # over S steps, plus the parameters' own rounding, a factor 2 for the
    # propagation of earlier errors through later gradients:
    steps = max(steps_of)
    bound = 2 * (16 * EPS32 * steps * LR * max_grad / (1 - MOMENTUM) + EPS32)
    gap = max(float(np.abs(a - b).max()) for a, b in zip(want, wrong, strict=True))
    assert gap > 100 * bound, (gap, bound)  # the wrong average would fail this test
    last = int(np.argmax(steps_of))
    for rank, out in enumerate(results):
        assert out["last"] == last
        assert out["buckets"] > 1  # several keys were followed
        for got, ref in zip(out["params"], want, strict=True):
            assert float(np.abs(got - ref).max()) <= bound, (rank, np.abs(got - ref).max(),
                                                              bound)
        assert out["control_rounds"] > 0
    for out in results[1:]:  # the joined ranks hold the last joiner's model exactly
        for got, first in zip(out["params"], results[0]["params"], strict=True):
            np.testing.assert_array_equal(got, first)


def test_outside_join_the_hook_sends_no_control_round(daemons, tmp_path):
    """Even inputs, no rt.Join(): the buckets go alone, and the model is the
    one float64 process's on the union within the same bound."""
    steps_of = [3, 3]
    with daemons(2) as d:
        results = run_workers(hook_worker, 2, (d.addresses, str(tmp_path / "pg"),
                                               uuid.uuid4().hex, steps_of, False),
                              timeout=180)
    want, max_grad = _reference(steps_of, divide_by_world=False)
    bound = 2 * (16 * EPS32 * 3 * LR * max_grad / (1 - MOMENTUM) + EPS32)
    for out in results:
        assert out["control_rounds"] == 0 and out["last"] is None
        for got, ref in zip(out["params"], want, strict=True):
            assert float(np.abs(got - ref).max()) <= bound
