"""The PyTorch shim's CUDA paths on a real GPU, against DDP over Gloo on the same GPU.

Skipped where torch sees no CUDA device (CI, the developers' machines); run on
a GPU machine with `scripts/cuda_check.sh`. Real daemons on 127.0.0.1, two
spawned workers sharing one GPU. One launch runs every scenario; each test
checks its own part of the results.

Every backward passes through `SlowBackward`, which keeps the GPU busy for
milliseconds before the earlier layers' gradients are computed: autograd (and
so DDP's hook and the DistributedOptimizer's hooks) runs ahead of the GPU, so
a staging copy not ordered after the gradient kernels on their stream reads
stale gradients, and the parameters then disagree with Gloo's.
"""

from __future__ import annotations

import copy
import traceback
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import ReducerClient  # noqa: E402
from support import run_workers  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

WORLD_SIZE = 2
STEPS = 6
LR = 0.05
GPU_SLEEP_CYCLES = 20_000_000  # about 10 ms at the H200's clock
BROADCAST_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64")
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "float32": 2.0 ** -24}


class SlowBackward(torch.autograd.Function):
    """Identity whose backward makes the GPU wait before the gradient flows on."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        return grad


class Net(torch.nn.Module):
    """Two linear layers either side of SlowBackward, a buffer, several DDP buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(),
                                         torch.nn.Linear(512, 512), torch.nn.Tanh())
        self.norm = torch.nn.BatchNorm1d(512)
        self.last = torch.nn.Linear(512, 8)

    def forward(self, x):
        return self.last(SlowBackward.apply(self.norm(self.first(x))))


def _batch(step: int, rank: int, device) -> tuple:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(32, 64, generator=gen).to(device),
            torch.randn(32, 8, generator=gen).to(device))


