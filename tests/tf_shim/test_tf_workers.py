"""reducer_client.tensorflow with real daemons and real worker processes.

Each launch runs several scenarios in the same workers, because importing
TensorFlow costs seconds per process. Every worker trains on its share of one
synthetic dataset: for global batch i of B rows, worker r takes rows
[i*B + r*b, i*B + (r+1)*b) with b = B / world_size. Averaging the workers'
gradients of their mean losses then gives the gradient of the mean loss over
the whole global batch, so distributed training must follow single-process
training on the whole batch (computed by rank 0 in the same launch).

Tolerances:
- float16 wire (the default): each worker's gradient is rounded to float16
  (relative error <= 2^-11), the daemon sums in float32 and rounds the mean to
  float16 again, so each averaged gradient element is off by at most about
  2^-10 (~1e-3) of its size. Over T = 24 steps the weights drift by at most
  about lr_eff * T * 1e-3 * max|g|: dense model (SGD lr 0.05, max|g| ~0.7)
  0.8e-3; embedding model (lr 0.2, momentum 0.5, so lr_eff 0.4, max|g| ~0.3)
  2.9e-3. We allow atol 5e-3 for the nonlinear dynamics; measured: about
  2e-5 and 8e-6 (rounding errors have mixed signs and mostly cancel).
- float32 wire: only the order of float32 additions differs (per-worker means
  versus one mean), ~1e-7 relative per step; we allow atol 1e-5 (measured
  1.5e-7).
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import reducer_client.tensorflow as rtf  # noqa: E402
from reducer_client import ReducerError  # noqa: E402
from support import run_workers  # noqa: E402

GLOBAL_BATCH = 32
SAMPLES = 256            # 8 global batches per epoch
EPOCHS = 3
LR = 0.05
F16_ATOL = 5e-3          # see the module docstring
F32_ATOL = 1e-5
WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
              "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "tensorflow",
              "CUDA_VISIBLE_DEVICES": ""}


# -- shared by workers and reference ------------------------------------------

def _dataset() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SAMPLES, 8)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(8, 1))).astype(np.float32)
    tokens = rng.integers(0, 40, size=(SAMPLES, 5)).astype(np.int32)
    y_tokens = (tokens % 7 == 0).mean(axis=1, keepdims=True).astype(np.float32)
    return x, y, tokens, y_tokens


def _share(array: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This worker's rows of every global batch, in order."""
    per_worker = GLOBAL_BATCH // world_size
    batches = array.reshape(SAMPLES // GLOBAL_BATCH, world_size, per_worker, *array.shape[1:])
    return batches[:, rank].reshape(-1, *array.shape[1:])


def _dense_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1)])


def _embedding_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(40, 4),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def _embedding_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.2, momentum=0.5)


def _fit(model, x, y, batch_size, optimizer, callbacks=()) -> list[np.ndarray]:
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=list(callbacks))
    return [w.copy() for w in model.get_weights()]


def _custom_loop(model, x, y, batch_size, optimizer, distributed: bool) -> list[np.ndarray]:
    @tf.function(jit_compile=False)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        if distributed:
            tape = rtf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    for _ in range(EPOCHS):
        for start in range(0, len(x), batch_size):
            step(x[start:start + batch_size], y[start:start + batch_size])
    return [w.copy() for w in model.get_weights()]


def _limit_threads() -> None:
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:  # the runtime was already initialised
        pass


# -- the worker --------------------------------------------------------------

class _Snapshot(keras.callbacks.Callback):
    """Weights at the start of training (after the broadcast callback ran)."""

    def on_train_begin(self, logs=None):
        self.weights = [w.copy() for w in self.model.get_weights()]


def train_worker(rank: int, world_size: int, addresses: list[str]) -> dict:
    _limit_threads()
    x, y, tokens, y_tokens = _dataset()
    b = GLOBAL_BATCH // world_size
    out: dict = {}
    rtf.init(addresses=addresses, job=f"tf-{world_size}", rank=rank, world_size=world_size)
    assert (rtf.rank(), rtf.size()) == (rank, world_size)

    # 1. model.fit, differently initialised on every rank; the callback
    # broadcasts rank 0's weights (seed 100) before the first step.
    model = _dense_model(seed=100 + 7 * rank)
    out["init_before"] = [w.copy() for w in model.get_weights()]
    snapshot = _Snapshot()
    out["fit"] = _fit(model, _share(x, rank, world_size), _share(y, rank, world_size), b,
                      rtf.DistributedOptimizer(keras.optimizers.SGD(LR)),
                      [rtf.BroadcastGlobalVariablesCallback(root_rank=0), snapshot])
    out["init_after"] = snapshot.weights

    # 2. Embedding model (IndexedSlices gradients), same seed everywhere. SGD
    # with momentum: Keras 3's Adam squares IndexedSlices per occurrence of a
    # repeated index, so on raw slices it does not follow the true gradient
    # that the shim reduces (see test_tf_shim.py).
    out["embedding"] = _fit(_embedding_model(seed=5), _share(tokens, rank, world_size),
                            _share(y_tokens, rank, world_size), b,
                            rtf.DistributedOptimizer(_embedding_optimizer()))

    # 3. Custom loop, DistributedGradientTape in a tf.function, float32 wire;
    # initial weights from rank 0 by broadcast_variables.
    rtf.init(addresses=addresses, job=f"tf-{world_size}-f32", rank=rank,
             world_size=world_size, wire_dtype="float32")
    model = _dense_model(seed=300 + rank)
    rtf.broadcast_variables(model.variables, root_rank=0)
    out["loop"] = _custom_loop(model, _share(x, rank, world_size), _share(y, rank, world_size),
                               b, keras.optimizers.SGD(LR, momentum=0.9), distributed=True)
    rtf.shutdown()

    if rank == 0:  # single-process references on the whole batch
        out["ref_fit"] = _fit(_dense_model(seed=100), x, y, GLOBAL_BATCH,
                              keras.optimizers.SGD(LR))
        out["ref_embedding"] = _fit(_embedding_model(seed=5), tokens, y_tokens, GLOBAL_BATCH,
                                    _embedding_optimizer())
        out["ref_loop"] = _custom_loop(_dense_model(seed=300), x, y, GLOBAL_BATCH,
                                       keras.optimizers.SGD(LR, momentum=0.9),
                                       distributed=False)
    return out


