"""DDP with reducer_client.torch.allreduce_hook against DDP with Gloo's own allreduce.

Real daemons, real spawned workers. Each worker trains the same models from
the same seeds on the same per-rank batches, once with Gloo's allreduce and
once per wire dtype with the hook, all in one process group, and reports
final parameters and step times.
"""

from __future__ import annotations

import copy
import statistics
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import ReducerClient  # noqa: E402
from support import run_workers  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

STEPS = 20
LR = 0.05
# A tiny DDP bucket cap for the CNN, so it has several buckets (several keys).
BUCKET_CAP_MB = {"mlp": 25, "cnn": 0.002}


def ddp_worker(rank: int, world_size: int, addresses: list[str], init_file: str,
               job: str, wire_dtypes: tuple[str, ...]) -> dict:
    """Train each model with Gloo and with the hook per wire dtype; return params and times."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    clients = {w: ReducerClient(addresses, job=f"{job}-{w}", rank=rank,
                                world_size=world_size, wire_dtype=w, timeout=60)
               for w in wire_dtypes}
    out: dict = {}
    try:
        for kind in ("mlp", "cnn"):
            base = make_model(kind)
            for system in ("gloo", *wire_dtypes):
                model = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB[kind])
                if system != "gloo":
                    model.register_comm_hook(state=clients[system], hook=rt.allreduce_hook)
                opt = torch.optim.SGD(model.parameters(), lr=LR)
                step_s, max_grad = [], 0.0
                for step in range(STEPS):
                    x, y = batch(kind, step, rank)
                    start = time.perf_counter()
                    opt.zero_grad()
                    loss_of(kind, model(x), y).backward()
                    opt.step()
                    step_s.append(time.perf_counter() - start)
                    if system == "gloo":  # this rank's own gradient, before averaging
                        local = torch.autograd.grad(loss_of(kind, model.module(x), y),
                                                    list(model.module.parameters()))
                        max_grad = max(max_grad, *(g.abs().max().item() for g in local))
                out[kind, system] = {
                    "params": [p.detach().numpy().copy() for p in model.parameters()],
                    # The first steps build DDP's buckets: leave them out.
                    "step_s": statistics.median(step_s[2:]),
                    "max_grad": max_grad,
                }
    finally:
        for client in clients.values():
            client.close()
        dist.destroy_process_group()
    return out


# Parameter tolerance per wire dtype, against Gloo's float32 average.
# float16 / bfloat16: every rank's gradient is rounded to the wire dtype
# (relative error <= u, u = 2^-11 for float16, 2^-8 for bfloat16), the
# daemons sum in float32 and round the mean once more (<= u), so the averaged
# gradient is off by at most 2uG, G the largest gradient of any one rank.
# An SGD step moves a parameter by LR * g, so after STEPS steps the
# parameters are off by at most STEPS * LR * 2uG; we allow 2x that for the
# drift that a changed parameter causes in later gradients (measured: under
# 0.1x, as the rounding errors of different steps mostly cancel).
# float32: only the summation order and where the division by the world size
# happens differ from Gloo (a few ulp per step).
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def tolerance(wire_dtype: str, max_grad: float) -> float:
    if wire_dtype == "float32":
        return 1e-5
    return 2 * STEPS * LR * max_grad * 2 * UNIT_ROUNDOFF[wire_dtype]


def check_against_gloo(results: list[dict], wire_dtypes: tuple[str, ...]) -> list[str]:
    report = []
    for kind in ("mlp", "cnn"):
        reference = results[0][kind, "gloo"]
        max_grad = max(r[kind, "gloo"]["max_grad"] for r in results)
        for rank_result in results:  # every rank ends with the same parameters
            for system in ("gloo", *wire_dtypes):
                for a, b in zip(rank_result[kind, system]["params"],
                                results[0][kind, system]["params"], strict=True):
                    np.testing.assert_array_equal(a, b)
        times = {"gloo": reference["step_s"]}
        for wire_dtype in wire_dtypes:
            got = results[0][kind, wire_dtype]
            diff = max(float(np.abs(a - b).max())
                       for a, b in zip(got["params"], reference["params"], strict=True))
            tol = tolerance(wire_dtype, max_grad)
            assert diff <= tol, f"{kind} {wire_dtype}: max |param diff| {diff:.3g} > {tol:.3g}"
            times[wire_dtype] = got["step_s"]
            report.append(f"{kind} wire={wire_dtype}: max |param - gloo| = {diff:.2e} "
                          f"(tolerance {tol:.2e})")
        report.append(f"{kind}, {len(results)} workers, rank 0's median step time: " + ", ".join(
            f"{name} {seconds * 1e3:.2f} ms" for name, seconds in times.items()))
    return report


@pytest.mark.parametrize("world_size, wire_dtypes", [
    pytest.param(2, ("float16", "bfloat16", "float32"), id="2workers"),
    pytest.param(4, ("float16",), id="4workers"),
])
def test_ddp_hook_matches_gloo(daemons, tmp_path, world_size, wire_dtypes):
    """20 SGD steps of an MLP and a CNN: the hook's parameters equal Gloo's within tolerance."""
    with daemons(2, round_timeout=60) as d:
        results = run_workers(ddp_worker, world_size,
                              (d.addresses, str(tmp_path / "pg-init"), uuid.uuid4().hex,
                               wire_dtypes), timeout=240)
    for line in check_against_gloo(results, wire_dtypes):
        print(line)
