"""Horovod's Keras elastic callbacks (rtf.elastic.CommitStateCallback,
UpdateBatchStateCallback, UpdateEpochStateCallback) on 2 real workers.

Both ranks fit the same data under rtf.elastic.run with a KerasState,
SGD with momentum 0.9, 6 batches per epoch, 3 epochs, a commit every 2
batches. In epoch 1, after batch 2 (a commit after batch 1), every rank
fails (a ReducerError, as a lost round would raise): elastic.run restores
the last commit (weights, momentum, iterations; state.batch 1, state.epoch
1), starts a new incarnation and runs the fit again with epochs 3 - 1, as
Horovod's examples do. With Horovod's meaning, that fit's first epoch runs
6 - state.batch = 5 batches and state.epoch ends at 3.

Both ranks hold the same data, so each averaged gradient is the local one
exactly (float32 wire: g + g and the halving are exact) and the run must
equal one process taking the same batches: epoch 0 (6), batches 0-1 of
epoch 1, then after the restore 5 batches and 6 batches (rtol 1e-6, for
any difference in the order of float32 operations between the graphs).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from support import run_workers

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

STEPS, B, EPOCHS = 6, 4, 3
FAIL_AT = (1, 2)  # (epoch, batch) after which every rank fails, once
WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
              "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "tensorflow",
              "CUDA_VISIBLE_DEVICES": ""}


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(STEPS * B, 3)).astype(np.float32)
    return x, np.tanh(x @ np.array([[1.0], [-2.0], [0.5]])).astype(np.float32)


def elastic_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import grpc
    import keras
    import reducer_client.tensorflow as rtf
    import tensorflow as tf
    from reducer_client import ReducerError

    tf.config.threading.set_intra_op_parallelism_threads(1)
    rtf.init(addresses=addresses, job=job, rank=rank, world_size=world_size,
             wire_dtype="float32", timeout=30.0)
    x, y = dataset()

    def model() -> keras.Model:
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                                 keras.layers.Dense(1)])

    out: dict = {"starts": [], "batches": [], "commits": []}
    distributed = model()
    out["w0"] = [w.copy() for w in distributed.get_weights()]
    distributed.compile(optimizer=rtf.DistributedOptimizer(keras.optimizers.SGD(0.05,
                                                                                momentum=0.9)),
                        loss="mse", jit_compile=False)
    state = rtf.elastic.KerasState(distributed, batch=0, epoch=0)
    saved_commit = state.commit

    def commit() -> None:
        out["commits"].append((state.epoch, state.batch))
        saved_commit()
    state.commit = commit
    failed = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            out["batches"].append(0)

        def on_train_batch_end(self, batch, logs=None):
            out["batches"][-1] += 1
            if not failed and (state.epoch, batch) == FAIL_AT:
                failed.append(True)
                raise ReducerError(grpc.StatusCode.UNAVAILABLE, "injected: a round was lost")

    @rtf.elastic.run
    def train(state):
        out["starts"].append((state.epoch, state.batch,
                              [w.copy() for w in state.model.get_weights()]))
        state.model.fit(x, y, batch_size=B, epochs=EPOCHS - state.epoch, shuffle=False,
                        verbose=0, callbacks=[rtf.elastic.UpdateBatchStateCallback(state),
                                              rtf.elastic.UpdateEpochStateCallback(state),
                                              rtf.elastic.CommitStateCallback(state, 2),
                                              Record()])
    train(state)
    out["end"] = (state.epoch, state.batch)
    out["w"] = [w.copy() for w in distributed.get_weights()]
    out["iterations"] = int(distributed.optimizer.iterations.numpy())

    if rank == 0:  # one process taking the batches the elastic run should have taken
        reference = model()
        reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                          jit_compile=False)
        taken = [range(STEPS), range(2)]  # epoch 0; epoch 1 up to the commit after batch 1
        for epoch_batches in taken:
            for k in epoch_batches:
                reference.train_on_batch(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        out["committed_ref"] = [w.copy() for w in reference.get_weights()]
        for epoch_batches in (range(STEPS - 1), range(STEPS)):  # after the restore
            for k in epoch_batches:
                reference.train_on_batch(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        out["ref"] = [w.copy() for w in reference.get_weights()]
    rtf.shutdown()
    return out


def test_keras_elastic_callbacks_commit_restore_and_resume(daemons):
    with daemons(2, round_timeout=60) as d:
        results = run_workers(elastic_worker, 2, (d.addresses, uuid.uuid4().hex),
                              timeout=280, env=WORKER_ENV)
    first, second = results
    for out in results:
        # Commits every 2 batches and at each epoch's end, with Horovod's batch
        # index (of the last finished batch) and epoch count.
        assert out["commits"][:4] == [(0, 1), (0, 3), (0, 5), (1, 0)], out["commits"]
        assert out["commits"][4] == (1, 1)  # the last commit before the failure
        # Two fits: the first failed in its second epoch; the second began at the commit.
        assert [s[:2] for s in out["starts"]] == [(0, 0), (1, 1)]
        assert out["batches"] == [6, 3, 5, 6]  # epoch 1 again from the commit: 6 - 1 batches
        assert out["end"] == (EPOCHS, 0)
        assert out["iterations"] == 6 + 2 + 5 + 6
    for a, b in zip(first["w"], second["w"], strict=True):
        np.testing.assert_array_equal(a, b)
    # The second fit started from the committed weights, not those of the failed step.
    for got, want in zip(first["starts"][1][2], first["committed_ref"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(first["w"], first["ref"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert max(np.abs(a - b).max() for a, b in zip(first["ref"], first["w0"], strict=True)) > 0.01
