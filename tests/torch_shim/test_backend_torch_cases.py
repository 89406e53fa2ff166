"""torch's own process-group test cases on the "reducer" backend: CPU, 2 ranks.

Adapted from torch 2.13.0's torch/testing/_internal/distributed/distributed_test.py
(DistributedTest._DistTestBase; BSD-3-Clause, (c) PyTorch contributors):
each case below is the test of the same name with its helper inlined
(_build_tensor, Net, Foo and the object list are torch's, copied; the
harness, MultiProcessTestCase and its profiling checks, is replaced by two
torchrun-style workers on 2 real daemons). torch's expectations are exact,
so the default group runs on the float32 wire (REDUCER_WIRE_DTYPE=float32),
whose sums of these small integers are exact. UNSUPPORTED lists torch's
cases that cannot apply and checks that each is refused with the error
the backend documents, naming the op and Gloo.

docs/howto/torch-distributed.md lists the cases run and those that do not apply.
"""

from __future__ import annotations

import copy
import datetime
import time
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from backend_workers import init_worker, torchrun_env  # noqa: E402
from support import run_workers  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = pytest.mark.timeout(240)

WORLD = 2


# -- torch's helpers (distributed_test.py) ------------------------------------------

def _build_tensor(size, value=None, dtype=torch.float):
    return torch.empty(size, size, size, dtype=dtype).fill_(size if value is None else value)


class _FC2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 50, bias=True)
        self.fc.bias.requires_grad = False

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = _FC2()
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()
        self.no_grad_param = nn.Parameter(torch.tensor([2, 2]).long(), requires_grad=False)

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return nn.functional.softmax(self.fc3(x), dim=1)


class Foo:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        def eq(value, other):
            return torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
        return all(eq(v, other.__dict__[k]) for k, v in self.__dict__.items())


def create_collectives_object_test_list():
    f = Foo(10)
    f.bar = 1
    return [{"key1": 3, "key2": 4, "key3": {"nested": True}}, f, Foo(torch.randn(3, 3)),
            "foo", [1, 2, True, "string", [4, 5, "nested"]]]


