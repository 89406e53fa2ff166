"""Training parity on the 8-bit wire: error feedback keeps int8 close to float32.

A small MLP learns a teacher's function with Adam. One input feature, which
the teacher ignores, is 300x the scale of the others, so its weights'
gradients share int8 blocks with gradients ~300x smaller: below half a
quantization step, those round to zero on every step unless error feedback
(reducer_client.feedback) carries them into later steps.

One training run's final loss says little: from one seed to the next the
float32 run's alone moved by 1.4x, and with Adam at lr 0.01 (this test's
first version) by 2x, so a single seeded run passed on one CPU model and
failed on another (AMD EPYC Zen 4: +23 % with feedback, -5 % without: the
float32 run's own numerics differ by CPU). So each system trains from
SEEDS students, on the same per-rank batches, the loss is the evaluation
loss averaged over the last TAIL steps, and systems compare by its mean
over the seeds:
- int8 with error feedback within MARGIN (20 %) of float32 (measured on
  Zen 4 and Zen 3: +9.0 % with the DistributedOptimizer on 4 ranks; over 6
  seeds on 4 ranks +13.8 %; +7.2 % with the DDP hook on 2 workers, whose
  residuals follow their parameters through DDP's bucket rebuild after the
  first step: +11.1 % while that step's residual was added to other
  parameters, +20.9 % with it forgotten);
- without feedback worse than with it (measured +23.7 % and +27.3 %).
  The DistributedOptimizer's was far worse while its presence flags
  shared an int8 block with the bucket's last gradients
  (test_optimizer_int8_blocks.py).
DistributedOptimizer runs on LocalGroup (ranks as threads, the daemon's
numerics); the DDP hook on real daemons with spawned workers.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import reducer_client.torch as rt  # noqa: E402
from reducer_client import ReducerClient  # noqa: E402
from reducer_client.testing import LocalGroup  # noqa: E402
from support import run_workers  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STEPS = 150
LR = 0.003
TAIL = 30  # the loss: evaluated after each of the last TAIL steps, averaged
SEEDS = (0, 1, 2, 3)  # students; the systems compare by the mean over them
MARGIN = 0.20  # relative to the float32 runs' mean loss
SYSTEMS = (("float32", None), ("int8", True), ("int8", False))


def _teacher() -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def make_student(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


_TEACHER = _teacher()
_SCALE = torch.tensor([300.0] + [1.0] * 15)  # feature 0: loud, and ignored by the teacher
_USED = torch.tensor([0.0] + [1.0] * 15)


def data(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * step + rank)
    z = torch.randn(size, 16, generator=gen)
    with torch.no_grad():
        y = _TEACHER(z * _USED) + 0.01 * torch.randn(size, 4, generator=gen)
    return z * _SCALE, y


def eval_loss(model: nn.Module) -> float:
    x, y = data(10 ** 6, 0, 512)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def check(per_seed: dict[str, list[float]]) -> None:
    """per_seed: each system's loss for each of SEEDS."""
    losses = {name: sum(values) / len(values) for name, values in per_seed.items()}
    base, fed, plain = losses["float32"], losses["int8+feedback"], losses["int8"]
    print(f"per seed: {per_seed}")
    print(f"mean loss: float32 {base:.5f}, int8 with feedback {fed:.5f} "
          f"({(fed - base) / base:+.1%}), int8 without {plain:.5f} ({(plain - base) / base:+.1%})")
    assert abs(fed - base) <= MARGIN * base, losses
    assert plain > fed, losses  # what feedback is for: the small gradients got through


def train(opt, model: nn.Module, rank: int) -> float:
    """STEPS steps on this rank's batches; the evaluation loss averaged over the last TAIL."""
    tail = []
    for step in range(STEPS):
        x, y = data(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step >= STEPS - TAIL:
            tail.append(eval_loss(model.module if hasattr(model, "module") else model))
    return sum(tail) / len(tail)


def _optimizer_rank(rank: int, reducer, model: nn.Module, feedback: bool | None) -> float:
    if feedback is not None:
        rt.set_error_feedback(feedback, reducer)
    opt = rt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR),
                                  named_parameters=model.named_parameters(), reducer=reducer)
    return train(opt, model, rank)


def test_distributed_optimizer_int8_with_feedback_trains_like_float32():
    torch.set_num_threads(1)
    world, losses = 4, {}
    for seed in SEEDS:
        for wire, feedback in SYSTEMS:
            group = LocalGroup(world, wire_dtype=wire, timeout=60)
            models = [make_student(seed) for _ in range(world)]  # seeded: identical
            with ThreadPoolExecutor(world) as pool:
                results = [pool.submit(_optimizer_rank, rank, group.client(rank),
                                       models[rank], feedback) for rank in range(world)]
                finals = [f.result(240) for f in results]
            assert len(set(finals)) == 1  # every rank ends with the same model
            losses.setdefault(wire + ("+feedback" if feedback else ""), []).append(finals[0])
    check(losses)


def ddp_worker(rank: int, world: int, addresses: list[str], init_file: str,
               job: str) -> dict[str, list[float]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    losses: dict[str, list[float]] = {}
    try:
        for seed in SEEDS:
            for wire, feedback in SYSTEMS:
                name = wire + ("+feedback" if feedback else "")
                with ReducerClient(addresses, job=f"{job}-{name}-{seed}", rank=rank,
                                   world_size=world, wire_dtype=wire, timeout=60) as client:
                    rt.set_error_feedback(bool(feedback), client)
                    model = DDP(make_student(seed))
                    model.register_comm_hook(state=client, hook=rt.allreduce_hook)
                    opt = torch.optim.Adam(model.parameters(), lr=LR)
                    losses.setdefault(name, []).append(train(opt, model, rank))
    finally:
        dist.destroy_process_group()
    return losses


def test_ddp_hook_int8_with_feedback_trains_like_float32(daemons, tmp_path):
    with daemons(2, round_timeout=60) as d:
        results = run_workers(ddp_worker, 2, (d.addresses, str(tmp_path / "pg"),
                                              uuid.uuid4().hex), timeout=280)
    assert results[0] == results[1]  # every rank ends with the same model
    check(results[0])
