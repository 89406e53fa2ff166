"""Horovod's MXNet API in reducer_client.mxnet, against LocalGroup (ranks as threads).

Names and their meaning, allreduce / grouped / allgather / broadcast with
Horovod's cases, the errors on every rank, broadcast_parameters before the
first forward (deferred initialization: the first step already runs on the
root's weights), and DistributedTrainer with compression and
gradient_predivide_factor against the float64 average.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

import reducer_client.mxnet as hvd  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402

TIMEOUT_S = 20.0


def on_ranks(fn, world_size: int = 2, wire_dtype: str = "float32") -> list:
    group = LocalGroup(world_size, timeout=TIMEOUT_S, wire_dtype=wire_dtype)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, rank, group.client(rank)) for rank in range(world_size)]
        out = []
        for future in futures:
            try:
                out.append(future.result(TIMEOUT_S + 10))
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out.append(exc)
        return out


def ok(results):
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_horovod_names_exist_and_queries_are_truthful():
    names = ["init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
             "cross_rank", "cross_size", "Compression", "Average", "Sum", "Adasum",
             "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
             "allgather", "broadcast", "broadcast_", "broadcast_object", "allgather_object",
             "broadcast_parameters", "DistributedTrainer", "mpi_built", "gloo_built",
             "nccl_built", "cuda_built"]
    assert not [n for n in names if not hasattr(hvd, n)]
    assert not any(q() for q in (hvd.mpi_built, hvd.gloo_built, hvd.nccl_built,
                                 hvd.cuda_built, hvd.mpi_enabled, hvd.gloo_enabled))
    hvd.init(reducer=LocalGroup(1).client(0))
    try:
        assert (hvd.size(), hvd.rank(), hvd.local_rank(), hvd.local_size(),
                hvd.cross_rank(), hvd.cross_size()) == (1, 0, 0, 1, 0, 1)
    finally:
        hvd.shutdown()


def test_allreduce_grouped_allgather_broadcast():
    def work(rank, reducer):
        x = mx.nd.array(np.arange(6).reshape(2, 3) * (rank + 1), dtype="float32")
        total = hvd.allreduce(x, average=False, reducer=reducer)
        mean = hvd.allreduce(x, op=hvd.Average, reducer=reducer)
        y = x.copy()
        hvd.allreduce_(y, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5,
                       reducer=reducer)
        group = hvd.grouped_allreduce([x, mx.nd.ones((4,), dtype="float64") * rank],
                                      reducer=reducer)
        rows = hvd.allgather(mx.nd.array(np.full((rank + 1, 2), rank), dtype="int64"),
                             reducer=reducer)
        copy = hvd.broadcast(mx.nd.array([rank * 1000003], dtype="int64"), root_rank=1,
                             reducer=reducer)
        objects = hvd.allgather_object({"r": rank}, reducer=reducer)
        obj = hvd.broadcast_object("root" if rank == 0 else None, reducer=reducer)
        return (total.asnumpy(), mean.asnumpy(), y.asnumpy(), [g.asnumpy() for g in group],
                rows.asnumpy(), copy.asnumpy(), objects, obj)
    base = np.arange(6).reshape(2, 3)
    for total, mean, y, group, rows, copy, objects, obj in ok(on_ranks(work)):
        np.testing.assert_array_equal(total, base * 3)
        np.testing.assert_array_equal(mean, base * 1.5)
        np.testing.assert_array_equal(y, base * 3)
        np.testing.assert_array_equal(group[0], base * 1.5)
        assert group[1].dtype == np.float64 and np.all(group[1] == 0.5)
        assert rows.dtype == np.int64 and rows.tolist() == [[0, 0], [1, 1], [1, 1]]
        assert copy.tolist() == [1000003]
        assert objects == [{"r": 0}, {"r": 1}] and obj == "root"


def test_mismatches_fail_every_rank_naming_them():
    def shapes(rank, reducer):
        return hvd.allreduce(mx.nd.zeros((2, 3) if rank == 0 else (3, 2)), reducer=reducer)
    results = on_ranks(shapes)
    assert all("shape" in str(r) and "rank 0: (2, 3)" in str(r) for r in results)

    def roots(rank, reducer):
        return hvd.broadcast(mx.nd.zeros(3), root_rank=rank, reducer=reducer)
    assert all("root_rank" in str(r) for r in on_ranks(roots))

    def dtypes(rank, reducer):
        return hvd.allreduce(mx.nd.zeros(3, dtype="int32" if rank else "float32"),
                             reducer=reducer)
    assert all("dtype" in str(r) and "int32" in str(r) for r in on_ranks(dtypes))


def _net(seed: int) -> gluon.nn.HybridSequential:
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(channels=3, kernel_size=3, activation="relu"),
            gluon.nn.Flatten(), gluon.nn.Dense(2))  # shapes inferred at the first forward
    net.initialize(mx.init.Xavier())
    return net


def _batch(rank: int):
    rng = np.random.default_rng(rank)
    return (mx.nd.array(rng.normal(size=(4, 1, 6, 6)).astype(np.float32)),
            mx.nd.array(rng.integers(0, 2, size=4).astype(np.float32)))


def test_broadcast_parameters_before_the_first_forward():
    """Deferred parameters get root's values as MXNet initializes them: the
    first step's gradients are computed on identical weights."""
    def work(rank, reducer):
        net = _net(seed=rank)  # different initial weights per rank
        params = net.collect_params()
        hvd.broadcast_parameters(params, root_rank=0, reducer=reducer)
        x, _ = _batch(rank)
        with autograd.record():
            net(x)
        return {name: p.data().asnumpy() for name, p in sorted(params.items())}
    first, second = ok(on_ranks(work))
    assert first.keys() == second.keys() and len(first) == 4
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])


@pytest.mark.parametrize("compression,factor", [("none", 1.0), ("none", 2.0), ("fp16", 1.0),
                                                (None, 4.0)])
def test_distributed_trainer_compression_and_predivide(compression, factor):
    """One step on a float16 client: each rank's update is the one of the
    average gradient; Compression.none is float32 on the wire, fp16 and the
    default (the client's float16) within float16's rounding."""
    lr, batch = 0.1, 4

    def grads_and_update(rank, reducer):
        net = _net(seed=0)
        params = net.collect_params()
        x, y = _batch(rank)
        net(x)  # finish initialization
        trainer = hvd.DistributedTrainer(
            params, "sgd", {"learning_rate": lr},
            compression=getattr(hvd.Compression, compression) if compression else None,
            gradient_predivide_factor=factor, reducer=reducer)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        before = {n: p.data().asnumpy().astype(np.float64) for n, p in params.items()}
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        local = {n: p.grad().asnumpy().astype(np.float64) for n, p in params.items()}
        trainer.step(batch)
        after = {n: p.data().asnumpy().astype(np.float64) for n, p in params.items()}
        return before, local, after
    results = ok(on_ranks(grads_and_update, wire_dtype="float16"))
    # float16 on the wire: two roundings (contribution, result) of 2^-11 each.
    relative = 0.0 if compression == "none" else 2.0 ** -10
    for before, _, after in results:
        for name in before:
            mean = np.mean([res[1][name] for res in results], axis=0)
            implied = (before[name] - after[name]) * batch / lr
            # 2e-6: the float32 update w - lr g / b itself, read back through lr / b.
            bound = relative * np.abs(mean).max() + 2e-6
            assert np.abs(implied - mean).max() <= bound, name
