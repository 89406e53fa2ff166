"""The "reducer" KVStore with real daemons and real worker processes.

Workers are spawned interpreters, so the functions they run live at module
level. MXNet lives in .venv-mxnet only; elsewhere this module is skipped.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

import grpc  # noqa: E402
import reducer_client.mxnet as rmx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from reducer_client import ReducerClient, ReducerError  # noqa: E402
from reducer_client.mxnet._buffers import fusion_groups  # noqa: E402
from support import run_workers  # noqa: E402

# Keep each worker to one compute thread: the machine has 2 cores and up to
# 4 workers plus the daemons share them.
WORKER_ENV = {"MXNET_CPU_WORKER_NTHREADS": "1", "OMP_NUM_THREADS": "1",
              "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice"}
WORKER_TIMEOUT_S = 90

GLOBAL_BATCH = 16
STEPS = 5


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(GLOBAL_BATCH, 5)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, 1)).astype(np.float32)
    return x, y


def _net(seed: int):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, in_units=5, activation="tanh"), gluon.nn.Dense(1, in_units=8))
    net.initialize(mx.init.Xavier())
    return net


def _train(net, trainer, x: np.ndarray, y: np.ndarray, step_batch: int) -> list[np.ndarray]:
    loss_fn = gluon.loss.L2Loss()
    data, label = mx.nd.array(x), mx.nd.array(y)
    for _ in range(STEPS):
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()  # gradient of the sum over this worker's samples
        trainer.step(step_batch)
    return [p.data().asnumpy() for p in net.collect_params().values()]


def _reference_weights() -> list[np.ndarray]:
    """Single-process SGD on the whole batch, from rank 0's initial weights."""
    x, y = _data()
    net = _net(seed=100)
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9}, kvstore=None)
    return _train(net, trainer, x, y, GLOBAL_BATCH)


