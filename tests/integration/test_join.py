"""join() with uneven inputs: real workers on real daemons.

Scenario: 3 ranks hold 2, 4 and 3 batches. Each trains with
rt.DistributedOptimizer (SGD with momentum) until it runs out, averaging a
metric with rt.allreduce after every step, then calls rt.join(). The
result must be what one process computes training, at each step, on the
batches of the ranks still in (the mean over the ranks that contributed),
on every rank, and every rank's join() returns the last rank to join.
"""

from __future__ import annotations

import copy
import uuid

import numpy as np
import pytest
from support import run_workers

torch = pytest.importorskip("torch")

STEPS_OF = [2, 4, 3]
LR, MOMENTUM = 0.1, 0.9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)


def uneven_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import reducer_client.torch as rt

    torch.set_num_threads(1)
    rt.init(addresses=addresses, job=job, rank=rank, world_size=world_size,
            wire_dtype="float32", timeout=30.0)
    model = _model()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                  momentum=MOMENTUM),
                                  named_parameters=model.named_parameters())
    losses = []
    for step in range(STEPS_OF[rank]):
        opt.zero_grad()
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(rt.allreduce(loss.detach(), name="loss").item())
    last = rt.join()
    params = [p.detach().numpy().copy() for p in model.parameters()]
    rt.shutdown()
    return {"last": last, "losses": losses, "params": params}


def test_uneven_batches_match_one_process_on_the_union(daemons):
    with daemons(2) as d:
        results = run_workers(uneven_worker, len(STEPS_OF), (d.addresses, uuid.uuid4().hex),
                              timeout=120)
    reference = copy.deepcopy(_model())
    opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(max(STEPS_OF)):
        active = [r for r in range(len(STEPS_OF)) if step < STEPS_OF[r]]
        opt.zero_grad()
        per_rank = []
        # one process on the union: the mean loss over the active ranks' batches
        for r in active:
            x, y = _batch(r, step)
            per_rank.append(torch.nn.functional.mse_loss(reference(x), y))
        (sum(per_rank) / len(per_rank)).backward()
        opt.step()
        losses.append(float(sum(per_rank).detach()) / len(per_rank))
    # The losses the ranks averaged were computed before each step's update: the
    # same as the reference's per_rank (float32 sums in another order: ulps).
    for rank, out in enumerate(results):
        assert out["last"] == 1  # rank 1 has the most batches
        np.testing.assert_allclose(out["losses"], losses[:STEPS_OF[rank]], rtol=1e-5)
        for got, want in zip(out["params"], reference.parameters(), strict=True):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-6)
