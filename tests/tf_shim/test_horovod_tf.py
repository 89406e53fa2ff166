"""Horovod's TensorFlow / Keras API with real worker processes on real daemons.

Scenario 1 (the callbacks' bug and meaning): each rank builds an unbuilt
Sequential (no Input) from its own seed and fits with
BroadcastGlobalVariablesCallback, MetricAverageCallback and
LearningRateWarmupCallback: fit must run (it failed with "Unknown
variable"), every rank must end with the same weights, the metrics each
rank sees must be the averages, and the learning rate must follow
Horovod's warmup formula.

Scenario 2 (backward_passes_per_step with average_aggregated_gradients):
ranks start from the same weights; every second step applies the mean of
two steps' gradients over both ranks, once reduced; compared with that
update computed in float64.

Scenario 3 (the collectives): allgather of uneven rows, grouped_allreduce,
broadcast_object, and a shape mismatch that fails both ranks at once.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from support import run_workers

pytest.importorskip("tensorflow")

WORLD_SIZE = 2


def _data(rank: int, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def keras_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import keras
    import reducer_client.tensorflow.keras as hvd
    import tensorflow as tf

    hvd.init(addresses=addresses, job=job, rank=rank, world_size=world_size,
             wire_dtype="float32", timeout=30.0)
    out: dict = {}
    # 1: callbacks on a model Keras builds in its first step.
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    lr = 0.01 * hvd.size()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr)), loss="mse",
                  jit_compile=False)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(dict(logs))
    x, y = _data(rank)
    model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2),
        Record()])
    out["weights"] = [w.tolist() for w in model.get_weights()]
    out["seen"] = seen
    # 2: two steps per update, averaged.
    keras.utils.set_random_seed(7)
    dense = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    out["w0"] = [w.tolist() for w in dense.get_weights()]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                   average_aggregated_gradients=True,
                                   compression=hvd.Compression.none)
    dense.compile(optimizer=opt, loss="mse", jit_compile=False)
    dense.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    out["w_aggregated"] = [w.tolist() for w in dense.get_weights()]
    out["iterations"] = int(opt.iterations.numpy())
    # 3: collectives.
    out["gathered"] = hvd.allgather(tf.fill([rank + 1, 2], float(rank))).numpy().tolist()
    out["grouped"] = [t.numpy().tolist() for t in hvd.grouped_allreduce(
        [tf.constant([1.0 + rank]), tf.constant([[2.0 * rank]], tf.float64)], op=hvd.Sum)]
    out["object"] = hvd.broadcast_object({"from": rank}, root_rank=1)
    start = time.monotonic()
    try:
        hvd.allreduce(tf.zeros([2, 3] if rank == 0 else [3, 2]))
        out["mismatch"] = ("no error", 0.0)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["mismatch"] = (str(exc), time.monotonic() - start)
    hvd.shutdown()
    return out


def _aggregated_reference(w0: list) -> list[np.ndarray]:
    """SGD(0.1) where each update is the mean over 2 steps and 2 ranks of MSE gradients."""
    kernel, bias = np.array(w0[0], np.float64), np.array(w0[1], np.float64)
    data = [_data(r) for r in range(WORLD_SIZE)]
    for update in range(2):  # 16 samples / batch 4 = 4 steps = 2 updates
        grads_k, grads_b = [], []
        for x, y in data:
            for step in (2 * update, 2 * update + 1):
                xb, yb = x[4 * step:4 * step + 4].astype(np.float64), y[4 * step:4 * step + 4]
                err = xb @ kernel + bias - yb
                grads_k.append(2 * xb.T @ err / len(xb))
                grads_b.append(2 * err.mean(axis=0))
        kernel = kernel - 0.1 * np.mean(grads_k, axis=0)
        bias = bias - 0.1 * np.mean(grads_b, axis=0)
    return [kernel, bias]


def test_keras_callbacks_aggregation_and_collectives(daemons):
    with daemons(2) as d:
        results = run_workers(keras_worker, WORLD_SIZE, (d.addresses, uuid.uuid4().hex),
                              timeout=240)
    first, second = results
    for a, b in zip(first["weights"], second["weights"], strict=True):
        np.testing.assert_array_equal(a, b)  # the unbuilt model was synchronized
    for epoch, (logs_a, logs_b) in enumerate(zip(first["seen"], second["seen"], strict=True)):
        assert logs_a["loss"] == pytest.approx(logs_b["loss"], rel=1e-6)  # averaged
        if epoch < 2:  # Horovod's warmup: lr/size * (e * (size - 1) / warmup + 1)
            e = epoch + 3 / 4 + 1 / 4  # the last batch (3 of 4 steps), plus 1 / steps
            expected = 0.02 / 2 * (e * (2 - 1) / 2 + 1)
            assert logs_a["lr"] == pytest.approx(expected, rel=1e-5)
    reference = _aggregated_reference(first["w0"])
    for out in results:
        assert out["iterations"] == 2  # applied updates
        for got, want in zip(out["w_aggregated"], reference, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert out["gathered"] == [[0, 0], [1, 1], [1, 1]]
        assert out["grouped"] == [[3.0], [[2.0]]]
        assert out["object"] == {"from": 1}
        message, seconds = out["mismatch"]
        assert "shape" in message and "rank 0: (2, 3)" in message and seconds < 5.0
