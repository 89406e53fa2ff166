"""Keras mixed precision over the 8-bit wires: an overflow reaches every rank's LossScaleOptimizer.

Real daemons on 127.0.0.1, two spawned workers, the "mixed_float16" policy
(float16 compute, float32 variables), reducer_client.tensorflow's
DistributedOptimizer wrapping keras.mixed_precision.LossScaleOptimizer
around SGD, with Keras's defaults (initial_scale 2^15, dynamic growth every
2000 steps): the wrapper reduces the scaled gradients first, so every rank's
loss scaler judges the same reduced gradients. On int8, fp8_e4m3 and
fp8_e5m2, error feedback on (the default). The case (model, data, the
injected Inf / NaN / large value on one rank, the reference's rule, the
bound) is tests/helpers/loss_scaling_case.py; the large value is 63000,
within float16's range (the gradients are float16 before they widen to the
variables' float32) and beyond both FP8 formats'. The reference is the same
training in one process: both ranks' gradients, computed by the same ops,
averaged in float32, the wire's range applied. Each runs in a custom loop
(scale_loss, GradientTape, apply) and, but for the large value (injected
relative to the scale), through model.fit. Checked: the scale's history is
the same on both ranks, equal to the reference's and to the one the data
implies; the weights are within the derived bound of the reference's.
"""

from __future__ import annotations

import uuid

import loss_scaling_case as case
import numpy as np
import pytest
from support import run_workers

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

INITIAL_SCALE = 2.0 ** 15  # Keras's LossScaleOptimizer default
LARGE = 63000.0
# model.fit too, where the data does not depend on the scale (the large
# value is injected relative to it).
FIT_SCENARIOS = ("none", "inf", "nan")
WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
              "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "tensorflow",
              "CUDA_VISIBLE_DEVICES": ""}


def _setup():
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.mixed_precision.set_global_policy("mixed_float16")
    return keras, tf


def _model(keras):
    keras.utils.set_random_seed(5)  # the same weights on every rank
    return keras.Sequential([keras.Input((case.IN,)), keras.layers.Dense(case.OUT)])


def _scaled_gradients(tf, model, opt, step, rank, scenario):
    scale = float(opt.dynamic_scale.numpy()) if opt.built else opt.initial_scale
    x = case.batch(step, rank, scenario, scale, LARGE)
    with tf.GradientTape() as tape:
        loss = case.G * tf.reduce_sum(tf.cast(model(x), tf.float32) * case.C)
        scaled = opt.scale_loss(loss)
    return tape.gradient(scaled, model.trainable_variables)


def _weights(model) -> np.ndarray:
    return np.concatenate([w.reshape(-1) for w in model.get_weights()])


def reference(wire: str, scenario: str) -> tuple[list[float], np.ndarray]:
    """One process: both ranks' gradients, averaged in float32, the wire's range applied."""
    keras, tf = _setup()
    model = _model(keras)
    opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(case.LR))
    history = []
    for step in range(case.STEPS):
        per_rank = [_scaled_gradients(tf, model, opt, step, rank, scenario)
                    for rank in range(case.WORLD)]
        beyond = case.overflows(wire, [[g.numpy() for g in grads] for grads in per_rank])
        mean = [(a.numpy() + b.numpy()) / np.float32(case.WORLD)
                for a, b in zip(*per_rank, strict=True)]
        if beyond:
            mean[0].reshape(-1)[0] = np.inf  # what the wire's contract makes of it
        opt.apply([tf.constant(g) for g in mean], model.trainable_variables)
        history.append(float(opt.dynamic_scale.numpy()))
    return history, _weights(model)


