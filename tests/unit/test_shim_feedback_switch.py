"""Every shim exports set_error_feedback, with one signature and one meaning.

`set_error_feedback(enabled, reducer=None)` is a public name of each shim
(reducer_client.torch, .tensorflow, .mxnet: listed in __all__). Its meaning,
checked through each shim's own reduction path (torch: the Staging under the
DDP hook and the DistributedOptimizer; TF: the optimizers' and tapes'
GradientSteps; MXNet: the KVStore's pushpull) on a one-rank LocalGroup with
the int8 wire, so a result is what the rank sent, quantized:

One key reduced twice with values whose int8 blocks hold an outlier 1.0 and
small values 0.003, below half a quantization step (1 / 254): the first
result drops them (0) every time. With feedback the second call sends 0.006
(this call's 0.003 plus the residual 0.003), which rounds to one step,
1 / 127; without it the second result drops them again. The default (no call)
is on, as for every 8-bit wire. Each shim is tested where its framework is
installed (.venv: torch and tensorflow; .venv-mxnet: mxnet).
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
from reducer_client.testing import LocalGroup

pytestmark = pytest.mark.timeout(120)

SHIMS = {"reducer_client.torch": "torch", "reducer_client.tensorflow": "tensorflow",
         "reducer_client.mxnet": "mxnet"}
NUMEL = 1024
OUTLIER_EVERY = 32  # every int8 block (a power of two >= 32 elements) holds an outlier
SMALL = 0.003  # below half an int8 step of a block whose largest value is 1.0
STEP = 1.0 / 127  # one int8 step of such a block
# The block's scale is rounded too (reducer_wire.quant.ERROR_BOUND_DOC: a
# relative 2^-14), so a decoded value is off by that much.
SCALE_RTOL = 2.0 ** -13


def _values() -> np.ndarray:
    values = np.full(NUMEL, SMALL, np.float32)
    values[::OUTLIER_EVERY] = 1.0
    return values


def _shim(name: str):
    pytest.importorskip(SHIMS[name])
    return importlib.import_module(name)


def _reduce_torch(client) -> np.ndarray:
    import torch
    from reducer_client.torch._tensors import staging_for

    flat = torch.from_numpy(_values())
    return np.array(staging_for(client).start(client, flat, "grad", "sum").result(60))


def _reduce_tensorflow(client) -> np.ndarray:
    from reducer_client.tensorflow.steps import GradientSteps

    steps = _steps_of.setdefault(id(client), (client, GradientSteps(client, op="sum")))[1]
    return np.array(steps.allreduce(_values(), "grad", "sum"))


def _reduce_mxnet(client) -> np.ndarray:
    import mxnet as mx
    from reducer_client.mxnet import Reducer

    store = _stores.setdefault(id(client), (client, Reducer(backend=client)))[1]
    out = mx.nd.zeros(NUMEL)
    store.pushpull("grad", mx.nd.array(_values()), out=out)
    return out.asnumpy()


# One optimizer's steps / one store per client, as a training loop keeps them
# (the client is kept beside its id so the id is not reused).
_steps_of: dict[int, tuple] = {}
_stores: dict[int, tuple] = {}
REDUCE = {"reducer_client.torch": _reduce_torch,
          "reducer_client.tensorflow": _reduce_tensorflow,
          "reducer_client.mxnet": _reduce_mxnet}


def _second_small_values(name: str, client) -> np.ndarray:
    """The small elements of the key's second result (the first one checked)."""
    small = np.arange(NUMEL) % OUTLIER_EVERY != 0
    first = REDUCE[name](client)
    np.testing.assert_array_equal(first[small], 0.0)  # dropped by the int8 rounding
    np.testing.assert_allclose(first[~small], 1.0, rtol=SCALE_RTOL)
    return REDUCE[name](client)[small]


@pytest.mark.parametrize("name", SHIMS)
def test_set_error_feedback_is_exported_with_one_signature(name):
    shim = _shim(name)
    assert "set_error_feedback" in shim.__all__
    parameters = [(p.name, p.kind, p.default)
                  for p in inspect.signature(shim.set_error_feedback).parameters.values()]
    assert parameters == [("enabled", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           inspect.Parameter.empty),
                          ("reducer", inspect.Parameter.POSITIONAL_OR_KEYWORD, None)]


@pytest.mark.parametrize("name", SHIMS)
def test_set_error_feedback_switches_the_shims_feedback(name):
    shim = _shim(name)
    default, off, on = (LocalGroup(1, wire_dtype="int8").client(0) for _ in range(3))
    shim.set_error_feedback(False, off)
    shim.set_error_feedback(False, on)
    shim.set_error_feedback(True, on)  # the last call counts

    np.testing.assert_array_equal(_second_small_values(name, off), 0.0)
    for client in (default, on):
        np.testing.assert_allclose(_second_small_values(name, client), STEP, rtol=SCALE_RTOL)


@pytest.mark.parametrize("name", SHIMS)
def test_set_error_feedback_without_a_reducer_sets_the_process_wide_client(name):
    shim = _shim(name)
    client = LocalGroup(1, wire_dtype="int8").client(0)
    shim.init(reducer=client)
    try:
        shim.set_error_feedback(False)
        np.testing.assert_array_equal(_second_small_values(name, client), 0.0)
    finally:
        shim.shutdown()
