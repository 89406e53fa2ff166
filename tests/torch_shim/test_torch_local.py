"""Fast tests of reducer_client.torch against LocalGroup (ranks as threads, no daemon)."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.api import Reducer  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from reducer_client.torch.optimizer import _plan_buckets  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402


def on_ranks(fn, world_size: int = 2, timeout: float = 30.0) -> list:
    """Run fn(rank, reducer) on `world_size` threads sharing one LocalGroup."""
    group = LocalGroup(world_size, timeout=timeout)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, rank, group.client(rank)) for rank in range(world_size)]
        return [f.result(timeout) for f in futures]


@pytest.fixture
def process_client():
    """rt.init() with a LocalGroup client of a one-rank group; shut down afterwards."""
    reducer = rt.init(reducer=LocalGroup(1).client(0))
    yield reducer
    rt.shutdown()


def test_init_client_shutdown(process_client):
    assert rt.is_initialized() and rt.client() is process_client
    assert rt.init() is process_client  # a second init keeps the first client
    assert (rt.rank(), rt.size(), rt.local_rank(), rt.local_size()) == (0, 1, 0, 1)
    rt.shutdown()
    assert not rt.is_initialized()
    for basic in (rt.client, rt.rank, rt.size, rt.local_rank, rt.local_size):
        with pytest.raises(RuntimeError, match=r"reducer_client\.torch\.init\(\)"):
            basic()
    with pytest.raises(ValueError, match="not both"):
        rt.init(LocalGroup(1).client(0), wire_dtype="float32")


def test_init_from_arguments_does_not_read_environment(monkeypatch):
    monkeypatch.delenv("REDUCER_ADDRESSES", raising=False)
    reducer = rt.init(addresses=["127.0.0.1:1"], job="j", rank=1, world_size=2,
                      local_rank=1, local_size=2, node_local=False)
    try:
        assert isinstance(reducer, Reducer) and (reducer.rank, reducer.world_size) == (1, 2)
        # The local basics are the client's node-local settings.
        assert (rt.rank(), rt.size(), rt.local_rank(), rt.local_size()) == (1, 2, 1, 2)
    finally:
        rt.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
def test_allreduce_keeps_dtype_and_shape(dtype):
    def work(rank, reducer):
        tensor = torch.full((2, 3), float(rank + 1), dtype=dtype, requires_grad=True)
        return (rt.allreduce(tensor, name="t", reducer=reducer),
                rt.allreduce(tensor, name="t", op="sum", reducer=reducer))
    for mean, total in on_ranks(work):
        # Differentiable, as Horovod's: the result carries the input's requires_grad.
        assert mean.dtype == dtype and mean.shape == (2, 3) and mean.requires_grad
        assert torch.all(mean == 1.5) and torch.all(total == 3)


def test_unnamed_allreduce_calls_pair_up_in_order():
    def work(rank, reducer):
        return [rt.allreduce(torch.tensor([float(rank + i)]), reducer=reducer).item()
                for i in range(3)]
    assert on_ranks(work) == [[0.5, 1.5, 2.5]] * 2


def test_allreduce_takes_integers_and_refuses_bool_and_complex(process_client):
    ints = rt.allreduce(torch.arange(3, dtype=torch.int32), name="ints", op="sum")
    assert ints.dtype == torch.int32 and ints.tolist() == [0, 1, 2]
    for dtype in (torch.bool, torch.complex64):
        with pytest.raises(TypeError, match=f"dtype {str(dtype)[6:]} cannot be reduced"):
            rt.allreduce(torch.ones(3, dtype=dtype), name=f"bad-{dtype}")


def test_bucket_plan_reverse_order_by_dtype():
    params = [(f"p{i}", torch.zeros(10, dtype=dt))
              for i, dt in enumerate([torch.float32] * 4 + [torch.float16] * 2)]
    buckets = _plan_buckets(params, bucket_bytes=80, prefix="o")
    # 40-byte float32 tensors, two per bucket, last parameters first; float16 apart.
    # Full buckets come first, then the partly filled ones.
    assert [b.names for b in buckets] == [["p3", "p2"], ["p5", "p4"], ["p1", "p0"]]
    assert [b.key for b in buckets] == ["o/bucket.0", "o/bucket.1", "o/bucket.2"]


def _uses_extra(step: int, rank: int) -> bool:
    return (step + rank) % 3 == 0  # rank 0 only, nobody, rank 1 only, ...


@pytest.mark.parametrize("passes", [1, 2])
def test_optimizer_matches_single_process(passes):
    """Same parameters as one process on the concatenated batch (unused layer included)."""
    base = make_model("branchy")
    steps = 5

    def train(model, opt, ranks):
        for step in range(steps):
            opt.zero_grad()
            for micro in range(passes):
                losses = [loss_of("branchy", model(batch("branchy", step * passes + micro, r)[0],
                                                   _uses_extra(step, r)),
                                  batch("branchy", step * passes + micro, r)[1]) for r in ranks]
                (sum(losses) / len(losses)).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    def work(rank, reducer):
        model = copy.deepcopy(base)
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
            named_parameters=model.named_parameters(), backward_passes_per_step=passes,
            bucket_bytes=256, reducer=reducer)
        return train(model, opt, [rank])

    model = copy.deepcopy(base)
    expected = train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                            weight_decay=0.01), [0, 1])
    for got in on_ranks(work):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_optimizer_is_the_wrapped_class_and_shares_state():
    model = make_model("mlp")
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = rt.DistributedOptimizer(inner, reducer=LocalGroup(1).client(0))
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append(1))
    x, y = batch("mlp", 0, 0)
    loss_of("mlp", model(x), y).backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.005 and len(calls) == 1
    opt.load_state_dict(opt.state_dict())  # must not hook step twice
    opt.zero_grad()
    loss_of("mlp", model(x), y).backward()
    opt.step()
    assert len(calls) == 2
    with pytest.raises(TypeError, match="already"):
        rt.DistributedOptimizer(opt)


def test_backward_too_often_and_zero_grad_in_between_raise():
    model = make_model("mlp")
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  reducer=LocalGroup(1).client(0))
    x, y = batch("mlp", 0, 0)
    loss_of("mlp", model(x), y).backward()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=1"):
        loss_of("mlp", model(x), y).backward()
    opt.step()  # the first pass's reductions complete; the state is fresh again
    opt.zero_grad()
    loss_of("mlp", model(x), y).backward()
    opt.step()


def test_synchronize_then_clip_then_skip_synchronize():
    def work(rank, reducer):
        model = make_model("mlp")
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      reducer=reducer)
        x, y = batch("mlp", 0, rank)
        loss_of("mlp", model(x), y).backward()
        opt.synchronize()
        averaged = [p.grad.clone() for p in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with opt.skip_synchronize():
            opt.step()  # no second reduction: a LocalGroup round would wait for ever
        return averaged
    first, second = on_ranks(work)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


class FakeBucket:
    """The part of dist.GradBucket the hook uses."""

    def __init__(self, index: int, buffer: torch.Tensor) -> None:
        self._index, self._buffer = index, buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return []  # recorded by the hook for join(), which these tests do not call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hook_averages_the_bucket_in_place(dtype):
    def work(rank, reducer):
        buffer = torch.full((5,), float(rank * 2), dtype=dtype)
        result = rt.allreduce_hook(reducer, FakeBucket(3, buffer)).wait()
        return result, buffer
    for result, buffer in on_ranks(work):
        assert result.dtype == dtype and torch.all(result == 1.0) and torch.all(buffer == 1.0)


def test_hook_failure_fails_the_future():
    class Failing:
        rank, world_size, timeout = 0, 1, 1.0

        def allreduce_async(self, array, key, op="sum", *, out=None):
            raise rt.ReducerError(__import__("grpc").StatusCode.UNAVAILABLE, "daemon down")

    future = rt.allreduce_hook(Failing(), FakeBucket(0, torch.zeros(3)))
    with pytest.raises(RuntimeError, match="daemon down"):
        future.wait()


def test_broadcasts_exact_and_optimizer_state_created():
    def work(rank, reducer):
        model = make_model("normed", seed=rank)
        model.train()
        model(batch("mlp", 0, rank)[0])  # BatchNorm statistics differ per rank
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
        if rank == 0:
            x, y = batch("mlp", 1, rank)
            loss_of("mlp", model(x), y).backward()
            opt.step()
        rt.broadcast_parameters(model.state_dict(), root_rank=0, reducer=reducer)
        rt.broadcast_optimizer_state(opt, root_rank=0, reducer=reducer)
        ints = torch.tensor([2 ** 53 + 1, -7]) * (rank + 1)
        rt.broadcast_parameters([("ints", ints)], root_rank=1, reducer=reducer)
        obj = rt.broadcast_object({"epoch": 3} if rank == 1 else None, root_rank=1,
                                  reducer=reducer)
        return model.state_dict(), opt.state_dict(), ints, obj
    (model0, opt0, ints0, obj0), (model1, opt1, ints1, obj1) = on_ranks(work)
    for key in model0:
        assert torch.equal(model0[key], model1[key]), key
    assert opt1["param_groups"] == opt0["param_groups"]
    assert opt1["state"].keys() == opt0["state"].keys() and opt0["state"]
    for index, state in opt0["state"].items():
        for name, value in state.items():
            assert torch.equal(opt1["state"][index][name], value), (index, name)
    assert torch.equal(ints0, torch.tensor([2 * (2 ** 53 + 1), -14])) and torch.equal(ints0, ints1)
    assert obj0 == obj1 == {"epoch": 3}


def test_no_framework_thread_left_behind():
    """CPU use starts no staging thread (that is for CUDA only)."""
    before = {t.name for t in threading.enumerate()}
    on_ranks(lambda rank, reducer: rt.allreduce_hook(
        reducer, FakeBucket(0, torch.ones(4))).wait())
    assert not any(name.startswith("reducer-torch-staging")
                   for name in {t.name for t in threading.enumerate()} - before)
