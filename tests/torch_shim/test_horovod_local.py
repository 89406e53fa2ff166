"""Horovod's torch API in reducer_client.torch, against LocalGroup (ranks as threads).

The cases of Horovod's test/parallel/test_torch.py that apply, rewritten:
names and their meaning, allreduce (average, sum, prescale, postscale, in
place, async, fused), grouped allreduce, allgather of uneven sizes,
broadcast, their gradients, the errors Horovod raises (shape, dtype,
root_rank, duplicate names) on every rank, join, compression, and
broadcast_optimizer_state's zero-filled gradients. Real daemons and worker
processes: test_horovod_workers.py.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import reducer_client.torch as hvd  # noqa: E402
from reducer_client import horovod  # noqa: E402
from reducer_client.errors import ReducerError  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402

TIMEOUT_S = 20.0


def on_ranks(fn, world_size: int = 2, wire_dtype: str = "float32",
             timeout: float = TIMEOUT_S) -> list:
    """fn(rank, reducer) on threads sharing a LocalGroup; each result or its exception."""
    group = LocalGroup(world_size, timeout=timeout, wire_dtype=wire_dtype)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [pool.submit(fn, rank, group.client(rank)) for rank in range(world_size)]
        out = []
        for future in futures:
            try:
                out.append(future.result(timeout + 10))
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out.append(exc)
        return out


def ok(results: list) -> list:
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


HOROVOD_NAMES = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "Compression", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "allgather_object",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_parameters", "broadcast_optimizer_state", "poll", "synchronize", "join",
    "barrier", "DistributedOptimizer", "global_process_set"]


def test_every_horovod_name_exists():
    missing = [n for n in HOROVOD_NAMES if not hasattr(hvd, n)]
    assert not missing
    assert set(HOROVOD_NAMES) - {"global_process_set"} <= set(hvd.__all__)


def test_build_queries_are_truthful():
    # No MPI, Gloo, NCCL, ... in this backend: the daemons reduce on CPUs.
    for query in (hvd.mpi_built, hvd.mpi_enabled, hvd.gloo_built, hvd.gloo_enabled,
                  hvd.nccl_built, hvd.ddl_built, hvd.ccl_built, hvd.cuda_built,
                  hvd.rocm_built, hvd.mpi_threads_supported):
        assert query() is False


def test_basics_and_cross_rank():
    reducer = hvd.init(reducer=LocalGroup(1).client(0))
    try:
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
        assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1) and hvd.is_homogeneous()
        assert hvd.client() is reducer
    finally:
        hvd.shutdown()


def test_cross_rank_of_node_major_ranks():
    class Client:
        rank, world_size, local_rank, local_size = 5, 8, 1, 4
    assert (horovod.cross_rank(Client()), horovod.cross_size(Client())) == (1, 2)


def test_init_says_once_where_the_default_wire_differs(caplog, monkeypatch):
    monkeypatch.setattr(horovod, "_announced", False)
    caplog.set_level(logging.WARNING, logger="reducer_client")
    try:
        hvd.init(reducer=LocalGroup(1, wire_dtype="float16").client(0))
        hvd.init(reducer=LocalGroup(1, wire_dtype="float16").client(0))
    finally:
        hvd.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "reducer_client"]
    assert len(lines) == 1
    assert "float16" in lines[0] and "Compression.none" in lines[0]


def test_op_rules_and_adasum_refused():
    assert horovod.resolve_op(None, None) == "mean"
    assert horovod.resolve_op(None, False) == "sum"
    assert horovod.resolve_op(hvd.Sum) == "sum"
    with pytest.raises(ValueError, match="supersedes average"):
        horovod.resolve_op(hvd.Sum, True)
    with pytest.raises(NotImplementedError, match="Adasum.* not supported"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum, reducer=LocalGroup(1).client(0))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(NotImplementedError, match="Adasum.* not supported"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 op=hvd.Adasum, reducer=LocalGroup(1).client(0))
    with pytest.raises(ValueError, match="op != Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0,
                                 reducer=LocalGroup(1).client(0))


def test_compression_chooses_the_wire():
    """Compression.none is float32 on the wire even on a float16 client; the
    default (None) is the client's float16."""
    value = 1.0 + 2.0 ** -20  # not a float16; exact in float32

    def work(rank, reducer):
        t = torch.full((4,), value)
        return (hvd.allreduce(t, compression=hvd.Compression.none, reducer=reducer),
                hvd.allreduce(t, reducer=reducer),
                hvd.allreduce(t, compression=hvd.Compression.bf16, reducer=reducer))
    for exact, fp16, bf16 in ok(on_ranks(work, wire_dtype="float16")):
        assert torch.all(exact == np.float32(value))
        assert torch.all(fp16 == 1.0) and torch.all(bf16 == 1.0)


