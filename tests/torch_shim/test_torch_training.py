"""DistributedOptimizer, broadcasts and allreduce of reducer_client.torch, real daemons.

One launch of two spawned workers runs every scenario (each worker starts
as a launcher would start it: REDUCER_* variables, then rt.init()); each
test below checks its scenario's part of the results. A scenario that fails
on a rank comes back as its traceback and fails only its own test.
"""

from __future__ import annotations

import copy
import os
import traceback
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import ReducerClient  # noqa: E402
from support import run_workers, running_daemons  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

WORLD_SIZE = 2
STEPS = 8
LR = 0.1
MOMENTUM = 0.9


def uses_extra(step: int, micro: int, rank: int, passes: int) -> bool:
    """Whether rank's micro-batch uses the extra layer: on some ranks, some steps, or none."""
    return (passes * step + micro + rank) % 3 == 0


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=0.01)


def train(model, opt, rank_range, step: int, passes: int) -> float:
    """One optimizer step; each backward pass averages the losses of `rank_range`.

    Returns the largest gradient before step() (for a DistributedOptimizer,
    this rank's own, not yet averaged).
    """
    opt.zero_grad()
    for micro in range(passes):
        losses = []
        for rank in rank_range:
            x, y = batch("branchy", passes * step + micro, rank)
            losses.append(loss_of("branchy", model(x, uses_extra(step, micro, rank, passes)),
                                  y))
        (sum(losses) / len(losses)).backward()
    max_grad = max(p.grad.abs().max().item() for p in model.parameters()
                   if p.grad is not None)
    opt.step()
    return max_grad


def optimizer_scenario(rank: int, world_size: int, reducer, opt_kind: str, passes: int,
                       ) -> dict:
    """Train with DistributedOptimizer; also train a single process on all ranks' batches."""
    base = make_model("branchy")
    model, reference = copy.deepcopy(base), copy.deepcopy(base)
    opt = rt.DistributedOptimizer(make_optimizer(opt_kind, model.parameters()),
                                  named_parameters=model.named_parameters(),
                                  backward_passes_per_step=passes, bucket_bytes=512,
                                  reducer=reducer)
    ref_opt = make_optimizer(opt_kind, reference.parameters())
    max_grad = 0.0
    for step in range(STEPS):
        max_grad = max(max_grad, train(model, opt, [rank], step, passes))
        train(reference, ref_opt, range(world_size), step, passes)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            # None on every rank exactly when no rank used the parameter.
            assert (p.grad is None) == (q.grad is None), (step, p.shape)
    # The state is usable by broadcast_optimizer_state, and steps go on after it.
    rt.broadcast_optimizer_state(opt, root_rank=0, reducer=reducer)
    train(model, opt, [rank], STEPS, passes)
    train(reference, ref_opt, range(world_size), STEPS, passes)
    return {"diff": max((p - q).abs().max().item()
                        for p, q in zip(model.parameters(), reference.parameters(),
                                        strict=True)),
            "max_grad": max_grad, "isinstance": isinstance(opt, type(ref_opt)),
            "params": [p.detach().numpy().copy() for p in model.parameters()]}


def broadcast_parameters_scenario(rank: int, world_size: int) -> dict:
    """Differently initialised models (and odd dtypes) become root's, exactly."""
    model = make_model("normed", seed=rank + 1)
    model.train()
    for i in range(rank + 1):  # differing BatchNorm statistics and counters
        model(batch("mlp", i, rank)[0])
    odd = [("float64", torch.randn(5, dtype=torch.float64) + rank),
           ("bfloat16", torch.randn(4, 3).to(torch.bfloat16) + rank),
           ("float16", torch.randn(7).half() - rank),
           ("int64", torch.tensor([2 ** 40 + 1, -(2 ** 62) - 3, rank])),
           ("bool", torch.tensor([True, False]) ^ bool(rank)),
           ("scalar", torch.tensor(-0.5 - rank))]
    rt.broadcast_parameters(model.state_dict(), root_rank=1)
    rt.broadcast_parameters(odd, root_rank=1)
    return {"state": {k: v.numpy().copy() for k, v in model.state_dict().items()},
            "odd": {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                    for k, v in odd}}


