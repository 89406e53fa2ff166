"""Elastic training with real workers on real daemons: adding a worker.

Scenario 1 (a worker added mid-training): ranks 0 and 1 train with
rt.elastic.TorchState under rt.elastic.run, committing every 2 steps; a
third process, started with REDUCER_ELASTIC_JOIN=1, knocks on the daemons.
At a commit rank 0 admits it, every rank's commit raises
HostsUpdatedInterrupt, all reset to 3 ranks (a new incarnation) and the new
rank takes rank 0's parameters, momentum and batch counter by sync(). After
the join all 3 hold the same parameters, and all finish with those of a
fault-free run that trained on 2 ranks up to the join's commit and on 3
after it.

Scenario 2 (a worker added to a job that never commits): the joiner is
never admitted; the running ranks finish as if it were not there, and the
joiner stops with a clear error once its join timeout has passed.
"""

from __future__ import annotations

import copy
import os
import time
import uuid

import numpy as np
import pytest
from support import WorkerFailed, run_workers

torch = pytest.importorskip("torch")

ROUND_TIMEOUT_S = 6  # the daemon's: a knock waits this long, then knocks again
STALLED_AFTER_S = 0.2  # the daemon lists a knock this soon (rank 0 finds it there)
CLIENT_TIMEOUT_S = 20.0  # above the round timeout (lobby.py)
STEPS, COMMIT_EVERY, STEP_S = 40, 2, 0.15
LR, MOMENTUM = 0.1, 0.9
JOINER = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)


def _init(rt, rank: int, addresses: list[str], job: str) -> None:
    if rank == JOINER:  # any rank and size: rank 0 gives the real ones
        os.environ["REDUCER_ELASTIC_JOIN"] = "1"
    rt.init(addresses=addresses, job=job, rank=rank, world_size=rank + 1 if rank == JOINER
            else 2, wire_dtype="float32", timeout=CLIENT_TIMEOUT_S)


def train_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import reducer_client.torch as rt

    torch.set_num_threads(1)
    _init(rt, rank, addresses, job)
    model = _model()
    if rank == JOINER:  # its own start differs: sync must replace all of it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                  momentum=MOMENTUM),
                                  named_parameters=model.named_parameters())
    starts, resets = [], []
    if rank == JOINER:
        time.sleep(1.0)  # join a job already under way

    @rt.elastic.run
    def train(state):
        starts.append({"rank": rt.rank(), "size": rt.size(), "batch": state.batch,
                       "params": [p.detach().numpy().copy() for p in model.parameters()]})
        while state.batch < STEPS:
            time.sleep(STEP_S)  # a step's compute: the joiner arrives mid-training
            opt.zero_grad()
            x, y = _batch(rt.rank(), state.batch)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state.batch += 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
    state = rt.elastic.TorchState(model, opt, batch=0)
    state.register_reset_callbacks([lambda: resets.append((rt.rank(), rt.size()))])
    train(state)
    out = {"params": [p.detach().numpy().copy() for p in model.parameters()],
           "starts": starts, "resets": resets, "size": rt.size()}
    rt.shutdown()
    return out


def _train_reference(join_step: int, dtype: torch.dtype) -> list[np.ndarray]:
    """No join protocol: ranks 0 and 1 before join_step, 0, 1 and 2 from it;
    each step's gradient the mean of the ranks' (as DistributedOptimizer's)."""
    model = copy.deepcopy(_model()).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        ranks = range(2) if step < join_step else range(3)
        opt.zero_grad()
        losses = []
        for r in ranks:
            x, y = _batch(r, step)
            losses.append(torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)))
        (sum(losses) / len(losses)).backward()
        opt.step()
    return [p.detach().double().numpy() for p in model.parameters()]