def test_compression_compress_casts_like_horovods():
    tensor = torch.ones(5, 5, dtype=torch.float64)
    compressed, ctx = hvd.Compression.fp16.compress(tensor)
    assert compressed.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(compressed, ctx).dtype == torch.float64
    ints = torch.ones(3, dtype=torch.int32)
    assert hvd.Compression.fp16.compress(ints)[0].dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_allreduce_sum_average_and_scales(dtype, dim):
    """Integers in [-100, 100) sum exactly on the float32 wire (Horovod's cases)."""
    size = 3

    def make(rank):  # a generator of its own: threads would share the global one
        g = torch.Generator().manual_seed(1234 + rank)
        return torch.randint(-100, 100, [17] * dim, generator=g).to(dtype)

    def work(rank, reducer):
        t = make(rank)
        return (hvd.allreduce(t, average=False, reducer=reducer),
                hvd.allreduce(t, op=hvd.Average, reducer=reducer),
                hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5,
                              reducer=reducer))
    total = sum(make(r).double() for r in range(size))
    for summed, averaged, scaled in ok(on_ranks(work, size)):
        assert summed.dtype == dtype and torch.equal(summed.double(), total)
        # mean: the float32 sum divided by 3 in float32, rounded once to dtype
        expected = (total.float() / 3).to(dtype)
        assert torch.equal(averaged, expected)
        assert torch.equal(scaled.double(), total)


def test_allreduce_in_place_async_and_fused():
    def work(rank, reducer):
        a = torch.full((5,), float(rank + 1))
        b = torch.full((3, 2), float(10 * (rank + 1)))
        ha = hvd.allreduce_async_(a, name="a", op=hvd.Sum, reducer=reducer)
        hb = hvd.allreduce_async(b, name="b", reducer=reducer)
        with pytest.raises(ValueError, match="still in flight"):
            hvd.allreduce_async(b, name="b", reducer=reducer)  # Horovod's duplicate-name rule
        deadline = time.monotonic() + TIMEOUT_S
        while not (hvd.poll(ha) and hvd.poll(hb)) and time.monotonic() < deadline:
            time.sleep(0.01)
        out_a, out_b = hvd.synchronize(ha), hvd.synchronize(hb)
        in_place = hvd.allreduce_(torch.full((2,), float(rank)), reducer=reducer)
        return out_a is a, a, out_b, b, in_place
    for same, a, out_b, b, in_place in ok(on_ranks(work)):
        assert same and torch.all(a == 3)
        assert torch.all(out_b == 15) and torch.all(b != 15)  # the input is not modified
        assert torch.all(in_place == 0.5)


def test_grouped_allreduce():
    def work(rank, reducer):
        tensors = [torch.full((4,), float(rank)), torch.full((2, 3), float(rank + 1),
                                                            dtype=torch.float64)]
        averaged = hvd.grouped_allreduce(tensors, reducer=reducer)
        in_place = [t.clone() for t in tensors]
        hvd.grouped_allreduce_(in_place, op=hvd.Sum, reducer=reducer)
        return averaged, in_place
    for averaged, in_place in ok(on_ranks(work)):
        assert torch.all(averaged[0] == 0.5) and torch.all(averaged[1] == 1.5)
        assert averaged[1].dtype == torch.float64 and averaged[1].shape == (2, 3)
        assert torch.all(in_place[0] == 1) and torch.all(in_place[1] == 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32,
                                   torch.uint8, torch.bool, torch.bfloat16, torch.float16])
