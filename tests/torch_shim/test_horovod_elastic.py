"""reducer_client.elastic's logic against LocalGroup (ranks as threads): State
commit / restore / sync, the run loop (a failure goes back to the last
commit, the reset callbacks run, the call is retried), what is not retried,
the incarnation agreement, and reading the daemon's missing ranks.
Real daemons, a restarted job and a lost worker: tests/integration/test_elastic.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client.elastic import IncarnationReducer, agree, missing_ranks  # noqa: E402
from reducer_client.errors import ReducerError  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402


def test_object_state_commit_restore():
    state = rt.elastic.ObjectState(lambda obj, root: obj, batch=0, epoch=0)
    state.batch, state.epoch = 5, 1
    state.commit()
    state.batch = 9
    state.restore()
    assert (state.batch, state.epoch) == (5, 1)


def test_torch_state_restores_model_and_optimizer():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = rt.elastic.TorchState(model, opt, batch=0)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state.batch = 1
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state.batch = 2
    state.restore()
    assert state.batch == 1
    assert all(torch.equal(a, b) for a, b in zip(committed, model.parameters(), strict=True))
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)


def test_run_goes_back_to_the_last_commit_and_retries():
    """One rank; the first attempt fails after a commit: the retry starts from it."""
    rt.init(reducer=LocalGroup(1).client(0))
    calls, resets = [], []
    try:
        @rt.elastic.run
        def train(state):
            calls.append(state.batch)
            while state.batch < 4:
                state.batch += 1
                if state.batch == 2:
                    state.commit()
                if state.batch == 3 and len(calls) == 1:
                    raise ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED, "a round timed out")
            return state.batch
        state = rt.elastic.ObjectState(rt.broadcast_object, batch=0)
        state.register_reset_callbacks([lambda: resets.append(rt.size())])
        assert train(state) == 4
        assert calls == [0, 2] and resets == [1]
        assert isinstance(rt.client(), IncarnationReducer)
    finally:
        rt.shutdown()


def test_run_does_not_retry_a_bad_call():
    rt.init(reducer=LocalGroup(1).client(0))
    try:
        @rt.elastic.run
        def train(state):
            raise ReducerError(grpc.StatusCode.INVALID_ARGUMENT, "ranks disagree on shape")
        with pytest.raises(ReducerError, match="disagree"):
            train(rt.elastic.ObjectState(rt.broadcast_object))
    finally:
        rt.shutdown()


def test_incarnation_agreement_and_keys():
    group = LocalGroup(3)
    with ThreadPoolExecutor(3) as pool:
        ids = list(pool.map(lambda r: agree(group.client(r)), range(3)))
    assert len(set(ids)) == 1 and ids[0]
    facade = IncarnationReducer(group.client(0), ids[0])
    assert facade.prefix == f"i{ids[0]}/" and facade.rank == 0 and facade.world_size == 3


def test_agreement_skips_an_earlier_incarnations_cached_result():
    """A result whose slot is not this rank's nonce is an earlier one's: next round."""
    class Replaying:
        rank, world_size, wire_dtype = 0, 1, "float32"

        def __init__(self) -> None:
            self.rounds = 0

        def allreduce_async(self, array, key, op="sum", *, out=None, wire_dtype=None):
            from concurrent.futures import Future
            future: Future = Future()
            self.rounds += 1
            future.set_result(np.full_like(array, 7.0) if self.rounds == 1 else array.copy())
            return future
    reducer = Replaying()
    assert agree(reducer) and reducer.rounds == 2


def test_missing_ranks_from_the_daemons_message():
    error = ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                         "job 'j' key 'k' round 3 offset 0: no contribution from rank(s) "
                         "0, 2 of 3 within the round timeout of 3 s")
    assert missing_ranks(error, 3) == [0, 2]
    assert missing_ranks(error, 4) is None  # another world size
    assert missing_ranks(ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      "no result within 20 s"), 3) is None
    assert missing_ranks(ValueError("x"), 3) is None