def train_worker(rank: int, world_size: int, addresses: list[str], job: str,
                 trainer_kind: str, op: str, wire_dtype: str) -> list[np.ndarray]:
    os.environ.update({"REDUCER_ADDRESSES": ",".join(addresses), "REDUCER_JOB": job,
                       "REDUCER_RANK": str(rank), "REDUCER_WORLD_SIZE": str(world_size),
                       "REDUCER_WIRE_DTYPE": wire_dtype, "REDUCER_TIMEOUT": "30"})
    x, y = _data()
    local = GLOBAL_BATCH // world_size
    x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    net = _net(seed=100 + rank)  # different weights per rank: the broadcast must fix that
    params = list(net.collect_params().values())
    # The registered store sums, as MXNet's dist_sync (contract section 5).
    kv = mx.kv.create("reducer") if op == "sum" else rmx.Reducer(op=op)
    assert (kv.rank, kv.num_workers, kv.type, kv.op) == (rank, world_size, "reducer", op)
    assert (rmx.rank(), rmx.size(), rmx.local_rank(), rmx.local_size()) == (
        rank, world_size, 0, 1)
    kv.broadcast(list(range(len(params))), [p.data() for p in params], root_rank=0)
    if trainer_kind == "trainer":
        trainer = gluon.Trainer(net.collect_params(), "sgd",
                                {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)
    else:  # a mean: the DistributedTrainer's own store, which averages
        trainer = rmx.DistributedTrainer(net.collect_params(), "sgd",
                                         {"learning_rate": 0.1, "momentum": 0.9},
                                         kvstore=kv if op == "sum" else None)
    # mean: each worker divides by its own batch; sum: by the global batch.
    step_batch = local if op == "mean" else GLOBAL_BATCH
    weights = _train(net, trainer, x, y, step_batch)
    assert trainer._kvstore.op == op  # the Trainer sets its store up at the first step
    rmx.shutdown()
    return weights


@pytest.mark.parametrize(("world_size", "trainer_kind", "op", "wire_dtype", "tolerance"), [
    # float32 on the wire: the only difference from one process is the order
    # of float32 additions (per worker, then across workers in the daemon), a
    # few ulps per step; 1e-5 leaves room for 5 steps of momentum SGD.
    (2, "trainer", "sum", "float32", 1e-5),
    (4, "distributed", "sum", "float32", 1e-5),
    # float16 on the wire rounds every gradient to 11 bits (relative 2^-11 =
    # 5e-4); with |grad| < 2, lr 0.1 and momentum 0.9 over 5 steps a weight
    # moves by at most ~0.1 * 2 * 5e-4 * (1 + 1.9 + 2.7 + 3.4 + 4.1) ~ 1.3e-3.
    (2, "distributed", "mean", "float16", 2e-3),
])
def test_training_matches_single_process(daemons, world_size, trainer_kind, op, wire_dtype,
                                         tolerance):
    """N workers on slices of the batch end with the weights of one process on all of it."""
    with daemons(2, round_timeout=30) as d:
        results = run_workers(train_worker, world_size,
                              (d.addresses, f"train-{world_size}-{op}", trainer_kind, op,
                               wire_dtype),
                              timeout=WORKER_TIMEOUT_S, env=WORKER_ENV)
    reference = _reference_weights()
    for rank, weights in enumerate(results):
        assert len(weights) == len(reference)
        for got, want in zip(weights, reference, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=tolerance,
                                       err_msg=f"rank {rank}")
    for weights in results[1:]:  # every worker applied the identical update
        for got, want in zip(weights, results[0], strict=True):
            np.testing.assert_array_equal(got, want)


# -- pushpull and broadcast semantics -------------------------------------------

KEYS = [3, "emb", 11, "big"]
SHAPES = [(4,), (2, 3), (1,), (700,)]  # "big" is above the fusion size used below
DTYPES = ["float32", "float16", "float64", "float32"]
DEVICES = 3


def _value(rank: int, key_index: int, device: int) -> np.ndarray:
    """Small integers: exact in float16 and their sums too, so checks can be exact."""
    size = int(np.prod(SHAPES[key_index]))
    base = np.arange(size) % 7
    return (base + rank * 10 + device * 3 + key_index).reshape(SHAPES[key_index])


def ops_worker(rank: int, world_size: int, addresses: list[str], job: str,
               root_rank: int) -> dict[str, object]:
    backend = ReducerClient(addresses, job, rank, world_size, wire_dtype="float32",
                            timeout=30)
    kv_sum = rmx.Reducer(op="sum", fusion_bytes=256, backend=backend)
    kv_mean = rmx.Reducer(op="mean", fusion_bytes=256, backend=backend)
    ctxs = [mx.cpu(i) for i in range(DEVICES)]
    out: dict[str, object] = {}

    def values():
        return [[mx.nd.array(_value(rank, k, dev), ctx=ctxs[dev], dtype=DTYPES[k])
                 for dev in range(DEVICES)] for k in range(len(KEYS))]

    # Several values per key, a list of keys, written in place.
    in_place = values()
    kv_sum.pushpull(KEYS, in_place)
    out["sum_in_place"] = [[v.asnumpy() for v in vs] for vs in in_place]
    # The same with separate outputs (two per key), and the mean store.
    outs = [[mx.nd.zeros(SHAPES[k], dtype=DTYPES[k]) for _ in range(2)]
            for k in range(len(KEYS))]
    kv_mean.pushpull(KEYS, values(), out=outs)
    out["mean_out"] = [[o.asnumpy() for o in os_] for os_ in outs]
    # One key, one value, one output; the value is left alone.
    single, target = mx.nd.array(_value(rank, 0, 0)), mx.nd.zeros(SHAPES[0])
    kv_sum.pushpull("solo", single, out=target, priority=-3)
    out["single"] = (single.asnumpy(), target.asnumpy())
    # Broadcast from a non-zero root: a list of keys into outputs, one key in place.
    bcast_out = [mx.nd.zeros(SHAPES[k], dtype=DTYPES[k]) for k in range(len(KEYS))]
    kv_sum.broadcast(KEYS, [mx.nd.array(_value(rank, k, 0), dtype=DTYPES[k])
                            for k in range(len(KEYS))], out=bcast_out, root_rank=root_rank)
    out["broadcast"] = [b.asnumpy() for b in bcast_out]
    in_place_b = mx.nd.array(_value(rank, 1, 0))
    kv_sum.broadcast("w", in_place_b, None, root_rank=root_rank)
    out["broadcast_in_place"] = in_place_b.asnumpy()
    backend.close()
    return out


def test_pushpull_and_broadcast(daemons):
    """Per-device values are summed, workers combined, lists of keys fused, non-zero root."""
    world_size, root = 3, 2
    with daemons(2, round_timeout=30) as d:
        results = run_workers(ops_worker, world_size, (d.addresses, "ops", root),
                              timeout=WORKER_TIMEOUT_S, env=WORKER_ENV)
    # float64 oracle; every input is a small integer, so float16 and float32
    # (local sum, wire, daemon accumulation) are exact and checks are equal.
    for k, key in enumerate(KEYS):
        total = sum(_value(r, k, dev).astype(np.float64)
                    for r in range(world_size) for dev in range(DEVICES))
        for rank, res in enumerate(results):
            where = f"rank {rank} key {key!r}"
            for got in res["sum_in_place"][k]:
                assert got.dtype == np.dtype(DTYPES[k]), where
                np.testing.assert_array_equal(got, total, err_msg=where)
            for got in res["mean_out"][k]:
                # Mean divides in float32 in the daemon: one rounding.
                np.testing.assert_allclose(got, total / world_size, rtol=1e-3 if
                                           DTYPES[k] == "float16" else 1e-6, err_msg=where)
            np.testing.assert_array_equal(res["broadcast"][k], _value(root, k, 0),
                                          err_msg=where)
    solo_total = sum(_value(r, 0, 0) for r in range(world_size))
    for rank, res in enumerate(results):
        value, target = res["single"]
        np.testing.assert_array_equal(value, _value(rank, 0, 0))
        np.testing.assert_array_equal(target, solo_total)
        np.testing.assert_array_equal(res["broadcast_in_place"], _value(root, 1, 0))


# -- errors ----------------------------------------------------------------------


@pytest.fixture
def reducer_env(monkeypatch):
    """REDUCER_* variables for this test only; the process-wide client is reset."""
    rmx.shutdown()

    def set_env(addresses: list[str], rank: int, world_size: int, timeout_s: float):
        monkeypatch.setenv("REDUCER_ADDRESSES", ",".join(addresses))
        monkeypatch.setenv("REDUCER_JOB", "errors")
        monkeypatch.setenv("REDUCER_RANK", str(rank))
        monkeypatch.setenv("REDUCER_WORLD_SIZE", str(world_size))
        monkeypatch.setenv("REDUCER_TIMEOUT", str(timeout_s))

    yield set_env
    rmx.shutdown()


def test_daemon_down_is_a_clear_error(daemons, reducer_env):
    """Scenario: the only daemon is gone before training starts.

    pushpull must raise ReducerError UNAVAILABLE naming the address within the
    client's timeout, not hang.
    """
    with daemons(1) as d:
        address = d.addresses[0]
    reducer_env([address], rank=0, world_size=2, timeout_s=2)
    kv = mx.kv.create("reducer")
    grad = mx.nd.ones((10,))
    with pytest.raises(ReducerError) as info:
        kv.pushpull(0, grad)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert address in str(info.value)
    assert "pushpull of key(s) 0" in str(info.value)


def test_missing_worker_is_a_clear_error(daemons, reducer_env):
    """Scenario: rank 1 of 2 never contributes.

    The daemon's round timeout fails the round; pushpull raises
    DEADLINE_EXCEEDED naming the missing rank.
    """
    with daemons(1, round_timeout=1) as d:
        reducer_env(d.addresses, rank=0, world_size=2, timeout_s=20)
        kv = mx.kv.create("reducer")
        with pytest.raises(ReducerError) as info:
            kv.pushpull("w", mx.nd.ones((10,)))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert re.search(r"rank\S* 1\b", str(info.value)), str(info.value)
    assert "key(s) w" in str(info.value)


# -- the interface, without daemons -------------------------------------------------


def test_registered_store_and_its_limits():
    """The type is registered, optimizer features fail clearly, Trainer updates locally."""
    from reducer_client.testing import LocalGroup

    rmx.init(LocalGroup(world_size=1).client(0))
    try:
        kv = mx.kv.create("reducer")
        assert isinstance(kv, rmx.Reducer)
        assert (kv.type, kv.rank, kv.num_workers, kv.op) == ("reducer", 0, 1, "sum")
        assert kv.is_capable("optimizer") is False
        with pytest.raises(ValueError, match="capability"):
            kv.is_capable("sparse")
        for call in (lambda: kv.set_optimizer(mx.optimizer.SGD()),
                     lambda: kv.save_optimizer_states("f"),
                     lambda: kv.load_optimizer_states("f"),
                     lambda: kv.set_gradient_compression({"type": "2bit"})):
            with pytest.raises(NotImplementedError, match="reducer kvstore"):
                call()
        with pytest.raises(ValueError, match="keys"):
            kv.pushpull([1, 2], [mx.nd.ones(1)])
        with pytest.raises(ValueError, match="root_rank"):
            kv.broadcast(0, mx.nd.ones(1), None, root_rank=1)
        net = _net(seed=1)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                kvstore=kv)
        with autograd.record():
            loss = net(mx.nd.ones((2, 5))).sum()
        loss.backward()
        trainer.step(2)
        assert trainer._update_on_kvstore is False
        with pytest.raises(ValueError, match="update_on_kvstore=False"):
            bad = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                kvstore=kv, update_on_kvstore=True)
            bad.step(2)
    finally:
        rmx.shutdown()


