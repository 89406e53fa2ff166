"""rtf.elastic.run sees a collective that failed inside model.fit's graph as the
ReducerError it was (TensorFlow hands the caller only tf.errors.UnknownError
with the text), so it restores the last commit and runs again.

One process over a one-rank LocalGroup whose first optimizer step fails with
UNAVAILABLE, as a lost daemon would; the real-worker elastic tests are
test_tf_elastic_callbacks.py and tests/integration/test_elastic.py.
"""

from __future__ import annotations

from concurrent.futures import Future

import grpc
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import reducer_client.tensorflow as rtf  # noqa: E402
from reducer_client import ReducerError  # noqa: E402
from reducer_client.tensorflow._bridge import original_error  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class FailsOnce:
    """A one-rank Reducer whose first optimizer reduction fails with UNAVAILABLE."""

    def __init__(self) -> None:
        self.inner = LocalGroup(1).client(0)
        self.rank, self.world_size, self.timeout = 0, 1, self.inner.timeout
        self.local_rank, self.local_size, self.wire_dtype = 0, 1, self.inner.wire_dtype
        self.failed = 0

    def allreduce_async(self, array, key, op="sum", *, out=None, **kwargs):
        if "tf/optimizer" in key and not self.failed:
            self.failed += 1
            future: Future = Future()
            future.set_exception(ReducerError(grpc.StatusCode.UNAVAILABLE,
                                              "daemon 127.0.0.1:1 unavailable (injected)"))
            return future
        return self.inner.allreduce_async(array, key, op, out=out, **kwargs)

    def allreduce(self, array, key, op="sum", *, out=None, **kwargs):
        return self.allreduce_async(array, key, op, out=out, **kwargs).result()

    def broadcast_async(self, array, key, root_rank=0):
        return self.inner.broadcast_async(array, key, root_rank)

    def broadcast(self, array, key, root_rank=0):
        return self.inner.broadcast(array, key, root_rank)

    def close(self):
        self.inner.close()


def test_a_failed_step_in_fit_resets_as_a_reducer_error():
    reducer = FailsOnce()
    rtf.init(reducer)
    try:
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=rtf.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="mse", jit_compile=False)
        w0 = [w.copy() for w in model.get_weights()]
        x = np.arange(24, dtype=np.float32).reshape(8, 3) / 24
        y = x.sum(axis=1, keepdims=True)
        state = rtf.elastic.KerasState(model, epoch=0)
        errors: list[BaseException] = []
        starts: list[list[np.ndarray]] = []

        @rtf.elastic.run
        def train(state):
            starts.append([w.copy() for w in state.model.get_weights()])
            try:
                state.model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
            except Exception as exc:
                errors.append(exc)
                raise
        train(state)
        assert reducer.failed == 1 and len(starts) == 2
        # What fit raised is TensorFlow's wrapper; elastic.run saw the ReducerError.
        assert isinstance(errors[0], tf.errors.OpError)
        original = original_error(errors[0])
        assert isinstance(original, ReducerError) and original.code.name == "UNAVAILABLE"
        for got, want in zip(starts[1], w0, strict=True):  # restored, then ran again
            np.testing.assert_array_equal(got, want)
        assert state.epoch == 0 and not np.array_equal(model.get_weights()[0], w0[0])
    finally:
        rtf.shutdown()


def test_other_errors_are_not_taken_for_ours():
    assert original_error(ValueError("ReducerError")) is None
    assert original_error(tf.errors.UnknownError(None, None, "some other op failed")) is None
