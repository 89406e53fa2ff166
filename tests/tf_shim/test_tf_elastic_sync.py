"""rtf.elastic.KerasState.sync makes the synced state the commit, as TorchState's does.

A worker that joins a running job (REDUCER_ELASTIC_JOIN=1) is reset and
synced from rank 0; if a later failure rolls it back, it must go back to
that synced state, not to the one it started with. One process over a
one-rank LocalGroup (the synced values are then this rank's own, the ones
it held at sync; the real-worker join test is
tests/integration/test_elastic_add_worker.py): commit w0, move to w1 without
a commit, sync, move to w2, restore: the model and the optimizer's
variables are w1's.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import reducer_client.tensorflow as rtf  # noqa: E402
from reducer_client import elastic as core_elastic  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _values(state) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in state._variables()]


def _assign(state, shift: float) -> None:
    """Every variable (model and optimizer) to a value of its own, offset by shift."""
    for index, variable in enumerate(state._variables()):
        dtype = np.dtype(variable.dtype)  # Keras 3 names it ("float32", "int64")
        variable.assign(np.full(variable.shape, shift + index, dtype))


def test_restore_after_sync_returns_the_synced_values():
    rtf.init(reducer=LocalGroup(1).client(0))
    try:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
        state = rtf.elastic.KerasState(model, optimizer=optimizer, epoch=0)
        assert len(optimizer.variables) > 1  # the momenta are in the state too
        committed = _values(state)

        _assign(state, 10.0)
        synced = _values(state)
        state.sync()
        assert all(np.array_equal(a, b) for a, b in zip(_values(state), synced, strict=True))

        _assign(state, 20.0)
        state.restore()
        restored = _values(state)
        assert all(np.array_equal(a, b) for a, b in zip(restored, synced, strict=True))
        assert not all(np.array_equal(a, b) for a, b in zip(restored, committed, strict=True))
    finally:
        rtf.shutdown()


def test_hosts_updated_interrupt_is_exported_as_torch_does():
    assert "HostsUpdatedInterrupt" in rtf.elastic.__all__
    assert rtf.elastic.HostsUpdatedInterrupt is core_elastic.HostsUpdatedInterrupt
