"""MXNet's older KVStore calls on the "reducer" store: init, push, pull, and the refused ones.

The usage of MXNet's own tests/python/unittest/test_kvstore.py (init a key,
push values from several devices, pull into outputs, lists of int and str
keys), on real daemons with real worker processes: init gives every worker
rank 0's value, push replaces the stored value with the sum over devices
and workers (as dist_sync does without an updater), pull copies it out.
Every input is a small integer, so float32 (local sum, wire, daemon) is
exact and the checks are equalities against a float64 oracle.
row_sparse_pull and updaters are refused with a clear error. MXNet lives in
.venv-mxnet only; elsewhere this module is skipped.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

import reducer_client.mxnet as rmx  # noqa: E402
from reducer_client import ReducerClient  # noqa: E402
from support import run_workers  # noqa: E402

pytestmark = pytest.mark.timeout(120)

WORKER_ENV = {"MXNET_CPU_WORKER_NTHREADS": "1", "OMP_NUM_THREADS": "1",
              "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice"}
SHAPE = (4, 4)
KEYS = [5, 7, 11]
STR_KEYS = ["b", "c", "d"]
DEVICES = 4
WORLD = 2


def _value(rank: int, key: int, dev: int, push: int) -> np.ndarray:
    return np.full(SHAPE, 1 + rank + 10 * key + 100 * dev + 1000 * push, np.float32)


def legacy_worker(rank: int, world: int, addresses: list[str], job: str) -> dict:
    backend = ReducerClient(addresses, job, rank, world, wire_dtype="float32", timeout=30)
    try:
        kv = rmx.Reducer(backend=backend)  # op "sum", as mx.kv.create("reducer")
        mean = rmx.Reducer(op="mean", backend=backend)
        ctxs = [mx.cpu(i) for i in range(DEVICES)]
        out: dict[str, object] = {}
        # init: a single key and a list; each rank offers its own value.
        kv.init(3, mx.nd.full(SHAPE, 4 + rank))
        kv.init(KEYS, [mx.nd.full(SHAPE, 10 * k + rank) for k in range(len(KEYS))])
        kv.init("a", [mx.nd.full(SHAPE, 7 + rank, ctx=c) for c in ctxs])
        pulled = mx.nd.zeros(SHAPE)
        kv.pull(3, out=pulled)
        out["init_single"] = pulled.asnumpy()
        outs = [[mx.nd.zeros(SHAPE, ctx=c) for c in ctxs[:2]] for _ in KEYS]
        kv.pull(KEYS, out=outs)
        out["init_list"] = [[o.asnumpy() for o in per_key] for per_key in outs]
        kv.pull("a", out=pulled)
        out["init_str"] = pulled.asnumpy()
        # push: per-device values summed, then workers; twice (the second replaces).
        for push in range(2):
            kv.push(KEYS, [[mx.nd.array(_value(rank, k, d, push), ctx=ctxs[d])
                            for d in range(DEVICES)] for k in range(len(KEYS))])
            outs = [mx.nd.zeros(SHAPE) for _ in KEYS]
            kv.pull(KEYS, out=outs)
            out[f"push{push}"] = [o.asnumpy() for o in outs]
        # str keys on the mean store.
        mean.init(STR_KEYS, [mx.nd.zeros(SHAPE)] * len(STR_KEYS))
        mean.push(STR_KEYS, [mx.nd.full(SHAPE, 2 * (rank + 1) * (k + 1))
                             for k in range(len(STR_KEYS))])
        outs = [mx.nd.zeros(SHAPE) for _ in STR_KEYS]
        mean.pull(STR_KEYS, out=outs)
        out["mean"] = [o.asnumpy() for o in outs]
        return out
    finally:
        backend.close()


def test_init_push_pull_on_real_daemons(daemons):
    with daemons(2, round_timeout=30) as d:
        results = run_workers(legacy_worker, WORLD, (d.addresses, "legacy"), timeout=90,
                              env=WORKER_ENV)
    for rank, res in enumerate(results):
        where = f"rank {rank}"
        np.testing.assert_array_equal(res["init_single"], np.full(SHAPE, 4.0), where)
        for k, per_key in enumerate(res["init_list"]):
            for got in per_key:
                np.testing.assert_array_equal(got, np.full(SHAPE, 10.0 * k), where)
        np.testing.assert_array_equal(res["init_str"], np.full(SHAPE, 7.0), where)
        for push in range(2):
            for k, got in enumerate(res[f"push{push}"]):
                total = sum(_value(r, k, dev, push).astype(np.float64)
                            for r in range(WORLD) for dev in range(DEVICES))
                np.testing.assert_array_equal(got, total, f"{where} push {push} key {k}")
        for k, got in enumerate(res["mean"]):
            want = sum(2.0 * (r + 1) * (k + 1) for r in range(WORLD)) / WORLD
            np.testing.assert_array_equal(got, np.full(SHAPE, want), where)


def test_misuse_and_unsupported_calls_fail_clearly():
    """Without daemons (one rank on a LocalGroup): every misuse names its key,
    every unsupported call says what to use instead; none is an AttributeError."""
    from reducer_client.testing import LocalGroup

    rmx.init(LocalGroup(world_size=1).client(0))
    try:
        kv = mx.kv.create("reducer")
        with pytest.raises(ValueError, match="key 'w', which was never initialized"):
            kv.pull("w", out=mx.nd.zeros(SHAPE))
        with pytest.raises(ValueError, match="push of key 'w', which was never"):
            kv.push("w", mx.nd.ones(SHAPE))
        kv.init("w", mx.nd.ones(SHAPE))
        with pytest.raises(ValueError, match="key 'w' is already initialized"):
            kv.init("w", mx.nd.ones(SHAPE))
        with pytest.raises(ValueError, match=r"shape \(2,\), initialized with \(4, 4\)"):
            kv.push("w", mx.nd.ones((2,)))
        with pytest.raises(ValueError, match="out="):
            kv.pull("w")
        kv.push("w", [mx.nd.ones(SHAPE)] * 3)  # one worker: the devices' sum
        got = mx.nd.zeros(SHAPE)
        kv.pull("w", out=got)
        np.testing.assert_array_equal(got.asnumpy(), np.full(SHAPE, 3.0))
        unsupported = {
            "row_sparse_pull": lambda: kv.row_sparse_pull("w", out=got,
                                                          row_ids=mx.nd.array([1])),
            "set_updater": lambda: kv.set_updater(lambda key, recv, local: None),
            "_set_updater": lambda: kv._set_updater(lambda key, recv, local: None),
        }
        for name, call in unsupported.items():
            with pytest.raises(NotImplementedError,
                               match=f"{name} is not supported by the reducer KVStore: "
                                     "use pushpull / broadcast"):
                call()
    finally:
        rmx.shutdown()
