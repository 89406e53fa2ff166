"""Training parity on the 8-bit wire in the MXNet shim: error feedback keeps int8 close to float32.

The torch and TF parity tests' setup (tests/torch_shim/test_quant_training.py,
tests/tf_shim/test_tf_feedback.py), on 2 real worker processes and real
daemons: a small MLP learns a teacher's function with Adam; one input
feature, which the teacher ignores, is 300x the scale of the others, so its
weights' gradients share int8 blocks with gradients ~300x smaller, which
round to zero on every step unless error feedback carries them into later
steps. gluon's Dense keeps its weight as (units, inputs), as torch's Linear
does, so the loud feature's weights are one element in every 16 of the
first layer's and every int8 block of it holds some. After the same steps
on the same per-rank batches, int8 with error feedback (the default for
int8) reaches a final loss within MARGIN (15 %, the torch test's) of
float32 training, with DistributedTrainer (one averaging pushpull of all
gradients per step, packed) and with a plain gluon.Trainer on the "reducer"
KVStore (a summing pushpull per parameter, trainer.step(world_size * batch)).
Without feedback (DistributedTrainer(error_feedback=False)) the difference
is printed, not checked.

Measured (the runs are deterministic: same data, same sums): at STEPS = 400,
int8 with feedback +6.1 % (DistributedTrainer) and +2.3 % (KVStore), without
feedback +8.3 %. 400 steps, not the torch test's 150: here the loss after
150 steps is still far from its floor and the int8 runs land 20-70 % above
or below float32 depending on the initial weights' seed (seed 0: +73 % and
+27 % with feedback, +159 % without; seeds 1 and 2: -19 % to -41 %), so
150 steps say nothing stable about the wire. At 400 the feedback runs are
within 12 % for seeds 0 and 1, and without feedback too (+8.3 %, -14.5 %):
the difference feedback makes shows in the sums (test_mxnet_feedback.py)
more than in this model's converged loss.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from support import run_workers

pytest.importorskip("mxnet")

pytestmark = pytest.mark.timeout(300)

STEPS = 400
B = 16
LR = 0.01
MARGIN = 0.15  # relative to the float32 run's final loss
# (wire, error_feedback for the store's client: None = the default, how it trains)
SYSTEMS = (("float32", None, "trainer"), ("int8", None, "trainer"),
           ("int8", False, "trainer"), ("int8", None, "kvstore"))
WORKER_ENV = {"MXNET_CPU_WORKER_NTHREADS": "1", "OMP_NUM_THREADS": "1"}

_TEACHER = np.random.default_rng(123)
_T1 = _TEACHER.normal(size=(16, 32)) / 4
_T2 = _TEACHER.normal(size=(32, 4)) / np.sqrt(32)
_SCALE = np.array([300.0] + [1.0] * 15)  # feature 0: loud, and ignored by the teacher
_USED = np.array([0.0] + [1.0] * 15)


def data(step: int, rank: int, n: int = B) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng([step, rank])
    z = gen.normal(size=(n, 16))
    y = np.tanh((z * _USED) @ _T1) @ _T2 + 0.01 * gen.normal(size=(n, 4))
    return (z * _SCALE).astype(np.float32), y.astype(np.float32)


def system_name(wire: str, feedback: bool | None, how: str) -> str:
    fed = wire in ("int8", "fp8_e4m3", "fp8_e5m2") and feedback is not False
    return f"{wire}{'+feedback' if fed else ''} {how}"


def parity_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import mxnet as mx
    import reducer_client.mxnet as rmx
    from mxnet import autograd, gluon
    from reducer_client import ReducerClient

    def student():
        mx.random.seed(0)  # the same weights on every rank
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(64, in_units=16, activation="tanh"),
                gluon.nn.Dense(64, in_units=64, activation="tanh"),
                gluon.nn.Dense(4, in_units=64))
        net.initialize(mx.init.Xavier())
        return net

    x_eval, y_eval = data(10 ** 6, 0, 512)
    losses, weights = {}, {}
    for wire, feedback, how in SYSTEMS:
        name = system_name(wire, feedback, how)
        with ReducerClient(addresses, job=f"{job}-{name.replace(' ', '-')}", rank=rank,
                           world_size=world_size, wire_dtype=wire, timeout=60.0) as client:
            net = student()
            if how == "trainer":
                trainer = rmx.DistributedTrainer(
                    net.collect_params(), "adam", {"learning_rate": LR},
                    kvstore=rmx.Reducer(op="mean", backend=client), error_feedback=feedback)
                batch = B  # the store averages over the workers
            else:
                trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": LR},
                                        kvstore=rmx.Reducer(backend=client,
                                                            error_feedback=feedback))
                batch = world_size * B  # the store sums, as dist_sync does
            loss_fn = gluon.loss.L2Loss()
            for step in range(STEPS):
                x, y = (mx.nd.array(a) for a in data(step, rank))
                with autograd.record():
                    loss = loss_fn(net(x), y)
                loss.backward()
                trainer.step(batch)
            out = net(mx.nd.array(x_eval)).asnumpy()
            losses[name] = float(np.mean((out - y_eval) ** 2))
            weights[name] = [p.data().asnumpy() for p in net.collect_params().values()]
    return {"losses": losses, "weights": weights}


def test_int8_with_feedback_trains_like_float32(daemons):
    with daemons(2, round_timeout=60) as d:
        results = run_workers(parity_worker, 2, (d.addresses, uuid.uuid4().hex),
                              timeout=280, env=WORKER_ENV)
    first, second = results
    for name in first["weights"]:  # every rank applied the same reduced gradients
        for a, b in zip(first["weights"][name], second["weights"][name], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    losses = first["losses"]
    base = losses[system_name("float32", None, "trainer")]
    plain = losses[system_name("int8", False, "trainer")]
    report = ", ".join(f"{name} {loss:.5f} ({(loss - base) / base:+.1%})"
                       for name, loss in losses.items())
    print(f"final loss: {report}")
    print(f"int8 without feedback: {(plain - base) / base:+.1%} against float32")
    for how in ("trainer", "kvstore"):
        fed = losses[system_name("int8", None, how)]
        assert abs(fed - base) <= MARGIN * base, (how, losses)
