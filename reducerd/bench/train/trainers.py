"""Each training system's step, through the real shim paths.

    reducerd-ddp             DDP with rt.allreduce_hook (DDP's own process group
                             is Gloo, used only for DDP's start-up broadcast)
    reducerd-backend         DDP with no hook over init_process_group("reducer")
                             (reducer_client.torch.backend): buckets, start-up
                             broadcast and all go through the daemons
    reducerd-optimizer       rt.DistributedOptimizer around SGD, no DDP
    reducerd-optimizer-xbar  the same with overlap_forward=model (crossing the barrier)
    reducerd-optimizer(-xbar)-priority  the same two with prioritize=True
    gloo-ddp-float32         DDP over Gloo, its built-in allreduce
    gloo-ddp-float16         DDP over Gloo with torch's fp16_compress_hook

Every system runs the same loop: zero_grad, forward, loss.backward(), step;
DDP and the optimizer start each bucket's reduction during backward.
"""

from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from reducerd.bench.train.modeled import ModeledModel

__all__ = ["Trainer", "TimedReducer", "make_trainer"]


class TimedReducer:
    """A Reducer that records when each allreduce started, then defers to the client.

    Used for the reducerd systems only (the launch times say whether each
    bucket left during backward); everything else is the client's own.
    `_lock` guards `launches` (autograd's thread appends, the loop takes).
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.launches: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def allreduce_async(self, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            self.launches.append(time.perf_counter())
        return self._client.allreduce_async(*args, **kwargs)

    def take(self) -> list[float]:
        with self._lock:
            launches, self.launches = self.launches, []
        return launches


class Trainer:
    """One system's training step on this rank."""

    def __init__(self, model: ModeledModel, spec: dict[str, Any]) -> None:
        self.model, self.spec = model, spec
        self.device = spec.get("device", "cpu")
        self.token = torch.zeros(1, device=self.device)
        self.reducer: TimedReducer | None = None
        self.opt: torch.optim.Optimizer

    def iteration(self) -> None:
        """zero_grad, forward, backward, optimizer step."""
        self.opt.zero_grad()
        self.forward().sum().backward()
        self.opt.step()

    def forward(self) -> torch.Tensor:
        return self.model(self.token)

    def settle(self) -> None:
        """Apply every update still pending (only crossing the barrier leaves any)."""

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.reducer is not None:
            self.reducer.close()


# DDP models of systems already run (DDPTrainer.close).
_RETIRED: list[Any] = []


def _gloo_group(spec: dict[str, Any]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://{spec['master']}", rank=spec["rank"],
        world_size=spec["world_size"],
        timeout=datetime.timedelta(seconds=spec["stall_timeout_s"]))


def _reducer(spec: dict[str, Any]) -> TimedReducer:
    from reducer_client import ReducerClient

    return TimedReducer(ReducerClient(
        addresses=spec["addresses"], job=spec["job"], rank=spec["rank"],
        world_size=spec["world_size"], wire_dtype=spec["wire_dtype"],
        timeout=spec["stall_timeout_s"], link_gbit=spec.get("link_gbit")))


def _reducer_group(spec: dict[str, Any]) -> TimedReducer:
    """The "reducer" process group over a timed client (the process-wide one,
    which the backend takes as it is: same rank and world size)."""
    import reducer_client.torch as rt

    reducer = _reducer(spec)
    rt.init(reducer)
    dist.init_process_group(
        "reducer", init_method=f"tcp://{spec['master']}", rank=spec["rank"],
        world_size=spec["world_size"],
        timeout=datetime.timedelta(seconds=spec["stall_timeout_s"]))
    return reducer


class DDPTrainer(Trainer):
    def __init__(self, model: ModeledModel, spec: dict[str, Any]) -> None:
        super().__init__(model, spec)
        from torch.nn.parallel import DistributedDataParallel

        if spec["system"] == "reducerd-backend":
            self.reducer = _reducer_group(spec)
        else:
            _gloo_group(spec)
        # A bucket cap given explicitly also caps DDP's first bucket (torch 2.13).
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=spec["bucket_bytes"] / 2**20,
                                           device_ids=[0] if self.device == "cuda" else None)
        system = spec["system"]
        if system == "reducerd-ddp":
            import reducer_client.torch as rt

            self.reducer = _reducer(spec)
            self.ddp.register_comm_hook(state=self.reducer, hook=rt.allreduce_hook)
        elif system == "gloo-ddp-float16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
        self.opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])

    def forward(self) -> torch.Tensor:
        return self.ddp(self.token)

    def close(self) -> None:
        # Kept until the process ends without destructors (worker.py): freeing
        # DDP's Reducer destroys its ProcessGroupGloo, which joins its worker
        # thread while this thread holds the GIL, and that thread may still
        # need the GIL to free its last work's Python state: a deadlock (seen
        # in 2 of 3 runs of the tiny bench, torch 2.13, between two systems).
        _RETIRED.append(self.ddp)
        super().close()
        if self.spec["system"] == "reducerd-backend":
            import reducer_client.torch as rt

            rt.shutdown()  # the process-wide client is this system's


class OptimizerTrainer(Trainer):
    def __init__(self, model: ModeledModel, spec: dict[str, Any]) -> None:
        super().__init__(model, spec)
        import reducer_client.torch as rt

        self.reducer = _reducer(spec)
        rt.broadcast_parameters(model.state_dict(), root_rank=0, reducer=self.reducer)
        system = spec["system"]
        extra: dict[str, Any] = {"prioritize": system.endswith("-priority")}
        if "-xbar" in system:
            extra["overlap_forward"] = model
        self.opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=spec["lr"]),
            named_parameters=model.named_parameters(), bucket_bytes=spec["bucket_bytes"],
            reducer=self.reducer, **extra)

    def settle(self) -> None:
        finish = getattr(self.opt, "finish_step", None)
        if finish is not None:
            finish()


def make_trainer(model: ModeledModel, spec: dict[str, Any]) -> Trainer:
    system = spec["system"]
    if system in ("reducerd-ddp", "reducerd-backend", "gloo-ddp-float32", "gloo-ddp-float16"):
        return DDPTrainer(model, spec)
    if system.startswith("reducerd-optimizer"):
        return OptimizerTrainer(model, spec)
    raise ValueError(f"unknown training system {system!r}")
