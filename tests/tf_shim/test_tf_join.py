"""join() in reducer_client.tensorflow: uneven inputs, real daemons, 2 worker processes.

Each rank trains on its own batches of B = 4 rows, the ranks with different
numbers of batches; a rank out of data calls rtf.join(). At step k the
ranks that still have a batch k average their mean-loss gradients, which
for equal batch sizes is the gradient of the mean loss over the union of
those batches: so the distributed run must follow one process training, at
step k, on the union of the ranks' batch k. The reference is that process
in float64 (NumPy, the same MLP, MSE and Keras SGD update rule).

Scenarios in one launch (TensorFlow's import costs seconds per process):
A. model.fit with DistributedOptimizer(SGD, momentum 0.9), rank 0 7 batches,
   rank 1 4; join() returns 0 on both; both end with rank 0's model and
   optimizer state (momentum slots, iterations = 7).
B. custom tf.function loop with DistributedGradientTape and plain SGD,
   rank 0 3 steps, rank 1 6; join() returns 1.
C. rank 1 joins at once; rank 0's allreduce means divide by 1 rank.

Bound (float32 run against the float64 reference), per weight element:
each float32 gradient element comes out of dot products of at most K = 16
terms and a tanh, so it is off by at most about c*u*gmax with u = 2^-24,
c = 2K + 4 (K-term sums, tanh, the daemon's float32 mean; the float32 wire
is exact); each update adds the rounding of the weight, u*wmax. Over T
steps with momentum beta (effective step lr/(1-beta)) that adds up to
T * (lr/(1-beta) * c*u*gmax + 2*u*wmax); the nonlinear dynamics may amplify
it, for which we allow AMPLIFY = 10. gmax and wmax come from the reference.
The check has teeth: the same reference with "mean" divided by the world
size (a joined rank counted) is checked to differ by more than 10x the bound.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from support import run_workers

pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(300)

WORLD_SIZE = 2
B = 4                      # rows per rank per step
FIT_STEPS = (7, 4)         # scenario A: batches of rank 0, rank 1
TAPE_STEPS = (3, 6)        # scenario B
LR, MOMENTUM = 0.05, 0.9
U = 2.0 ** -24
K = 16
AMPLIFY = 10.0
WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
              "OMP_NUM_THREADS": "1", "KERAS_BACKEND": "tensorflow",
              "CUDA_VISIBLE_DEVICES": ""}


def batch(scenario: str, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([ord(scenario), rank, step])
    x = rng.normal(size=(B, 8)).astype(np.float32)
    y = np.sin(x @ np.linspace(-1.0, 1.0, 8)[:, None]).astype(np.float32)
    return x, y


def join_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import keras
    import reducer_client.tensorflow as rtf
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    rtf.init(addresses=addresses, job=job, rank=rank, world_size=world_size,
             wire_dtype="float32", timeout=30.0)
    out: dict = {}

    def model() -> keras.Model:
        keras.utils.set_random_seed(11)  # the same weights on every rank
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(1)])

    # A: model.fit, momentum SGD, uneven batches.
    fit_model = model()
    out["fit_w0"] = [w.copy() for w in fit_model.get_weights()]
    xs, ys = zip(*[batch("A", rank, k) for k in range(FIT_STEPS[rank])], strict=True)
    fit_opt = rtf.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM))
    fit_model.compile(optimizer=fit_opt, loss="mse", jit_compile=False)
    fit_model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=B, epochs=1,
                  shuffle=False, verbose=0)
    out["fit_last"] = rtf.join()
    out["fit_w"] = [w.copy() for w in fit_model.get_weights()]
    out["fit_iterations"] = int(fit_opt.iterations.numpy())
    out["fit_slots"] = [np.array(v.numpy()) for v in fit_opt.variables]

    # B: DistributedGradientTape in a tf.function, plain SGD.
    tape_model = model()
    out["tape_w0"] = [w.copy() for w in tape_model.get_weights()]
    tape_opt = keras.optimizers.SGD(LR)

    @tf.function(jit_compile=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tape_model(x, training=True) - y))
        tape = rtf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, tape_model.trainable_variables)
        tape_opt.apply_gradients(zip(grads, tape_model.trainable_variables, strict=True))

    for k in range(TAPE_STEPS[rank]):
        step(*batch("B", rank, k))
    out["tape_last"] = rtf.join()
    out["tape_w"] = [w.copy() for w in tape_model.get_weights()]

    # C: rank 1 joins at once; rank 0's means are over the one rank left.
    if rank == 0:
        out["mean"] = rtf.allreduce(tf.constant([2.0, 4.0]), name="c").numpy().tolist()
        out["sum"] = rtf.allreduce(tf.constant([1.0]), name="c", op=rtf.Sum).numpy().tolist()
    out["c_last"] = rtf.join()
    rtf.shutdown()
    return out


# -- the float64 reference ----------------------------------------------------

def _grads(w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradients of mean((tanh(x W1 + b1) W2 + b2 - y)^2)."""
    w1, b1, w2, b2 = w
    h = np.tanh(x @ w1 + b1)
    dp = 2.0 * (h @ w2 + b2 - y) / y.size
    dz = (dp @ w2.T) * (1.0 - h * h)
    return [x.T @ dz, dz.sum(axis=0), h.T @ dp, dp.sum(axis=0)]


