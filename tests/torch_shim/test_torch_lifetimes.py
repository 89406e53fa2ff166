"""What a DistributedOptimizer leaves behind once it is gone (LocalGroup, no daemon).

Scenarios: an optimizer replaced by a new one over the same parameters (a
new training phase) must stop reducing; many optimizers made and dropped in
one process must not keep their residuals and join shadows; an elastic
restore forgets the residuals of the steps it undoes.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import collectives as coll  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from reducer_client.torch import _lifetime  # noqa: E402
from reducer_client.torch._tensors import staging_for  # noqa: E402
from support import KeySpy  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _residual_keys(reducer) -> list[str]:
    feedback = staging_for(reducer)._feedback
    return [] if feedback is None else sorted(feedback._keys)


@pytest.mark.parametrize("overlap", [False, True])
def test_replaced_optimizer_stops_reducing(overlap):
    """A new DistributedOptimizer over the same parameters, the old one dropped:
    only the new one's buckets are reduced, and backward does not raise."""
    reducer = KeySpy(LocalGroup(1, wire_dtype="float32").client(0))
    model = torch.nn.Linear(8, 2)

    def wrap(lr):
        return rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                       named_parameters=model.named_parameters(),
                                       reducer=reducer,
                                       overlap_forward=model if overlap else None)

    def step(opt):
        opt.zero_grad()
        model(torch.ones(3, 8)).sum().backward()
        opt.step()
        if overlap:
            opt.finish_step()

    opt = wrap(0.1)
    step(opt)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None
    opt = wrap(0.01)
    for _ in range(2):
        reducer.keys.clear()
        step(opt)
        assert sorted(k for k in reducer.keys if "bucket" in k) == ["optimizer.1/bucket.0"]


def _one_step(model: torch.nn.Module, opt) -> None:
    opt.zero_grad()
    model(torch.ones(2, model.in_features)).sum().backward()
    opt.step()


def test_dropped_optimizers_free_their_residuals_and_shadows():
    reducer = LocalGroup(1, wire_dtype="int8").client(0)
    kept_model = torch.nn.Linear(4, 4)
    kept = rt.DistributedOptimizer(torch.optim.SGD(kept_model.parameters(), lr=0.1),
                                   reducer=reducer)
    _one_step(kept_model, kept)
    for _ in range(3):
        model = torch.nn.Linear(64, 64)
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      reducer=reducer)
        _one_step(model, opt)
        # The kept one's and this one's: those gone went when this one was made.
        assert len(_residual_keys(reducer)) == 2
        assert len(coll._session(reducer).shadows) == 2
        del opt, model
        gc.collect()
    _lifetime.drop_leftovers()  # what the next optimizer made would do
    assert _residual_keys(reducer) == ["optimizer.0/bucket.0"]
    assert list(coll._session(reducer).shadows) == [kept._steps.tag]


def test_an_optimizer_gone_in_a_thread_holding_the_feedbacks_lock_does_not_deadlock():
    """A finalizer may run inside a garbage collection while its thread holds
    the lock it would need (the optimizer in a reference cycle, collected at an
    allocation inside ErrorFeedback.apply): it takes no lock of ours."""
    reducer = LocalGroup(1, wire_dtype="int8").client(0)
    model = torch.nn.Linear(4, 4)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  reducer=reducer)
    _one_step(model, opt)
    leftovers = opt._gradients.leftovers
    feedback = staging_for(reducer)._feedback
    done = threading.Event()

    def gone_while_locked():
        with feedback._lock, coll._session(reducer)._lock:
            leftovers()
        done.set()
    threading.Thread(target=gone_while_locked, daemon=True).start()
    assert done.wait(10), "the finalizer waited for a lock its own thread held"
    _lifetime.drop_leftovers()
    assert _residual_keys(reducer) == []


def test_restore_forgets_the_residuals():
    """A step replayed after restore() gives the reduced gradient of the original."""
    reducer = LocalGroup(1, wire_dtype="int8").client(0)
    param = torch.nn.Parameter(torch.zeros(256))
    grad = torch.linspace(0.013, 1.0, 256) ** 3
    opt = rt.DistributedOptimizer(torch.optim.SGD([param], lr=1.0),
                                  named_parameters=[("p", param)], reducer=reducer)
    state = rt.elastic.TorchState(torch.nn.ParameterList([param]), opt, batch=0)

    def one_step():
        opt.zero_grad()
        (param * grad).sum().backward()
        opt.step()
        return param.grad.clone()
    first = one_step()
    state.restore()
    assert _residual_keys(reducer) == []
    assert torch.equal(one_step(), first)
