"""PyTorch Lightning and Hugging Face Accelerate on the "reducer" backend, against one process.

Two torchrun-style workers (backend_workers.init_worker: RANK, WORLD_SIZE,
LOCAL_RANK, ... and REDUCER_* in the environment) train test_torch_ddp's
MLP with plain SGD for STEPS steps, each on its own half of every batch,
with nothing but the framework's own configuration naming the backend:
- Lightning: Trainer(strategy=DDPStrategy(process_group_backend="reducer"),
  accelerator="cpu", devices=2); Lightning sees torchrun's variables
  (TorchElasticEnvironment), calls init_process_group("reducer") and wraps
  the module in DDP with no hook.
- Accelerate (1.16): init_process_group("reducer") first, then
  Accelerator(cpu=True), which keeps the group it finds and wraps the model
  in DDP over it. (Accelerate picks Gloo itself for CPU and refuses any other
  backend named through InitProcessGroupKwargs when cpu=True.)
The parameters are compared with one process trained in float64 on the full
batches (test_backend_ddp.full_batch_reference) within
test_torch_ddp.tolerance for the float16 wire: every rank's contribution and
the mean rounded to float16 on each step, from the largest gradient any rank
had on the reference's trajectory. Both ranks must end with the same
parameters (they see different data: only the reduction makes them agree).
Each test skips only where its framework is not installed.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from backend_workers import init_worker, torchrun_env  # noqa: E402
from support import run_workers  # noqa: E402
from test_backend_ddp import full_batch_reference  # noqa: E402
from test_torch_ddp import LR, STEPS, tolerance  # noqa: E402
from torch_shim_models import batch, loss_of, make_model  # noqa: E402

pytestmark = pytest.mark.timeout(240)

WIRE = "float16"
WORLD = 2


def _params(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def lightning_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    init_worker(rank, world, env)
    import pytorch_lightning as pl
    import reducer_client.torch  # noqa: F401 - registers "reducer"
    from pytorch_lightning.strategies import DDPStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model("mlp")
            self.wrapper: dict = {}

        def training_step(self, data, _index):
            ddp = self.trainer.strategy.model  # while training: the DDP wrapper
            self.wrapper = {"ddp": type(ddp).__name__,
                            "group": type(getattr(ddp, "process_group", None)).__name__}
            x, y = data
            return loss_of("mlp", self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Module()
    loader = torch.utils.data.DataLoader([batch("mlp", step, rank) for step in range(STEPS)],
                                         batch_size=None)
    strategy = DDPStrategy(process_group_backend="reducer",
                           timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS,
                         max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0)
    try:
        trainer.fit(module, loader)
        return {"backend": dist.get_backend(), **module.wrapper, "steps": trainer.global_step,
                "params": _params(module.model)}
    finally:
        dist.destroy_process_group()


def accelerate_worker(rank: int, world: int, env: dict[str, str]) -> dict:
    init_worker(rank, world, env)
    import reducer_client.torch  # noqa: F401 - registers "reducer"
    from accelerate import Accelerator

    dist.init_process_group("reducer", timeout=datetime.timedelta(seconds=60))
    try:
        accelerator = Accelerator(cpu=True)
        model = make_model("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        ddp, opt = accelerator.prepare(model, opt)
        for step in range(STEPS):
            x, y = batch("mlp", step, rank)
            opt.zero_grad()
            accelerator.backward(loss_of("mlp", ddp(x), y))
            opt.step()
        return {"backend": dist.get_backend(), "group": type(ddp.process_group).__name__,
                "ddp": type(ddp).__name__, "steps": STEPS,
                "distributed_type": accelerator.distributed_type.value,
                "processes": accelerator.num_processes,
                "params": _params(accelerator.unwrap_model(ddp))}
    finally:
        dist.destroy_process_group()


def max_local_gradient(world: int) -> float:
    """The largest |gradient| any rank's half batch gives along the float64
    reference's trajectory (the G of test_torch_ddp.tolerance)."""
    model = make_model("mlp").double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    largest = 0.0
    for step in range(STEPS):
        halves = [batch("mlp", step, r) for r in range(world)]
        for x, y in halves:
            grads = torch.autograd.grad(loss_of("mlp", model(x.double()), y.double()),
                                        list(model.parameters()))
            largest = max(largest, *(g.abs().max().item() for g in grads))
        opt.zero_grad()
        x = torch.cat([h[0] for h in halves]).double()
        y = torch.cat([h[1] for h in halves]).double()
        loss_of("mlp", model(x), y).backward()
        opt.step()
    return largest


def check_against_full_batch(results: list[dict]) -> None:
    for out in results:
        assert out["backend"] == "reducer" and out["group"] == "ReducerProcessGroup"
        assert out["ddp"] == "DistributedDataParallel" and out["steps"] == STEPS
        for a, b in zip(out["params"], results[0]["params"], strict=True):
            np.testing.assert_array_equal(a, b)  # the ranks agree, on different data
    reference = full_batch_reference(WORLD)
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(results[0]["params"], reference, strict=True))
    tol = tolerance(WIRE, 1.5 * max_local_gradient(WORLD))  # 1.5: the trajectories differ
    print(f"max |param - full-batch float64| = {diff:.2e} (tolerance {tol:.2e})")
    assert diff <= tol, (diff, tol)


def test_lightning_ddp_strategy_on_the_reducer_backend(daemons):
    pytest.importorskip("pytorch_lightning")
    with daemons(2, round_timeout=60) as d:
        results = run_workers(lightning_worker, WORLD,
                              (torchrun_env(d.addresses, REDUCER_WIRE_DTYPE=WIRE),),
                              timeout=200)
    check_against_full_batch(results)


def test_accelerate_on_the_reducer_backend(daemons):
    pytest.importorskip("accelerate")
    with daemons(2, round_timeout=60) as d:
        results = run_workers(accelerate_worker, WORLD,
                              (torchrun_env(d.addresses, REDUCER_WIRE_DTYPE=WIRE,
                                            OMP_NUM_THREADS="1"),),
                              timeout=200)
    for out in results:
        assert out["distributed_type"] == "MULTI_CPU" and out["processes"] == WORLD
    check_against_full_batch(results)