def worker(rank: int, world: int, addresses: list[str], job: str) -> dict:
    import reducer_client.tensorflow as rtf

    keras, tf = _setup()
    out = {}
    for wire in case.WIRES:
        for scenario in case.SCENARIOS:
            rtf.init(addresses=addresses, job=f"{job}-{wire}-{scenario}", rank=rank,
                     world_size=world, wire_dtype=wire, timeout=60.0)
            try:
                model = _model(keras)
                opt = rtf.DistributedOptimizer(
                    keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(case.LR)))
                history = []
                for step in range(case.STEPS):
                    grads = _scaled_gradients(tf, model, opt, step, rank, scenario)
                    opt.apply(grads, model.trainable_variables)
                    history.append(float(opt.dynamic_scale.numpy()))
                out[(wire, scenario)] = (history, _weights(model))
            finally:
                rtf.shutdown()
            if scenario in FIT_SCENARIOS:
                out[(wire, scenario, "fit")] = _fit(keras, tf, rtf, rank, world, addresses,
                                                    f"{job}-{wire}-{scenario}-fit", wire,
                                                    scenario)
    return out


def _fit(keras, tf, rtf, rank, world, addresses, job, wire, scenario):
    """The same training through model.fit, whose train step scales the loss."""
    rtf.init(addresses=addresses, job=job, rank=rank, world_size=world, wire_dtype=wire,
             timeout=60.0)
    try:
        model = _model(keras)
        opt = rtf.DistributedOptimizer(
            keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(case.LR)))

        def loss(y_true, y_pred):
            return case.G * tf.reduce_sum(tf.cast(y_pred, tf.float32) * case.C, axis=-1)

        model.compile(optimizer=opt, loss=loss, jit_compile=False)
        history: list[float] = []

        class Scales(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                history.append(float(opt.dynamic_scale.numpy()))

        xs = np.concatenate([case.batch(k, rank, scenario, INITIAL_SCALE, LARGE)
                             for k in range(case.STEPS)])
        model.fit(xs, np.zeros((case.STEPS, case.OUT), np.float32), batch_size=1,
                  shuffle=False, verbose=0, callbacks=[Scales()])
        return history, _weights(model)
    finally:
        rtf.shutdown()


def test_every_rank_skips_together_as_the_wire_range_says(daemons):
    with daemons(2, round_timeout=60) as d:
        results = run_workers(worker, case.WORLD, (d.addresses, uuid.uuid4().hex),
                              timeout=280, env=WORKER_ENV)
    # The reference runs here, in its own process too (the policy is global).
    references = run_workers(_references, 1, (), timeout=200, env=WORKER_ENV)[0]
    for wire in case.WIRES:
        for scenario in case.SCENARIOS:
            history, weights = references[(wire, scenario)]
            assert history == case.expected_history(wire, scenario, INITIAL_SCALE, LARGE), \
                (wire, scenario, history)
            got = [results[rank][(wire, scenario)] for rank in range(case.WORLD)]
            assert got[0][0] == got[1][0] == history, (wire, scenario, got[0][0])
            assert np.array_equal(got[0][1], got[1][1])  # the same weights on both ranks
            assert np.isfinite(got[0][1]).all()
            bound = case.bound(wire, history, scenario, INITIAL_SCALE, LARGE)
            error = np.abs(got[0][1].astype(np.float64) - weights).max()
            print(f"{wire} {scenario}: history {history}, error {error:.3g} <= bound {bound:.3g}")
            assert error <= bound, (wire, scenario, error, bound)
            if scenario in FIT_SCENARIOS:
                fit = [results[rank][(wire, scenario, "fit")] for rank in range(case.WORLD)]
                assert fit[0][0] == fit[1][0] == history, (wire, scenario, "fit", fit[0][0])
                assert np.array_equal(fit[0][1], fit[1][1])
                fit_error = np.abs(fit[0][1].astype(np.float64) - weights).max()
                assert fit_error <= bound, (wire, scenario, "fit", fit_error, bound)
    e4m3 = case.expected_history("fp8_e4m3", "none", INITIAL_SCALE, LARGE)
    assert e4m3[:3] == [2.0 ** 14, 2.0 ** 13, 2.0 ** 13]  # 1321, 660 > 464; 330 fits
    assert case.expected_history("fp8_e5m2", "large", INITIAL_SCALE, LARGE)[case.INJECT] \
        == 2.0 ** 14
    assert case.expected_history("int8", "large", INITIAL_SCALE, LARGE)[case.INJECT] \
        == 2.0 ** 15


def _references(rank: int, world: int) -> dict:
    return {(wire, scenario): reference(wire, scenario)
            for wire in case.WIRES for scenario in case.SCENARIOS}
