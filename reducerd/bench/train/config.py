"""The training bench's one typed configuration, and how it scales a real setting down.

The real setting: each worker is one accelerator (default a V100, 125 TFLOPS
fp16 tensor-core peak) behind its own link (default 100 Gbit/s), or equally
a node of several such accelerators behind one link of that rate, since the
node's gradient crosses its link once either way (the fast intra-node
reduction is not modeled). The emulated links run at RATE, `real / RATE`
times slower. To keep compute and communication in the real ratio, every
gradient tensor is `byte_scale` times smaller than the architecture's and
every modeled compute time `time_scale` times longer, with
byte_scale x time_scale = real link / RATE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from reducerd.bench.train.specs import ModelSpec, model_spec

__all__ = ["TRAIN_SYSTEMS", "DEFAULT_SYSTEMS", "Accelerator", "TrainConfig", "layer_flops",
           "layer_times", "scaled_numel", "DDP_BUCKET_BYTES"]

# Every system the training bench knows, in run order.
TRAIN_SYSTEMS = ("reducerd-ddp", "reducerd-backend", "reducerd-optimizer",
                 "reducerd-optimizer-xbar",
                 "reducerd-optimizer-priority", "reducerd-optimizer-xbar-priority",
                 "gloo-ddp-float32", "gloo-ddp-float16")
DEFAULT_SYSTEMS = TRAIN_SYSTEMS
# DDP's default bucket_cap_mb (25 MiB), which the DistributedOptimizer's
# default bucket size matches; both shrink by byte_scale.
DDP_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Accelerator:
    """The modeled accelerator: its peak and the fraction of it a model reaches."""

    name: str = "V100"
    peak_flops: float = 125e12  # fp16 tensor-core peak, FLOP/s
    utilisation: float = 0.40

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.utilisation


def layer_flops(spec: ModelSpec, batch: int) -> list[tuple[float, float]]:
    """(forward FLOPs, backward FLOPs) of every layer, in forward order:
    FLOPs per sample x batch; backward = 2 x forward."""
    return [(layer.forward_flop_per_sample * batch, 2 * layer.forward_flop_per_sample * batch)
            for layer in spec.layers]


def layer_times(spec: ModelSpec, batch: int, accelerator: Accelerator,
                time_scale: float = 1.0) -> list[tuple[float, float]]:
    """(forward_s, backward_s) of every layer, in forward order: layer_flops
    over the accelerator's effective FLOP/s, times time_scale."""
    speed = accelerator.effective_flops
    return [(f / speed * time_scale, b / speed * time_scale) for f, b in layer_flops(spec, batch)]


def scaled_numel(numel: int, byte_scale: float) -> int:
    """A parameter's element count in the scaled-down model (at least one)."""
    return max(1, math.ceil(numel / byte_scale))


@dataclass(frozen=True)
class TrainConfig:
    """What `reducerd bench --train` runs: validated once by its command line."""

    model: str
    workers: tuple[int, ...]
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    steps: int = 20
    warmup: int = 3
    comm_steps: int = 5  # steps without compute, to time communication alone
    batch: int | None = None  # per worker; default the model's
    accelerator: Accelerator = field(default_factory=Accelerator)
    byte_scale: float = 100.0
    time_scale: float = 1.0
    real_link_bytes_per_s: float = 100e9 / 8
    emulate_cluster: str | None = None
    rate_bytes_per_s: float | None = None
    emulate_delay_s: float = 0.0
    emulate_mtu: int = 9000
    wire_dtype: str = "float16"
    lr: float = 0.01
    json_path: Path | None = None
    plot_path: Path | None = None
    stall_timeout_s: float = 300.0
    log_dir: Path | None = None
    device: str = "cpu"  # "cuda": real compute on the machine's first GPU (gpu.py)
    # The command line that asked for this run, recorded in the JSON.
    command: str = "reducerd bench --train"

    @property
    def spec(self) -> ModelSpec:
        return model_spec(self.model)

    @property
    def batch_per_worker(self) -> int:
        return self.batch if self.batch is not None else self.spec.default_batch

    @property
    def max_workers(self) -> int:
        return max(self.workers)

    @property
    def bucket_bytes(self) -> int:
        """DDP's and the DistributedOptimizer's bucket size in the scaled model."""
        return max(4, int(DDP_BUCKET_BYTES / self.byte_scale))

    def times(self) -> list[tuple[float, float]]:
        return layer_times(self.spec, self.batch_per_worker, self.accelerator, self.time_scale)

    def record(self) -> dict:
        """The JSON "config" object's model and scaling part."""
        spec = self.spec
        times = self.times()
        # On a GPU the compute is measured (each step's compute_s), not modeled.
        compute_s = sum(f + b for f, b in times) if self.device == "cpu" else None
        scaled_params = sum(scaled_numel(p.numel, self.byte_scale) for p in spec.params)
        return {
            "model": spec.name, "model_description": spec.description,
            "param_count": spec.param_count, "param_tensors": len(spec.params),
            "layers": len(spec.layers), "scaled_param_count": scaled_params,
            "sample": spec.sample, "batch_per_worker": self.batch_per_worker,
            "forward_flop_per_sample": spec.forward_flop_per_sample,
            "accelerator": ({"name": self.accelerator.name,
                             "peak_flops": self.accelerator.peak_flops,
                             "utilisation": self.accelerator.utilisation}
                            if self.device == "cpu" else {"name": "cuda:0 (real compute)"}),
            "real_link_bytes_per_s": self.real_link_bytes_per_s,
            "byte_scale": self.byte_scale, "time_scale": self.time_scale,
            "modeled_compute_s": compute_s,
            "real_compute_s": compute_s / self.time_scale if compute_s is not None else None,
            "bucket_bytes": self.bucket_bytes, "wire_dtype": self.wire_dtype,
            "workers": list(self.workers), "systems": list(self.systems),
            "steps": self.steps, "warmup": self.warmup, "comm_steps": self.comm_steps,
            "emulate_cluster": self.emulate_cluster,
            "rate_bytes_per_s": self.rate_bytes_per_s, "lr": self.lr,
            "device": self.device,
        }