def reference(w0: list, scenario: str, steps: tuple[int, ...], momentum: float,
              divide_by_world: bool = False) -> tuple[list[np.ndarray], float, float]:
    """Training on the union of the ranks' step-k batches; (weights, gmax, wmax).

    divide_by_world: the wrong answer (a joined rank's zeros counted in the mean).
    """
    w = [np.array(a, np.float64) for a in w0]
    m = [np.zeros_like(a) for a in w]
    gmax = wmax = 0.0
    for k in range(max(steps)):
        active = [r for r in range(len(steps)) if k < steps[r]]
        x = np.concatenate([batch(scenario, r, k)[0] for r in active]).astype(np.float64)
        y = np.concatenate([batch(scenario, r, k)[1] for r in active]).astype(np.float64)
        g = _grads(w, x, y)
        if divide_by_world:
            g = [gi * len(active) / len(steps) for gi in g]
        gmax = max(gmax, *(float(np.abs(gi).max()) for gi in g))
        for i in range(len(w)):
            m[i] = momentum * m[i] - LR * g[i]
            w[i] = w[i] + m[i]
        wmax = max(wmax, *(float(np.abs(wi).max()) for wi in w))
    return w, gmax, wmax


def bound(steps: tuple[int, ...], momentum: float, gmax: float, wmax: float) -> float:
    lr_eff = LR / (1.0 - momentum)
    return AMPLIFY * max(steps) * (lr_eff * (2 * K + 4) * U * gmax + 2 * U * wmax)


def test_join_with_uneven_batches_matches_one_process_on_the_union(daemons):
    with daemons(2, round_timeout=60) as d:
        results = run_workers(join_worker, WORLD_SIZE, (d.addresses, uuid.uuid4().hex),
                              timeout=240, env=WORKER_ENV)
    first, second = results
    assert [r["fit_last"] for r in results] == [0, 0]   # rank 0 had the most batches
    assert [r["tape_last"] for r in results] == [1, 1]
    assert [r["c_last"] for r in results] == [0, 0]
    assert first["mean"] == [2.0, 4.0] and first["sum"] == [1.0]  # over the rank still in
    # After join every rank holds the last rank's model and optimizer state.
    for a, b in zip(first["fit_w"] + first["fit_slots"], second["fit_w"] + second["fit_slots"],
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert first["fit_iterations"] == second["fit_iterations"] == FIT_STEPS[0]
    for a, b in zip(first["tape_w"], second["tape_w"], strict=True):
        np.testing.assert_array_equal(a, b)

    for name, steps, momentum in (("fit", FIT_STEPS, MOMENTUM), ("tape", TAPE_STEPS, 0.0)):
        scenario = "A" if name == "fit" else "B"
        want, gmax, wmax = reference(first[f"{name}_w0"], scenario, steps, momentum)
        wrong, _, _ = reference(first[f"{name}_w0"], scenario, steps, momentum,
                                divide_by_world=True)
        tol = bound(steps, momentum, gmax, wmax)
        error = max(float(np.abs(g - w).max()) for g, w in zip(first[f"{name}_w"], want,
                                                                strict=True))
        teeth = max(float(np.abs(a - b).max()) for a, b in zip(wrong, want, strict=True))
        print(f"{name}: max |run - float64 reference| {error:.2e}, bound {tol:.2e}, "
              f"wrong divisor off by {teeth:.2e}")
        assert error <= tol, (name, error, tol)
        assert teeth > 10 * tol, (name, teeth, tol)
