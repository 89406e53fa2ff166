"""What Horovod's own torch tests need of the shim, one check each (LocalGroup:
ranks as threads; warnings are checked on a one-rank group, as
warnings.catch_warnings is per process)."""

from __future__ import annotations

import itertools
import warnings
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as hvd  # noqa: E402
from reducer_client.errors import ReducerError  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from reducer_client.torch.optimizer import SYNCHRONIZED_STEP_WARNING  # noqa: E402


def on_ranks(fn, world_size: int = 2) -> list:
    group = LocalGroup(world_size, timeout=15, wire_dtype="float32")
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, r, group.client(r)) for r in range(world_size)]
        out = []
        for future in futures:
            try:
                out.append(future.result(timeout=60))
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out.append(exc)
        return out


def _one_step(opt, model):
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()


@pytest.mark.timeout(60)
def test_step_after_synchronize_warns_as_horovod_and_reduces_once():
    reducer = LocalGroup(1, wire_dtype="float32").client(0)
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), reducer=reducer)
    _one_step(opt, model)
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert [str(w.message) for w in caught] == [SYNCHRONIZED_STEP_WARNING]
    assert "optimizer.step() called without optimizer.skip_synchronize()" in str(
        caught[0].message)
    _one_step(opt, model)
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
        _one_step(opt, model)
        opt.step()  # no synchronize() before: no warning
    assert caught == []


def test_duplicate_named_parameters_refused_before_init():
    if hvd.is_initialized():
        hvd.shutdown()
    net1, net2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="duplicate names: \\['bias', 'weight'\\]"):
        hvd.DistributedOptimizer(opt, named_parameters=itertools.chain(
            net1.named_parameters(), net2.named_parameters()))


@pytest.mark.timeout(60)
def test_broadcast_from_a_joined_root_fails_on_the_others():
    """A joined rank sends zeros for the others' broadcast: where it is the
    root they would get zeros for its tensor, so they fail, naming it; the
    joined rank goes on, and join then returns on all."""
    def work(rank, reducer):
        if rank == 0:
            return hvd.join(reducer=reducer), None
        with pytest.raises(ReducerError) as refused:
            hvd.broadcast(torch.ones(3), root_rank=0, name="b", reducer=reducer)
        kept = hvd.broadcast(torch.full((2,), 5.0), root_rank=1, reducer=reducer)
        assert kept.tolist() == [5.0, 5.0]  # an active root still broadcasts
        return hvd.join(reducer=reducer), refused.value
    results = on_ranks(work)
    assert [last for last, _ in results] == [1, 1]
    error = results[1][1]
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "broadcast 'b': root_rank 0 has joined" in str(error)


@pytest.mark.timeout(60)
def test_grouped_allgather_gathers_each_tensor_in_list_order():
    def work(rank, reducer):
        return hvd.grouped_allgather([torch.full((rank + 1,), rank), torch.ones(1, 2) * rank],
                                     reducer=reducer)
    for first, second in on_ranks(work):
        assert first.tolist() == [0, 1, 1] and second.tolist() == [[0.0, 0.0], [1.0, 1.0]]


@pytest.mark.parametrize("name, words", [
    ("alltoall", "alltoall is not supported"),
    ("alltoall_async", "alltoall is not supported"),
    ("reducescatter", "reducescatter is not supported"),
    ("grouped_reducescatter", "grouped_reducescatter is not supported"),
    ("add_process_set", "process sets are not supported"),
    ("remove_process_set", "process sets are not supported"),
])
def test_collectives_summing_daemons_lack_raise_not_implemented(name, words):
    with pytest.raises(NotImplementedError, match=words):
        getattr(hvd, name)(torch.ones(2))