def test_allgather_variable_size_is_exact(dtype):
    """Rank r contributes r + 1 rows (Horovod's variable-size case); bit for bit."""
    size = 3

    def rows(rank):
        g = torch.Generator().manual_seed(rank)
        values = torch.randint(0, 2 ** 31, (rank + 1, 2, 3), generator=g, dtype=torch.int64)
        if dtype.is_floating_point:
            return torch.randn((rank + 1, 2, 3), generator=g).to(dtype)
        return (values * (2 ** 30 + 7)).to(dtype)  # large int64s survive too

    def work(rank, reducer):
        return hvd.allgather(rows(rank), reducer=reducer)
    expected = torch.cat([rows(r) for r in range(size)])
    for gathered in ok(on_ranks(work, size)):
        assert gathered.dtype == dtype and torch.equal(gathered, expected)


def test_allgather_object_and_broadcast_object():
    def work(rank, reducer):
        return (hvd.allgather_object({"rank": rank, "pad": "x" * rank}, reducer=reducer),
                hvd.broadcast_object({"from": rank} if rank == 1 else None, root_rank=1,
                                     reducer=reducer))
    for objects, obj in ok(on_ranks(work, 3)):
        assert objects == [{"rank": r, "pad": "x" * r} for r in range(3)]
        assert obj == {"from": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int8,
                                   torch.bfloat16])
def test_broadcast_and_in_place(dtype):
    def value(rank):
        return (torch.arange(12).view(3, 4) * (1000003 if dtype == torch.int64 else 1)
                + rank).to(dtype)

    def work(rank, reducer):
        out = hvd.broadcast(value(rank), root_rank=1, reducer=reducer)
        target = value(rank)
        hvd.broadcast_(target, root_rank=0, reducer=reducer)
        return out, target
    for out, target in ok(on_ranks(work)):
        assert torch.equal(out, value(1)) and torch.equal(target, value(0))


def test_gradients_follow_horovods_rules():
    size = 2

    def work(rank, reducer):
        x = torch.ones(3, requires_grad=True)
        hvd.allreduce(x, op=hvd.Sum, reducer=reducer).sum().backward()
        y = torch.ones(3, requires_grad=True)
        hvd.allreduce(y, reducer=reducer).sum().backward()
        a, b = torch.ones(2, requires_grad=True), torch.ones(2, 2, requires_grad=True)
        sum(t.sum() for t in hvd.grouped_allreduce([a, b], op=hvd.Sum, reducer=reducer)
            ).backward()
        g = torch.ones(rank + 1, 2, requires_grad=True)
        (hvd.allgather(g, reducer=reducer) * 3).sum().backward()
        c = torch.ones(4, requires_grad=True)
        hvd.broadcast(c, root_rank=0, reducer=reducer).sum().backward()
        return x.grad, y.grad, a.grad, b.grad, g.grad, c.grad
    results = ok(on_ranks(work, size))
    for rank, (x, y, a, b, g, c) in enumerate(results):
        assert torch.all(x == size) and torch.all(y == 1)
        assert torch.all(a == size) and torch.all(b == size)
        assert g.shape == (rank + 1, 2) and torch.all(g == 3)
        assert torch.all(c == (1 if rank == 0 else 0))


def _failures(results) -> list[str]:
    assert all(isinstance(r, Exception) for r in results), results
    return [str(r) for r in results]


def test_shape_mismatch_fails_every_rank_at_once_naming_them():
    """Same number of elements, other shape: Horovod raises; so does every rank here."""
    start = time.monotonic()

    def work(rank, reducer):
        return hvd.allreduce(torch.zeros((17, 23 * 57) if rank == 0 else (17, 23, 57)),
                             reducer=reducer)
    messages = _failures(on_ranks(work, 3))
    assert time.monotonic() - start < TIMEOUT_S / 4  # a round trip, not a timeout
    assert len(set(messages)) == 1
    assert "shape" in messages[0] and "rank 0: (17, 1311)" in messages[0]
    assert "ranks 1, 2: (17, 23, 57)" in messages[0]

    def other_length(rank, reducer):
        return hvd.allreduce(torch.zeros([17 + rank] * 2), reducer=reducer)
    messages = _failures(on_ranks(other_length))
    assert all("(17, 17)" in m and "(18, 18)" in m for m in messages)