def assert_equal(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# -- the cases ---------------------------------------------------------------------

CASES = {}


def case(fn):
    """Register torch's case torch_NAME under its name in torch (pytest collects none)."""
    CASES[fn.__name__.removeprefix("torch_")] = fn
    return fn


def _all_reduce_helper(rank, group, op, master, worker, expected, dtype=torch.float,
                       async_op=False):
    for src in range(WORLD):
        tensor = _build_tensor(src + 1, dtype=dtype).fill_(master if rank == src else worker)
        work = dist.all_reduce(tensor, op, group, async_op=async_op)
        if async_op:
            assert work.wait() and work.is_completed()
        assert_equal(tensor, _build_tensor(src + 1, expected, dtype))


@case
def torch_test_all_reduce_sum(rank, group):
    _all_reduce_helper(rank, None, dist.ReduceOp.SUM, 2, 10, 2 + 10 * (WORLD - 1))


@case
def torch_test_all_reduce_sum_async(rank, group):
    _all_reduce_helper(rank, None, dist.ReduceOp.SUM, 2, 10, 2 + 10 * (WORLD - 1),
                       async_op=True)


@case
def torch_test_all_reduce_sum_dtypes(rank, group):
    """test_all_reduce_sum over the dtypes torch's broadcast test sweeps, and AVG."""
    for dtype in (torch.double, torch.half, torch.bfloat16, torch.int8, torch.uint8,
                  torch.int, torch.long):
        _all_reduce_helper(rank, None, dist.ReduceOp.SUM, 2, 10, 12, dtype)
    _all_reduce_helper(rank, None, dist.ReduceOp.AVG, 2, 10, 6)


@case
def torch_test_all_reduce_sum_complex(rank, group):
    _all_reduce_helper(rank, None, dist.ReduceOp.SUM, complex(2, 3), complex(10, 11),
                       complex(2, 3) + complex(10, 11) * (WORLD - 1), torch.cfloat)


@case
def torch_test_all_reduce_complex_unsupported_ops(rank, group):
    """torch itself refuses these before the backend sees them."""
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        with pytest.raises(ValueError, match="does not support"):
            dist.all_reduce(_build_tensor(1, 0, torch.cfloat), op)


@case
def torch_test_all_reduce_full_group_sum(rank, group):
    _all_reduce_helper(rank, group, dist.ReduceOp.SUM, 2, 10, 2 + 10 * (WORLD - 1))


@case
def torch_test_all_reduce_coalesced_sum(rank, group):
    dtypes = (torch.float, torch.float, torch.cfloat)
    for src in range(WORLD):
        values = [2, 3, complex(2, 3)] if rank == src else [10, 11, complex(10, 11)]
        tensors = [_build_tensor(src + 1, v, d) for v, d in zip(values, dtypes, strict=True)]
        dist.all_reduce_coalesced(tensors, dist.ReduceOp.SUM)
        expected = (2 + 10 * (WORLD - 1), 3 + 11 * (WORLD - 1),
                    complex(2, 3) + complex(10, 11) * (WORLD - 1))
        assert_equal(tensors, [_build_tensor(src + 1, v, d)
                               for v, d in zip(expected, dtypes, strict=True)])


def _broadcast_helper(rank, group):
    for dtype, value in ((torch.float, -1e-10), (torch.double, -1e-100), (torch.int8, -2),
                         (torch.uint8, 129), (torch.int, -1e5), (torch.long, -1e15)):
        for src in range(WORLD):
            expected = _build_tensor(src + 1, value, dtype)
            tensor = expected.clone() if rank == src else _build_tensor(src + 1, -1, dtype)
            dist.broadcast(tensor, src, group)
            assert_equal(tensor, expected)


@case
def torch_test_broadcast(rank, group):
    _broadcast_helper(rank, None)


@case
def torch_test_broadcast_full_group(rank, group):
    _broadcast_helper(rank, group)


@case
def torch_test_reduce_sum(rank, group):
    for src in range(WORLD):
        tensor = _build_tensor(src + 1).fill_(2 if rank == src else 10)
        dist.reduce(tensor, src, dist.ReduceOp.SUM)
        if rank == src:
            assert_equal(tensor, _build_tensor(src + 1, 2 + 10 * (WORLD - 1)))


@case
def torch_test_reduce_sum_twice(rank, group):
    for src in range(WORLD):
        tensors = [_build_tensor(src + 1).fill_(2 if rank == src else 10) for _ in range(2)]
        for tensor in tensors:
            dist.reduce(tensor, src, dist.ReduceOp.SUM)
        if rank == src:
            for tensor in tensors:
                assert_equal(tensor, _build_tensor(src + 1, 2 + 10 * (WORLD - 1)))


@case
def torch_test_scatter(rank, group):
    for dest in range(WORLD):
        tensor = _build_tensor(dest + 1, -1)
        tensors = [_build_tensor(dest + 1, i) for i in range(WORLD)] if rank == dest else []
        dist.scatter(tensor, src=dest, scatter_list=tensors)
        assert_equal(tensor, _build_tensor(dest + 1, rank))


@case
def torch_test_scatter_complex(rank, group):
    for dest in range(WORLD):
        tensor = _build_tensor(dest + 1, -1, torch.cfloat)
        tensors = ([_build_tensor(dest + 1, i, torch.cfloat) for i in range(WORLD)]
                   if rank == dest else [])
        dist.scatter(tensor, src=dest, scatter_list=tensors)
        assert_equal(tensor, _build_tensor(dest + 1, rank, torch.cfloat))


@case
def torch_test_gather(rank, group):
    for dest in range(WORLD):
        tensor = _build_tensor(dest + 1, rank)
        tensors = [_build_tensor(dest + 1, -1) for _ in range(WORLD)] if rank == dest else []
        dist.gather(tensor, dst=dest, gather_list=tensors)
        if rank == dest:
            assert_equal(tensors, [_build_tensor(dest + 1, i) for i in range(WORLD)])


def _all_gather_helper(rank, group, dtype=torch.float):
    for dest in range(WORLD):
        tensor = _build_tensor(dest + 1, rank, dtype=dtype)
        tensors = [_build_tensor(dest + 1, -1, dtype=dtype) for _ in range(WORLD)]
        dist.all_gather(tensors, tensor, group)
        assert_equal(tensors, [_build_tensor(dest + 1, i, dtype=dtype) for i in range(WORLD)])


@case
def torch_test_all_gather(rank, group):
    _all_gather_helper(rank, None)


@case
def torch_test_all_gather_complex(rank, group):
    _all_gather_helper(rank, None, torch.cfloat)


@case
def torch_test_all_gather_full_group(rank, group):
    _all_gather_helper(rank, group)


@case
def torch_test_all_gather_coalesced_simple(rank, group):
    for dtype in (torch.float, torch.long):
        inputs = [torch.full((i + 1, 2), rank * 10 + i, dtype=dtype) for i in range(3)]
        outputs = [[torch.empty_like(t) for t in inputs] for _ in range(WORLD)]
        dist.all_gather_coalesced(outputs, inputs)
        for r, outs in enumerate(outputs):
            assert_equal(outs, [torch.full((i + 1, 2), r * 10 + i, dtype=dtype)
                                for i in range(3)])


@case
def torch_test_all_gather_into_cat_and_stack_tensor(rank, group):
    """test_all_gather_into_{cat,stack}_tensor_cuda on CPU tensors."""
    tensor = torch.full((2, 3), float(rank))
    cat = torch.empty(2 * WORLD, 3)
    dist.all_gather_into_tensor(cat, tensor)
    stack = torch.empty(WORLD, 2, 3)
    dist.all_gather_into_tensor(stack, tensor)
    expected = torch.stack([torch.full((2, 3), float(r)) for r in range(WORLD)])
    assert_equal(cat, expected.reshape(2 * WORLD, 3))
    assert_equal(stack, expected)


@case
def torch_test_reduce_scatter_tensor(rank, group):
    """test_reduce_scatter_tensor_cuda on CPU tensors, both layouts, and the list form."""
    size = 2
    tensor = torch.arange(size * WORLD, dtype=torch.float) * (rank + 1)
    out = torch.empty(size)
    dist.reduce_scatter_tensor(out, tensor, dist.ReduceOp.SUM)
    total = sum(r + 1 for r in range(WORLD))
    expected = torch.arange(size * WORLD, dtype=torch.float)[rank * size:(rank + 1) * size]
    assert_equal(out, expected * total)
    stacked = tensor.reshape(WORLD, size)
    dist.reduce_scatter_tensor(out, stacked, dist.ReduceOp.SUM)
    assert_equal(out, expected * total)
    dist.reduce_scatter(out, list(tensor.chunk(WORLD)), dist.ReduceOp.SUM)
    assert_equal(out, expected * total)


@case
def torch_test_barrier(rank, group):
    """_test_barrier_helper: nobody leaves the barrier before the last one enters it."""
    wait_s = 0.3
    for dest in range(WORLD):
        expected_time = torch.DoubleTensor(1).fill_(0.0)
        if dest == rank:
            expected_time.fill_(time.time() + wait_s)
            dist.broadcast(expected_time, dest)
            time.sleep(wait_s + 0.1)
            dist.barrier()
        else:
            dist.broadcast(expected_time, dest)
            dist.barrier()
            assert time.time() >= float(expected_time[0]), (dest, rank)


@case
def torch_test_barrier_full_group(rank, group):
    dist.barrier(group)


@case
def torch_test_get_backend_rank_size(rank, group):
    """test_get_backend, test_get_rank (all_gather_object), test_get_rank_size_full_group."""
    assert dist.get_backend() == "reducer" and dist.get_backend(group) == "reducer"
    ranks = [None] * WORLD
    dist.all_gather_object(ranks, dist.get_rank())
    assert ranks == list(range(WORLD))
    assert (dist.get_world_size(group), dist.get_rank(group)) == (WORLD, rank)


@case
def torch_test_all_gather_object_default_pg(rank, group):
    torch.manual_seed(0)  # Foo(torch.randn(3, 3)) the same on every rank
    objects = create_collectives_object_test_list()
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, objects[rank % len(objects)])
    assert gathered == [objects[r % len(objects)] for r in range(WORLD)]


