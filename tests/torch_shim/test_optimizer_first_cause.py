"""DistributedOptimizer.synchronize with buckets failing two ways: the daemon
that went away (UNAVAILABLE) is named, not the deadline its absence caused on
another daemon (reducer_client.errors.first_cause)."""

from __future__ import annotations

from concurrent.futures import Future

import grpc
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import ReducerError  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

pytestmark = pytest.mark.timeout(60)

GONE = ReducerError(grpc.StatusCode.UNAVAILABLE, "daemon 127.0.0.1:1: connection refused")
ECHO = ReducerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                    "daemon 127.0.0.1:2: no contribution from rank 1 within the round timeout")


class Failing:
    """One rank's reducer whose buckets fail: the first launched with the echo,
    the last with the daemon gone (both settled before synchronize waits)."""

    def __init__(self, base, errors: list[ReducerError]) -> None:
        self.base, self.errors, self.keys = base, errors, []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def allreduce_async(self, array, key, op="sum", *, out=None, **extra):
        self.keys.append(key)
        future: Future = Future()
        future.set_exception(self.errors[min(len(self.keys), len(self.errors)) - 1])
        return future


def _step(errors: list[ReducerError]) -> tuple[pytest.ExceptionInfo, list[str]]:
    model = make_model("mlp")
    reducer = Failing(LocalGroup(1, timeout=10).client(0), errors)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  bucket_bytes=600, reducer=reducer, name="opt")
    x, y = batch("mlp", 0, 0)
    loss_of("mlp", model(x), y).backward()
    with pytest.raises(ReducerError) as raised:
        opt.step()
    return raised, reducer.keys


def test_the_daemon_gone_is_raised_not_the_deadline_it_caused():
    # The echo first in bucket order, the cause after it, others in between.
    raised, keys = _step([ECHO, ECHO, GONE])
    assert len(keys) >= 3, keys  # bucket_bytes=600: the MLP makes several buckets
    assert raised.value is GONE
    assert raised.value.__context__ is ECHO  # what was being handled, kept


def test_a_single_kind_of_failure_is_raised_as_it_is():
    raised, _ = _step([ECHO])
    assert raised.value is ECHO