def test_dtype_mismatch_fails_every_rank_at_once():
    start = time.monotonic()

    def work(rank, reducer):
        dtype = torch.int32 if rank % 2 == 0 else torch.float32
        return hvd.allreduce(torch.ones(17, 17, dtype=dtype), reducer=reducer)
    messages = _failures(on_ranks(work))
    assert time.monotonic() - start < TIMEOUT_S / 4
    assert all("dtype" in m and "rank 0: int32" in m and "rank 1: float32" in m
               for m in messages)

    def complexes(rank, reducer):
        return hvd.allreduce(torch.ones(3, dtype=torch.complex64), reducer=reducer)
    results = on_ranks(complexes)
    assert all(isinstance(r, TypeError) and "complex64 cannot be reduced" in str(r)
               for r in results)


def test_root_rank_disagreement_fails_every_rank():
    def work(rank, reducer):
        return hvd.broadcast(torch.ones(3), root_rank=rank, reducer=reducer)
    messages = _failures(on_ranks(work))
    assert all("root_rank" in m and "rank 0: 0" in m and "rank 1: 1" in m for m in messages)

    def parameters(rank, reducer):
        hvd.broadcast_parameters({"w": torch.ones(2)}, root_rank=rank, reducer=reducer)
    assert all("root_rank" in m for m in _failures(on_ranks(parameters)))


def test_optimizer_predivide_and_compression_average_the_same():
    """gradient_predivide_factor splits the division around the sum: same mean."""
    torch.manual_seed(1)
    base = torch.nn.Linear(6, 3)

    def work(rank, reducer):
        results = []
        for factor, compression in ((1.0, hvd.Compression.none), (2.0, hvd.Compression.none),
                                    (2.0, hvd.Compression.fp16)):
            model = copy.deepcopy(base)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           named_parameters=model.named_parameters(),
                                           compression=compression,
                                           gradient_predivide_factor=factor, reducer=reducer)
            x = torch.full((2, 6), float(rank + 1))
            model(x).sum().backward()
            opt.synchronize()
            results.append(model.weight.grad.clone())
        return results
    for plain, predivided, half in ok(on_ranks(work, wire_dtype="float16")):
        assert torch.equal(plain, torch.full((3, 6), 3.0))  # mean of 2 and 4
        assert torch.equal(predivided, plain)  # powers of two: exact
        torch.testing.assert_close(half, plain, rtol=2 ** -10, atol=0)


def test_broadcast_optimizer_state_zero_fills_gradients():
    """Horovod's test_broadcast_state_no_grad: a fresh optimizer gets state
    (and zero gradients where a parameter requires grad), the same on all ranks."""
    class ModelNoGrad(torch.nn.Module):
        def __init__(self, b) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3]).int(), requires_grad=False)
            self.b = torch.nn.Parameter(b)

    def work(rank, reducer):
        model = ModelNoGrad(torch.rand(4, generator=torch.Generator().manual_seed(rank)))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                            nesterov=True), named_parameters=model.named_parameters(),
            reducer=reducer)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0, reducer=reducer)
        hvd.broadcast_optimizer_state(opt, root_rank=0, reducer=reducer)
        grad = opt.param_groups[0]["params"][1].grad
        return (opt.param_groups[0]["params"][0].grad, grad,
                hvd.broadcast(grad, root_rank=0, reducer=reducer), model.b.detach().clone())
    results = ok(on_ranks(work))
    for no_grad, grad, broadcast, b in results:
        assert no_grad is None and grad is not None and torch.equal(grad, broadcast)
        assert torch.equal(b, results[0][3])


def test_allreduce_error_is_a_reducer_error_and_a_runtime_error():
    def work(rank, reducer):
        return hvd.allreduce(torch.zeros(2 + rank), reducer=reducer)
    for result in on_ranks(work):
        assert isinstance(result, ReducerError) and isinstance(result, RuntimeError)