@case
def torch_test_gather_object(rank, group):
    torch.manual_seed(0)
    objects = create_collectives_object_test_list()
    gathered = [None] * WORLD
    dist.gather_object(objects[rank % len(objects)], gathered if rank == 0 else None, dst=0)
    expected = [objects[r % len(objects)] for r in range(WORLD)] if rank == 0 else [None] * WORLD
    assert gathered == expected


@case
def torch_test_broadcast_object_list(rank, group):
    torch.manual_seed(0)
    objects = create_collectives_object_test_list()
    got = objects if rank == 0 else [None] * len(objects)
    single = [got[0]] if rank == 0 else [None]
    dist.broadcast_object_list(single, src=0)
    assert single[0] == objects[0]
    dist.broadcast_object_list(got, src=0)
    assert got == objects


@case
def torch_test_scatter_object_list(rank, group):
    torch.manual_seed(0)
    objects = create_collectives_object_test_list()
    scatter = objects[:WORLD] if rank == 0 else [None] * WORLD
    out = [None]
    dist.scatter_object_list(out, scatter, src=0)
    assert out[0] == objects[rank % len(objects)]


def _ddp_cpu(rank, gradient_as_bucket_view):
    """_test_DistributedDataParallelCPU: DDP(Net) on each rank's slice against
    Net on the whole batch, 5 iterations (torch's _test_DDP_niter, its
    zero_grad step; compared with assert_close's float32 tolerance, as
    torch's assertEqual does)."""
    torch.manual_seed(0)  # the same model and data on every rank
    model_base = Net()
    model_ddp = nn.parallel.DistributedDataParallel(
        copy.deepcopy(model_base), gradient_as_bucket_view=gradient_as_bucket_view)
    local_bs = 2
    global_bs = WORLD * local_bs
    inputs, target, loss = torch.randn(global_bs, 2), torch.randn(global_bs, 4), nn.MSELoss()
    offset = rank * local_bs
    for _ in range(5):
        for model, x, y, scale in ((model_base, inputs, target, 1.0),
                                   (model_ddp, inputs[offset:offset + local_bs],
                                    target[offset:offset + local_bs],
                                    WORLD * local_bs / global_bs)):
            model.train()
            (loss(model(x), y) * scale).backward()
            for param in model.parameters():
                if param.grad is not None:
                    with torch.no_grad():
                        param += param.grad
                    param.grad.requires_grad_(False)
                    param.grad.zero_()
        torch.testing.assert_close(list(model_base.parameters()),
                                   list(model_ddp.module.parameters()))
        inputs = inputs[torch.randperm(global_bs)]  # the same permutation on every rank