@pytest.mark.parametrize(("sizes", "fusion_bytes", "expected"), [
    ([4, 4, 4], 12, [[0, 1, 2]]),
    ([4, 4, 4], 8, [[0, 1], [2]]),
    ([4, 40, 4], 16, [[0, 2], [1]]),   # a large key travels alone, the rest still pack
    ([4, 4], 0, [[0], [1]]),           # fusion off
])
def test_fusion_groups(sizes, fusion_bytes, expected):
    items = [(n, np.dtype(np.float32)) for n in sizes]
    assert fusion_groups(items, fusion_bytes) == expected


def test_fusion_groups_split_by_dtype():
    items = [(8, np.dtype(np.float32)), (4, np.dtype(np.float16)), (8, np.dtype(np.float32))]
    assert fusion_groups(items, 1 << 20) == [[0, 2], [1]]


class _PassThrough:
    """A one-rank backend that allocates what ReducerClient does (a result
    array when no out= is given) and records the out= buffers it is given."""

    rank, world_size, local_rank, local_size = 0, 1, 0, 1
    timeout, wire_dtype = 10.0, "float32"

    def __init__(self) -> None:
        self.outs: list[tuple[str, int | None]] = []

    def allreduce_async(self, array, key, op="sum", *, out=None):
        from concurrent.futures import Future

        self.outs.append((key, None if out is None else out.ctypes.data))
        result = np.empty(array.shape, array.dtype) if out is None else out
        np.copyto(result, array)
        future = Future()
        future.set_result(result)
        return future

    def close(self):
        pass


def test_pushpull_reduces_into_kept_buffers():
    """Steady-state pushpull hands the core the same buffer per transfer as out=,
    and allocates no host arrays (tracemalloc sees NumPy's allocations)."""
    import tracemalloc

    backend = _PassThrough()
    kv = rmx.Reducer(fusion_bytes=1024, backend=backend)
    grads = [mx.nd.full((100,), 1.0), mx.nd.full((50,), 2.0), mx.nd.full((1 << 20,), 3.0)]
    targets = [mx.nd.zeros(g.shape) for g in grads]

    def step():
        kv.pushpull([0, 1, 2], grads, out=targets)
        mx.nd.waitall()
    step()
    first = list(backend.outs)
    assert len(first) == 2 and all(ptr is not None for _, ptr in first)  # [0, 1] packed
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(3):
            step()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert backend.outs == first * 4 and len(kv._buffers) == 2
    assert peak < (4 << 20) // 64, peak  # the big key is 4 MiB
    for grad, target in zip(grads, targets, strict=True):
        np.testing.assert_array_equal(target.asnumpy(), grad.asnumpy())
