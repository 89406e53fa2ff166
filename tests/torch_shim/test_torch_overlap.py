"""DistributedOptimizer(overlap_forward=model): crossing the barrier, against LocalGroup.

The updates must be exactly those of the plain DistributedOptimizer (float32
wire: the same sums in the same order), only applied later: each module's
in the next forward, just before that module runs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

STEPS = 4
# make_model seeds torch's global generator: ranks (threads) build their models
# one at a time, or they would draw each other's initial values.
_MODEL_LOCK = threading.Lock()


def _train(rank: int, reducer, overlap: bool, kind: str, optimizer: str) -> list[torch.Tensor]:
    with _MODEL_LOCK:
        model = make_model(kind)
    base = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if optimizer == "sgd" else torch.optim.Adam(model.parameters(), lr=0.01))
    # Small buckets: several per step, so the order of application matters.
    opt = rt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                  bucket_bytes=600, reducer=reducer,
                                  overlap_forward=model if overlap else None)
    # A scheduler stepped right after step(): the step's own LR must still apply.
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        x, y = batch(kind, step, rank)
        opt.zero_grad()
        loss_of(kind, model(x), y).backward()
        opt.step()
        schedule.step()
    opt.finish_step()
    return [p.detach().clone() for p in model.parameters()]


def _on_ranks(fn, world_size: int = 2) -> list:
    group = LocalGroup(world_size, timeout=30)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, r, group.client(r)) for r in range(world_size)]
        return [f.result(60) for f in futures]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_overlap_updates_equal_the_plain_optimizer(kind: str, optimizer: str):
    plain = _on_ranks(lambda r, red: _train(r, red, False, kind, optimizer))
    crossed = _on_ranks(lambda r, red: _train(r, red, True, kind, optimizer))
    for rank in range(2):
        for a, b in zip(plain[rank], crossed[rank], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(crossed[0], crossed[1], strict=True):
        assert torch.equal(a, b)  # and the ranks agree


class GatedReducer:
    """One rank whose reductions finish only when the test releases them."""

    rank, world_size, local_rank, local_size, timeout, wire_dtype = 0, 1, 0, 1, 30.0, "float32"

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards pending (autograd's thread and the test's)
        self.pending: dict[str, tuple[np.ndarray, np.ndarray, Future]] = {}

    def allreduce_async(self, array, key, op="sum", *, out=None):
        future: Future = Future()
        with self._lock:
            self.pending[key] = (array.copy(), array if out is None else out, future)
        return future

    def release(self, key: str) -> None:
        with self._lock:
            values, out, future = self.pending.pop(key)
        out[...] = values
        future.set_result(out)

    def release_all(self) -> None:
        for key in list(self.pending):
            self.release(key)

    def allreduce(self, array, key, op="sum", *, out=None):
        raise AssertionError("not used")

    broadcast_async = broadcast = allreduce

    def close(self) -> None:
        pass


@pytest.mark.timeout(30)
def test_step_returns_at_once_and_each_layer_waits_only_for_its_bucket():
    reducer = GatedReducer()
    model = make_model("mlp")
    first, last = model.net[0], model.net[4]
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  bucket_bytes=1, reducer=reducer, overlap_forward=model)
    x, y = batch("mlp", 0, 0)
    loss_of("mlp", model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # every bucket still in flight: must not wait
    assert len(reducer.pending) == 6  # one bucket per tensor
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # Release the first layer's two buckets only (launched last, in backward order).
    keys = sorted(reducer.pending, key=lambda k: int(k.rsplit(".", 1)[1]))
    for key in keys[-2:]:
        reducer.release(key)
    first(x)  # runs: its parameters' buckets are back
    assert not torch.equal(first.weight, before[0]) and first.weight.grad is None
    assert torch.equal(last.weight, before[4])  # not applied yet: still on the wire
    reducer.release_all()
    model(x)  # the rest apply as their modules' forward starts
    after = [p.detach() for p in model.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.timeout(30)
def test_unreached_updates_apply_at_the_end_of_forward_and_in_state_dict():
    group = LocalGroup(1)
    model = make_model("branchy")
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  reducer=group.client(0), overlap_forward=model)
    for step in range(3):  # the extra layer is skipped by the next forward
        x, y = batch("mlp", step, 0)
        extra_before = model.extra.weight.detach().clone()
        loss_of("mlp", model(x, use_extra=step != 1), y).backward()
        opt.step()
    assert torch.equal(model.extra.weight, extra_before)  # the last update is pending
    model.state_dict()  # applies it
    assert not torch.equal(model.extra.weight, extra_before)
    opt.zero_grad()  # allowed with updates pending
    x, y = batch("mlp", 9, 0)
    loss_of("mlp", model(x), y).backward()  # a clean count: no "accumulated twice"
    opt.step()
    assert "state" in opt.state_dict()


def test_overlap_forward_must_be_the_model_that_owns_the_parameters():
    group = LocalGroup(1)
    model = make_model("mlp")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                reducer=group.client(0), overlap_forward=True)
    with pytest.raises(ValueError, match="owns none"):
        rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                reducer=group.client(0), overlap_forward=make_model("cnn"))
