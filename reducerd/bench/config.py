"""The benchmark's one typed configuration and the systems it can run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BenchConfig", "SYSTEMS", "REDUCERD_SYSTEMS", "REDUCERD_WIRE_BASELINES",
           "TCP_FLOOR_SYSTEMS", "CHUNKED_SYSTEMS",
           "BASELINE_CHOICES", "WIRE_DTYPE_NAMES", "wire_nbytes", "systems_for"]

# --wire-dtype choices: reducer_wire.dtypes.WIRE_DTYPES's names, written out so
# that `bench --help` imports no NumPy (tests/unit/test_quant.py checks they agree).
WIRE_DTYPE_NAMES = ("float16", "bfloat16", "float32", "int8", "fp8_e4m3", "fp8_e5m2")
# reducerd's core path over a fixed wire dtype, as a baseline beside the
# --wire-dtype one in the same run (e.g. int8 against "reducerd-float16").
REDUCERD_WIRE_BASELINES = tuple(f"reducerd-{name}" for name in WIRE_DTYPE_NAMES)
# reducerd's chunks over plain TCP with no work (reducerd/bench/floor.py): what the
# network alone costs that byte pattern, over --wire-dtype's bytes or a fixed dtype's.
TCP_FLOOR_SYSTEMS = ("tcp-floor", *(f"tcp-floor-{name}" for name in WIRE_DTYPE_NAMES))
# Every system the bench knows, in the order it runs them (and prints them).
SYSTEMS = ("reducerd", "reducerd-ddp-hook", *REDUCERD_WIRE_BASELINES, "gloo-float32",
           "gloo-float16", "mxnet-ps", *TCP_FLOOR_SYSTEMS)
# The systems that run on reducerd daemons: the core's allreduce(out=), a DDP
# bucket through reducer_client.torch.allreduce_hook (the shim's path), and
# the core's over each fixed wire dtype.
REDUCERD_SYSTEMS = ("reducerd", "reducerd-ddp-hook", *REDUCERD_WIRE_BASELINES)
# The systems that send reducerd's chunks in one of its wire dtypes (wire_dtype_of).
CHUNKED_SYSTEMS = REDUCERD_SYSTEMS + TCP_FLOOR_SYSTEMS
# --baselines words -> systems.
BASELINE_CHOICES = {
    "gloo": ("gloo-float32", "gloo-float16"),
    "gloo-float32": ("gloo-float32",),
    "gloo-float16": ("gloo-float16",),
    "mxnet": ("mxnet-ps",),
    "mxnet-ps": ("mxnet-ps",),
    **{system: (system,) for system in REDUCERD_WIRE_BASELINES},
    **{system: (system,) for system in TCP_FLOOR_SYSTEMS},
    "none": (),
}


def wire_nbytes(wire_dtype: str, numel: int) -> int:
    """Wire bytes of `numel` elements of the named wire dtype (int8: scales included)."""
    from reducer_wire import dtypes  # NumPy: not for --help

    return dtypes.wire_nbytes(dtypes.WIRE_DTYPES[wire_dtype], numel)


@dataclass(frozen=True)
class BenchConfig:
    """What `reducerd bench` runs: validated once by the command line."""

    workers: int
    daemons: int
    sizes_bytes: tuple[int, ...]
    wire_dtype: str = "float16"
    iters: int = 10
    warmup: int = 3
    baselines: tuple[str, ...] = ("gloo-float32", "gloo-float16", "mxnet-ps")
    emulate_cluster: str | None = None  # tc rate, e.g. "200mbit"
    rate_bytes_per_s: float | None = None
    emulate_delay_s: float = 0.0
    emulate_mtu: int = 9000
    workers_per_node: int = 1
    json_path: Path | None = None
    plot_path: Path | None = None
    mxnet_python: Path | None = None
    # A run fails when no iteration finishes for this long (not a timing limit).
    stall_timeout_s: float = 300.0
    chunk_bytes: int | None = None
    log_dir: Path | None = None
    # Time the DDP hook's path beside the core's (needs torch).
    ddp_hook: bool = True
    # The command line that asked for this run, recorded in the JSON.
    command: str = "reducerd bench"

    @property
    def systems(self) -> tuple[str, ...]:
        return ("reducerd", *(("reducerd-ddp-hook",) if self.ddp_hook else ()),
                *self.baselines)

    def wire_dtype_of(self, system: str) -> str:
        """The wire dtype a reducerd or tcp-floor system sends: its own for
        "reducerd-float16", "tcp-floor-int8" etc., else --wire-dtype."""
        if system in REDUCERD_WIRE_BASELINES:
            return system.removeprefix("reducerd-")
        if system in TCP_FLOOR_SYSTEMS[1:]:
            return system.removeprefix("tcp-floor-")
        if system in REDUCERD_SYSTEMS or system == "tcp-floor":
            return self.wire_dtype
        raise ValueError(f"{system!r} has no wire dtype of reducerd's")

    @property
    def nodes(self) -> int:
        return self.workers // self.workers_per_node

    @property
    def busbw_factor(self) -> float:
        """nccl-tests' allreduce factor 2(N-1)/N, used for every system alike."""
        return 2 * (self.workers - 1) / self.workers

    @property
    def mxnet_dtype(self) -> str:
        """ps-lite pushes the wire precision we compare at (it has no bfloat16)."""
        return "float16" if self.wire_dtype == "float16" else "float32"


def systems_for(words: list[str]) -> tuple[str, ...]:
    """--baselines words -> baseline systems in run order, without repeats."""
    chosen: set[str] = set()
    for word in words:
        if word not in BASELINE_CHOICES:
            raise ValueError(f"baseline {word!r}: one of {', '.join(BASELINE_CHOICES)}")
        chosen.update(BASELINE_CHOICES[word])
    return tuple(s for s in SYSTEMS if s in chosen)