def _assert_close(actual, expected, atol, what):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        np.testing.assert_allclose(a, e, rtol=0, atol=atol, err_msg=f"{what}, weight {i}")


@pytest.mark.parametrize("world_size", [4])  # 2 ranks ran the same paths, 8 s more
def test_training_matches_single_process(daemons, world_size):
    """fit + broadcast callback, Embedding model, custom tape loop vs. one process."""
    with daemons(2, round_timeout=60) as d:
        results = run_workers(train_worker, world_size, args=(d.addresses,), timeout=240,
                              env=WORKER_ENV)
    ref = results[0]
    # The ranks started from different weights ...
    assert not np.array_equal(results[0]["init_before"][0], results[1]["init_before"][0])
    for rank, result in enumerate(results):
        # ... the callback made them rank 0's, bit for bit ...
        for got, want in zip(result["init_after"], ref["init_before"], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} after broadcast")
        # ... and every rank applied the same reduced gradients, so they stay equal.
        for scenario in ("fit", "embedding", "loop"):
            for got, want in zip(result[scenario], ref[scenario], strict=True):
                np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} {scenario}")
    _assert_close(ref["fit"], ref["ref_fit"], F16_ATOL, "model.fit, float16 wire")
    _assert_close(ref["embedding"], ref["ref_embedding"], F16_ATOL, "Embedding, float16 wire")
    _assert_close(ref["loop"], ref["ref_loop"], F32_ATOL, "tape loop, float32 wire")
    # Training moved the weights well beyond the tolerance (the check has teeth).
    assert np.abs(ref["fit"][0] - ref["init_before"][0]).max() > 10 * F16_ATOL
    moved = np.abs(ref["embedding"][0] - _embedding_model(seed=5).get_weights()[0]).max()
    assert moved > 10 * F16_ATOL
    errors = {name: max(np.abs(a - e).max()
                        for a, e in zip(ref[name], ref[f"ref_{name}"], strict=True))
              for name in ("fit", "embedding", "loop")}
    print(f"world_size {world_size}: max |distributed - single process| {errors}")


# -- failures ----------------------------------------------------------------

@pytest.fixture
def dead_address():
    """An address where nothing answers: a bound port that never listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def tf_state():
    yield
    rtf.shutdown()


def test_daemon_down_is_a_clear_error(daemons, dead_address, tf_state):
    """Scenario: one of two daemons is down. Eagerly the tape raises ReducerError
    UNAVAILABLE naming the dead daemon; model.fit fails with TensorFlow's wrapper
    of the same error; both within the client's timeout, no hang."""
    with daemons(1) as d:
        # Chunks of 128 bytes: the model's small gradient key is then spread over
        # both daemons (a key under a chunk's floor per daemon would go to one,
        # by its CRC, and might never need the dead one).
        rtf.init(addresses=[d.addresses[0], dead_address], job="tf-down", rank=0,
                 world_size=1, timeout=2.0, chunk_bytes=128)
        model = _dense_model(seed=1)
        x, y, _, _ = _dataset()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[:8]) - y[:8]))
        with pytest.raises(ReducerError) as excinfo:
            rtf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        assert excinfo.value.code.name == "UNAVAILABLE"
        assert dead_address in str(excinfo.value)

        model.compile(optimizer=rtf.DistributedOptimizer(keras.optimizers.SGD(LR)),
                      loss="mse", jit_compile=False)
        with pytest.raises(tf.errors.OpError, match="ReducerError") as excinfo:
            model.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0)
        assert dead_address in str(excinfo.value)


def test_missing_worker_is_a_clear_error(daemons, tf_state):
    """Scenario: world_size 2 but rank 1 never comes. The daemon's round timeout
    fails the step with DEADLINE_EXCEEDED naming the missing rank."""
    with daemons(1, round_timeout=1) as d:
        rtf.init(addresses=d.addresses, job="tf-missing", rank=0, world_size=2, timeout=10.0)
        with pytest.raises(ReducerError) as excinfo:
            rtf.allreduce(tf.ones([4]), name="lonely")
    assert excinfo.value.code.name == "DEADLINE_EXCEEDED"
    assert "1" in str(excinfo.value) and "lonely" in str(excinfo.value)