@case
def torch_test_DistributedDataParallelCPU(rank, group):  # noqa: N802 - torch's name
    _ddp_cpu(rank, False)


@case
def torch_test_DistributedDataParallelCPU_grad_is_view(rank, group):  # noqa: N802
    _ddp_cpu(rank, True)


# -- torch's cases that do not apply: each is refused, naming the op ----------------

def _refused(call, peer):
    try:
        call(peer)
    except (NotImplementedError, ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


UNSUPPORTED = {
    # The daemons only sum: MIN, MAX, PRODUCT are refused (UnsupportedOpError).
    "test_all_reduce_max": lambda peer: dist.all_reduce(torch.ones(2), dist.ReduceOp.MAX),
    "test_all_reduce_min": lambda peer: dist.all_reduce(torch.ones(2), dist.ReduceOp.MIN),
    "test_all_reduce_product": lambda peer: dist.all_reduce(torch.ones(2), dist.ReduceOp.PRODUCT),
    "test_reduce_max": lambda peer: dist.reduce(torch.ones(2), 0, dist.ReduceOp.MAX),
    "test_all_reduce_coalesced_max": lambda peer: dist.all_reduce_coalesced(
        [torch.ones(2)], dist.ReduceOp.MAX),
    # No point-to-point traffic through the daemons.
    "test_send_recv": lambda peer: dist.send(torch.ones(2), dst=peer),
    "test_isend": lambda peer: dist.isend(torch.ones(2), dst=peer),
    "test_irecv": lambda peer: dist.irecv(torch.ones(2), src=peer),
    "test_all_to_all": lambda peer: dist.all_to_all([torch.ones(1)] * WORLD,
                                               [torch.ones(1)] * WORLD),
    "test_all_to_all_single_equal_split": lambda peer: dist.all_to_all_single(
        torch.ones(WORLD), torch.ones(WORLD)),
}


def torch_cases_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401 - registers "reducer"

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=30))
    passed, failed, refused = [], {}, {}
    try:
        full_group = dist.new_group(list(range(world)))
        for name, run in CASES.items():
            try:
                run(rank, full_group)
                passed.append(name)
            except Exception:  # noqa: BLE001 - reported with its traceback
                failed[name] = traceback.format_exc(limit=4)
        for name, call in UNSUPPORTED.items():
            refused[name] = _refused(call, 1 - rank)
        dist.barrier()  # the ranks still agree on their rounds after the refusals
        return {"passed": passed, "failed": failed, "refused": refused}
    finally:
        dist.destroy_process_group()


def test_torch_distributed_test_cases_on_two_ranks(daemons):
    with daemons(2, round_timeout=30) as d:
        results = run_workers(torch_cases_worker, WORLD,
                              (torchrun_env(d.addresses, REDUCER_WIRE_DTYPE="float32"),),
                              timeout=200)
    for rank, out in enumerate(results):
        assert out["failed"] == {}, f"rank {rank}:\n" + "\n".join(
            f"{name}:\n{text}" for name, text in out["failed"].items())
        assert out["passed"] == list(CASES)
        for name, message in out["refused"].items():
            assert message is not None, f"{name} was not refused"
            print(f"rank {rank} {name}: {message.splitlines()[0][:160]}")
            assert "reducer" in message.lower(), (name, message)
