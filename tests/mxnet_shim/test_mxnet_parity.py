"""Training parity on the 8-bit wire in the MXNet shim: error feedback keeps int8 close to float32.

The torch and TF parity tests' setup (tests/torch_shim/test_quant_training.py,
tests/tf_shim/test_tf_feedback.py), on 2 real worker processes and real
daemons: a small MLP learns a teacher's function with Adam; one input
feature, which the teacher ignores, is 300x the scale of the others, so its
weights' gradients share int8 blocks with gradients ~300x smaller, which
round to zero on every step unless error feedback carries them into later
steps. gluon's Dense keeps its weight as (units, inputs), as torch's Linear
does, so the loud feature's weights are one element in every 16 of the
first layer's and every int8 block of it holds some.

One run's final loss says little here: the int8 runs landed 20-70 % above or
below float32 depending on the initial weights' seed, and the single-seed
version of this test (400 steps, final loss within 15 %) passed on one CPU
model and failed on another (AMD EPYC Zen 3: +24.9 % with feedback, at the
commit before the change). So, as the torch and TF tests do, each system
trains SEEDS students on the same per-rank batches, the loss is the
evaluation loss averaged over the last TAIL steps, and int8 with error
feedback (the default for int8) must be within MARGIN (20 %) of float32 on
the mean over the seeds, with DistributedTrainer (one averaging pushpull of
all gradients per step, packed) and with a plain gluon.Trainer on the
"reducer" KVStore (a summing pushpull per parameter, trainer.step(world_size
* batch)). Without feedback (DistributedTrainer(error_feedback=False), one
seed) the difference is printed, not checked: the difference feedback makes
shows in the sums (test_mxnet_feedback.py) more than in this model's loss.
Measured on Zen 3: +0.2 % (DistributedTrainer) and -0.9 % (KVStore) with
feedback, +8.7 % without.
"""

from __future__ import annotations

import itertools
import uuid

import numpy as np
import pytest
from support import run_workers

pytest.importorskip("mxnet")

pytestmark = pytest.mark.timeout(300)

STEPS = 300
B = 16
LR = 0.01
TAIL = 50  # the loss: evaluated after each of the last TAIL steps, averaged
SEEDS = (0, 1, 2)  # students; the systems compare by the mean over them
MARGIN = 0.20  # relative to the float32 runs' mean loss (the torch and TF tests')
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

    def student(seed: int):
        mx.random.seed(seed)  # the same weights on every rank
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(64, in_units=16, activation="tanh"),
                gluon.nn.Dense(64, in_units=64, activation="tanh"),
                gluon.nn.Dense(4, in_units=64))
        net.initialize(mx.init.Xavier())
        return net

    x_eval, y_eval = data(10 ** 6, 0, 512)
    losses: dict[str, list[float]] = {}
    weights = {}
    for seed, (wire, feedback, how) in itertools.product(SEEDS, SYSTEMS):
        if feedback is False and seed != SEEDS[0]:
            continue  # printed, not checked: one seed
        name = system_name(wire, feedback, how)
        with ReducerClient(addresses, job=f"{job}-{seed}-{name.replace(' ', '-')}", rank=rank,
                           world_size=world_size, wire_dtype=wire, timeout=60.0) as client:
            net = student(seed)
            tail = []
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
                if step >= STEPS - TAIL:
                    out = net(mx.nd.array(x_eval)).asnumpy()
                    tail.append(float(np.mean((out - y_eval) ** 2)))
            losses.setdefault(name, []).append(float(np.mean(tail)))
            weights[f"{name} seed {seed}"] = [p.data().asnumpy()
                                              for p in net.collect_params().values()]
    return {"losses": {name: float(np.mean(per_seed)) for name, per_seed in losses.items()},
            "weights": weights}


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
    print(f"evaluation loss (last {TAIL} steps, mean of {len(SEEDS)} seeds; without "
          f"feedback one seed): {report}")
    print(f"int8 without feedback: {(plain - base) / base:+.1%} against float32")
    for how in ("trainer", "kvstore"):
        fed = losses[system_name("int8", None, how)]
        assert abs(fed - base) <= MARGIN * base, (how, losses)