def optimizer_state_scenario(rank: int, world_size: int) -> dict:
    """Root's Adam / SGD state reaches ranks that have none or a different one."""
    out = {}
    for opt_kind in ("adam", "sgd"):
        model = make_model("mlp", seed=rank + 5)
        lr = 0.01 if rank == 0 else 0.5
        opt = (torch.optim.Adam(model.parameters(), lr=lr) if opt_kind == "adam" else
               torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
        # Root steps 3 times; with Adam the others have no state at all, with
        # SGD they have momentum from their own data.
        for step in range(3 if rank == 0 or opt_kind == "sgd" else 0):
            opt.zero_grad()
            x, y = batch("mlp", step, rank)
            loss_of("mlp", model(x), y).backward()
            opt.step()
        rt.broadcast_parameters(model.state_dict(), root_rank=0)
        rt.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        after_broadcast = {"lr": state["param_groups"][0]["lr"],
                           "state": {(i, k): v.numpy().copy() if torch.is_tensor(v) else v
                                     for i, s in state["state"].items() for k, v in s.items()}}
        # One more step on the same batch everywhere: identical results.
        opt.zero_grad()
        x, y = batch("mlp", 99, 0)
        loss_of("mlp", model(x), y).backward()
        opt.step()
        out[opt_kind] = {"after_broadcast": after_broadcast,
                         "params": [p.detach().numpy().copy() for p in model.parameters()]}
    return out


def allreduce_scenario(rank: int, world_size: int) -> dict:
    """rt.allreduce on several dtypes, mean and sum, against a float64 reference."""
    out = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        inputs = [torch.linspace(-1, 1, 300, dtype=torch.float64) * (r + 1)
                  for r in range(world_size)]
        for op in ("mean", "sum"):
            result = rt.allreduce(inputs[rank].to(dtype).view(3, 100), name=f"{dtype}-{op}",
                                  op=op)
            assert result.dtype == dtype and result.shape == (3, 100)
            expected = sum(t.to(dtype).double() for t in inputs)
            if op == "mean":
                expected = expected / world_size
            out[str(dtype), op] = float((result.double().view(-1) - expected).abs().max())
    return out


SCENARIOS = {
    "sgd": lambda rank, ws, reducers: optimizer_scenario(rank, ws, reducers["float32"],
                                                         "sgd", 1),
    "sgd_two_passes": lambda rank, ws, reducers: optimizer_scenario(
        rank, ws, reducers["float32"], "sgd", 2),
    "adam": lambda rank, ws, reducers: optimizer_scenario(rank, ws, reducers["float32"],
                                                          "adam", 1),
    "sgd_bfloat16": lambda rank, ws, reducers: optimizer_scenario(
        rank, ws, reducers["bfloat16"], "sgd", 1),
    "broadcast_parameters": lambda rank, ws, reducers: broadcast_parameters_scenario(rank, ws),
    "optimizer_state": lambda rank, ws, reducers: optimizer_state_scenario(rank, ws),
    "allreduce": lambda rank, ws, reducers: allreduce_scenario(rank, ws),
}


def scenario_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    torch.set_num_threads(1)
    # As a launcher would: the process-wide client from REDUCER_* variables.
    os.environ.update(REDUCER_ADDRESSES=",".join(addresses), REDUCER_JOB=job,
                      REDUCER_RANK=str(rank), REDUCER_WORLD_SIZE=str(world_size),
                      REDUCER_WIRE_DTYPE="float32", REDUCER_TIMEOUT="30")
    reducers = {"float32": rt.init(),
                "bfloat16": ReducerClient(addresses, job=f"{job}-bf16", rank=rank,
                                          world_size=world_size, wire_dtype="bfloat16",
                                          timeout=30)}
    assert rt.rank() == rank and rt.size() == world_size
    results = {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = ("ok", scenario(rank, world_size, reducers))
            except Exception:
                results[name] = ("error", traceback.format_exc())
    finally:
        reducers["bfloat16"].close()
        rt.shutdown()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    with running_daemons(2, log_dir=tmp_path_factory.mktemp("daemons"),
                         round_timeout=60) as daemons:
        return run_workers(scenario_worker, WORLD_SIZE, (daemons.addresses, uuid.uuid4().hex),
                           timeout=240)


def scenario(results, name: str) -> list:
    per_rank = []
    for rank, rank_results in enumerate(results):
        status, value = rank_results[name]
        assert status == "ok", f"rank {rank}, scenario {name}:\n{value}"
        per_rank.append(value)
    return per_rank


@pytest.mark.parametrize("name", ["sgd", "sgd_two_passes", "adam"])
def test_distributed_optimizer_matches_single_process(results, name):
    """Float32 wire: the same parameters as one process on the concatenated batch.

    Covers backward_passes_per_step=2 and a layer that some ranks, or none,
    use in a step (its .grad stays None where no rank used it, so momentum
    and weight decay skip it exactly as in the single process). Tolerance:
    float32 sums of two ranks in another order than autograd's, 1e-6.
    """
    per_rank = scenario(results, name)
    for value in per_rank:
        assert value["isinstance"]
        assert value["diff"] <= 1e-6, value["diff"]
    for a, b in zip(per_rank[0]["params"], per_rank[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_distributed_optimizer_bfloat16_wire(results):
    """bfloat16 wire: within the rounding bound of the wire dtype.

    Each step's averaged gradient is off by at most 2uG (u = 2^-8: every
    rank's gradient and the mean are each rounded once; G is the largest
    gradient of any one rank). SGD with momentum m moves the parameters by
    at most LR / (1 - m) times a gradient error, so after STEPS + 1 steps
    they are off by at most (STEPS + 1) * LR / (1 - m) * 2uG.
    """
    per_rank = scenario(results, "sgd_bfloat16")
    max_grad = max(value["max_grad"] for value in per_rank)
    for value in per_rank:
        bound = (STEPS + 1) * LR / (1 - MOMENTUM) * max_grad * 2 * 2.0 ** -8
        print(f"bfloat16 wire: max |param diff| {value['diff']:.2e}, bound {bound:.2e}")
        assert value["diff"] <= bound
    for a, b in zip(per_rank[0]["params"], per_rank[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_broadcast_parameters_exact(results):
    """Every tensor of the state_dict and of every dtype is root's bit for bit."""
    root, other = scenario(results, "broadcast_parameters")[::-1]
    for part in ("state", "odd"):
        assert root[part].keys() == other[part].keys()
        for key in root[part]:
            np.testing.assert_array_equal(other[part][key], root[part][key], err_msg=key)
            assert other[part][key].dtype == root[part][key].dtype


def test_broadcast_optimizer_state(results):
    """Adam state not yet created on rank 1, SGD momentum that differs: both become root's."""
    per_rank = scenario(results, "optimizer_state")
    for opt_kind in ("adam", "sgd"):
        root, other = (r[opt_kind] for r in per_rank)
        assert other["after_broadcast"]["lr"] == root["after_broadcast"]["lr"] == 0.01
        assert other["after_broadcast"]["state"].keys() == root["after_broadcast"]["state"].keys()
        assert root["after_broadcast"]["state"], "root has state"
        for key, value in root["after_broadcast"]["state"].items():
            np.testing.assert_array_equal(other["after_broadcast"]["state"][key], value)
        for a, b in zip(root["params"], other["params"], strict=True):
            np.testing.assert_array_equal(a, b)


def test_allreduce_dtypes(results):
    """float32 wire: float32/float16/bfloat16 inputs are exact (sums of 2 in float32);
    float64 input is rounded to float32 on the wire (relative 2^-24)."""
    for value in scenario(results, "allreduce"):
        for (dtype, op), error in value.items():
            bound = {"torch.float64": 2 * 2.0 ** -24, "torch.float32": 2.0 ** -23,
                     "torch.float16": 2.0 ** -10, "torch.bfloat16": 2.0 ** -7}[dtype]
            # The result is rounded to the input dtype at the end: one unit
            # roundoff of it, on values up to 2 (mean) or 3 (sum) in magnitude.
            assert error <= 3 * bound, (dtype, op, error)