def _train(model, opt, rank: int, device) -> float:
    """STEPS SGD steps on this rank's batches; the largest local gradient seen."""
    largest = 0.0
    for step in range(STEPS):
        x, y = _batch(step, rank, device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if isinstance(model, DDP):  # this rank's own gradient, for the tolerance
            local = torch.autograd.grad(
                torch.nn.functional.mse_loss(model.module(x), y),
                [p for p in model.module.parameters() if p.requires_grad])
            largest = max(largest, *(g.abs().max().item() for g in local))
        opt.step()
    torch.cuda.synchronize()
    return largest


def _host(tensors) -> list[np.ndarray]:
    return [t.detach().float().cpu().numpy().copy() for t in tensors]


def _bits(tensor) -> np.ndarray:
    """The tensor's exact contents as NumPy (torch tensors do not survive the
    result queue once the worker has exited); bfloat16 as its 16-bit words."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().copy()


def _training(rank: int, addresses: list[str], job: str, device) -> dict:
    """DDP over Gloo, DDP with the hook (float16 and float32 wires), the optimizer."""
    torch.manual_seed(0)
    base = Net().to(device)
    out: dict = {}
    clients = {w: ReducerClient(addresses, job=f"{job}-{w}", rank=rank,
                                world_size=WORLD_SIZE, wire_dtype=w, timeout=60)
               for w in ("float16", "float32")}
    try:
        for system in ("gloo", "hook-float16", "hook-float32", "optimizer-float32"):
            if system.startswith("optimizer"):
                model = copy.deepcopy(base)
                opt = rt.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=LR),
                    named_parameters=model.named_parameters(), bucket_bytes=64 << 10,
                    reducer=clients["float32"])
                _train(model, opt, rank, device)
                # The averaged gradients step() applied: still on the GPU.
                out[system] = {"params": _host(model.parameters()),
                               "grad_devices": sorted({p.grad.device.type
                                                       for p in model.parameters()})}
                continue
            model = DDP(copy.deepcopy(base), device_ids=[device.index], bucket_cap_mb=0.25)
            if system != "gloo":
                model.register_comm_hook(state=clients[system.split("-")[1]],
                                         hook=rt.allreduce_hook)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            largest = _train(model, opt, rank, device)
            out[system] = {"params": _host(model.module.parameters()),
                           "buffers": _host(model.module.buffers()), "largest": largest}
    finally:
        for client in clients.values():
            client.close()
    return out


def _broadcasts(rank: int, device) -> dict:
    """broadcast_parameters / _optimizer_state / allreduce / allgather of CUDA tensors."""
    gen = torch.Generator().manual_seed(7 + rank)
    params = {}
    for name in BROADCAST_DTYPES:
        dtype = getattr(torch, name)
        values = (torch.randint(-1000, 1000, (4099,), generator=gen) if name == "int64"
                  else torch.randn(4099, generator=gen, dtype=torch.float64))
        params[name] = values.to(dtype).to(device)
    rt.broadcast_parameters(params, root_rank=1)
    model = torch.nn.Linear(33, 17).to(device)
    torch.nn.init.normal_(model.weight, generator=torch.Generator(device).manual_seed(rank))
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1))
    model(torch.ones(2, 33, device=device)).sum().backward()
    opt.step()
    rt.broadcast_parameters(model.state_dict(), root_rank=1)
    rt.broadcast_optimizer_state(opt, root_rank=1)
    state = opt.state_dict()
    exp_avg = [s["exp_avg"] for s in state["state"].values()]
    # Integers exactly representable in every dtype: the sums are exact.
    sums = {}
    for name in ("float32", "float16", "bfloat16"):
        tensor = (torch.arange(1000, device=device) % 64 + rank).to(getattr(torch, name))
        summed = rt.allreduce(tensor, op=rt.Sum, name=f"sum-{name}")
        in_place = tensor.clone()
        rt.allreduce_(in_place, op=rt.Average, name=f"avg-{name}")
        sums[name] = {"device": summed.device.type, "dtype": str(summed.dtype),
                      "sum": summed.float().cpu().numpy(), "avg": in_place.float().cpu().numpy(),
                      "in_place_device": in_place.device.type}
    gathered = rt.allgather(torch.full((rank + 1, 3), float(rank), device=device))
    return {"params": {k: _bits(v) for k, v in params.items()},
            "dtypes": {k: str(v.dtype) for k, v in params.items()},
            "devices": sorted({v.device.type for v in params.values()}),
            "model": {k: _bits(v) for k, v in model.state_dict().items()},
            "lr": state["param_groups"][0]["lr"],
            "exp_avg": [_bits(t) for t in exp_avg],
            "sums": sums,
            "gathered": gathered.cpu().numpy(), "gathered_device": gathered.device.type}


def cuda_worker(rank: int, world_size: int, addresses: list[str], init_file: str,
                job: str) -> dict:
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    rt.init(addresses=addresses, job=f"{job}-rt", rank=rank, world_size=world_size,
            timeout=60)
    results: dict = {}
    try:
        for name, scenario in (("training", lambda: _training(rank, addresses, job, device)),
                               ("broadcasts", lambda: _broadcasts(rank, device))):
            try:
                results[name] = scenario()
            except Exception:
                results[name] = traceback.format_exc()
    finally:
        rt.shutdown()
        dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from reducerd.ops.local import running_daemons

    tmp = tmp_path_factory.mktemp("cuda")
    with running_daemons(2, log_dir=tmp, round_timeout=60) as daemons:
        return run_workers(cuda_worker, WORLD_SIZE,
                           (daemons.addresses, str(tmp / "pg-init"), uuid.uuid4().hex),
                           timeout=150)


def _part(results, name: str) -> list[dict]:
    parts = [r[name] for r in results]
    for rank, part in enumerate(parts):
        if isinstance(part, str):
            pytest.fail(f"rank {rank}, {name}:\n{part}")
    return parts


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_ranks_end_with_identical_parameters(results):
    ranks = _part(results, "training")
    for system in ranks[0]:
        for a, b in zip(ranks[0][system]["params"], ranks[1][system]["params"], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=system)


@pytest.mark.parametrize("system", ["hook-float16", "hook-float32", "optimizer-float32"])
def test_cuda_reductions_match_gloo_on_the_same_gpu(results, system):
    """Within the wire's bound of DDP over Gloo's float32 average, after STEPS steps.

    A wire of unit roundoff u: each rank's gradient rounded once, the float32
    sum and the mean once more, so the average is off by at most (2 + N) u G
    (G the largest gradient of a rank); STEPS SGD steps of LR move the
    parameters by at most STEPS LR (2 + N) u G, doubled for the drift a
    changed parameter causes in later gradients. A stale gradient (a staging
    copy not ordered after its kernels) is off by the gradient itself.
    """
    ranks = _part(results, "training")
    largest = max(r["gloo"]["largest"] for r in ranks)
    wire = system.rsplit("-", 1)[1]
    bound = 2 * STEPS * LR * (2 + WORLD_SIZE) * UNIT_ROUNDOFF[wire] * largest
    if wire == "float32":  # summation order and float32 rounding of the update
        bound += 1e-6
    diff = _max_diff(ranks[0][system]["params"], ranks[0]["gloo"]["params"])
    print(f"{system}: max |param - gloo float32| = {diff:.3g} (bound {bound:.3g})")
    assert diff <= bound, f"{system}: {diff:.3g} > {bound:.3g}"
    if system.startswith("optimizer"):
        assert ranks[0][system]["grad_devices"] == ["cuda"]


def test_broadcasts_are_exact_and_stay_on_the_gpu(results):
    ranks = _part(results, "broadcasts")
    root = ranks[1]
    for part in ranks:
        assert part["devices"] == ["cuda"]
        for name in BROADCAST_DTYPES:
            assert part["dtypes"][name] == f"torch.{name}"
            np.testing.assert_array_equal(part["params"][name], root["params"][name])
        for key, value in root["model"].items():
            np.testing.assert_array_equal(part["model"][key], value, err_msg=key)
        assert part["lr"] == root["lr"] == pytest.approx(0.2)
        for got, want in zip(part["exp_avg"], root["exp_avg"], strict=True):
            np.testing.assert_array_equal(got, want)
    # The ranks drew different values before the broadcast.
    before = torch.randn(4099, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert not np.array_equal(root["params"]["float32"], before.float().numpy())


def test_allreduce_and_allgather_of_cuda_tensors(results):
    ranks = _part(results, "broadcasts")
    base = np.arange(1000) % 64
    for part in ranks:
        for name, got in part["sums"].items():
            assert got["device"] == got["in_place_device"] == "cuda", name
            assert got["dtype"] == f"torch.{name}"
            np.testing.assert_array_equal(got["sum"], 2 * base + 1, err_msg=name)
            np.testing.assert_array_equal(got["avg"], base + 0.5, err_msg=name)
        assert part["gathered_device"] == "cuda"
        np.testing.assert_array_equal(part["gathered"],
                                      np.array([[0.0] * 3, [1.0] * 3, [1.0] * 3]))