def test_added_worker_is_synced_and_all_go_on_at_the_larger_size(daemons):
    with daemons(2, "--stalled-after", str(STALLED_AFTER_S),
                 round_timeout=ROUND_TIMEOUT_S) as d:
        results = run_workers(train_worker, 3, (d.addresses, uuid.uuid4().hex), timeout=180)
    joined = results[JOINER]["starts"]
    assert len(joined) == 1 and joined[0]["rank"] == JOINER and joined[0]["size"] == 3
    join_step = joined[0]["batch"]
    assert 0 < join_step < STEPS and join_step % COMMIT_EVERY == 0, join_step
    for rank in (0, 1):
        out = results[rank]
        assert [(s["size"], s["batch"]) for s in out["starts"]] == [(2, 0), (3, join_step)]
        assert out["resets"] == [(rank, 3)]
    # Right after the join every rank holds rank 0's parameters, bit for bit
    # (broadcast is exact for float32).
    after = [results[r]["starts"][-1]["params"] for r in range(3)]
    for params in after[1:]:
        for got, want in zip(params, after[0], strict=True):
            np.testing.assert_array_equal(got, want)
    # The end against a float64 run of the same schedule. The bound: float32
    # training itself drifts from float64 by |ref32 - ref64| on this problem;
    # the distributed run differs from the float32 one only in the order of
    # its sums (mean over <= 3 ranks, float32 on the wire), which adds the
    # same order of rounding again: 4x the drift, plus a few ulps of slack.
    ref64 = _train_reference(join_step, torch.float64)
    ref32 = _train_reference(join_step, torch.float32)
    drift = max(float(np.max(np.abs(a - b))) for a, b in zip(ref32, ref64, strict=True))
    bound = 4 * drift + 8 * float(np.finfo(np.float32).eps)
    for rank in range(3):
        assert results[rank]["size"] == 3
        for got, want in zip(results[rank]["params"], ref64, strict=True):
            assert float(np.max(np.abs(got - want))) <= bound, (rank, bound)
    # And not trivially: a run that never grew ends elsewhere.
    never_grew = _train_reference(STEPS, torch.float64)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(never_grew, ref64, strict=True)
               ) > 10 * bound


QUIET_SUMS, QUIET_S, JOIN_TIMEOUT_S = 20, 0.2, 3.0


def quiet_worker(rank: int, world_size: int, addresses: list[str], job: str) -> object:
    """Ranks 0 and 1 sum without a commit for QUIET_SUMS * QUIET_S; rank 2 tries to join."""
    import reducer_client.torch as rt

    os.environ["REDUCER_ELASTIC_JOIN_TIMEOUT"] = str(JOIN_TIMEOUT_S)
    _init(rt, rank, addresses, job)
    started = time.monotonic()

    @rt.elastic.run
    def total(state):
        sums = []
        for i in range(QUIET_SUMS):
            time.sleep(QUIET_S)
            sums.append(rt.allreduce(torch.tensor([float(i + rt.rank())]), op=rt.Sum).item())
        return sums
    try:
        return total(rt.elastic.ObjectState(rt.broadcast_object))
    finally:
        if rank == JOINER:  # how long it knocked before giving up
            print(f"joiner gave up after {time.monotonic() - started:.1f} s", flush=True)
        rt.shutdown()


def test_added_worker_without_a_commit_hangs_no_one(daemons):
    started = time.monotonic()
    with daemons(2, "--stalled-after", str(STALLED_AFTER_S), round_timeout=2) as d:
        results = run_workers(quiet_worker, 3, (d.addresses, uuid.uuid4().hex), timeout=90,
                              allow_errors=True)
    elapsed_s = time.monotonic() - started
    for rank in (0, 1):
        assert results[rank] == [float(2 * i + 1) for i in range(QUIET_SUMS)], results[rank]
    assert isinstance(results[JOINER], WorkerFailed)
    assert "admitted this worker" in str(results[JOINER]), results[JOINER]
    # Bounded: the join timeout plus one knock's round timeout, beside start-up.
    assert elapsed_s < 60, elapsed_s
