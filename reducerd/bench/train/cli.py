"""Command line of `reducerd bench --train MODEL`: parse, validate, run, report."""

from __future__ import annotations

import argparse

from reducerd.bench import arguments as shared
from reducerd.bench.arguments import UsageError
from reducerd.bench.config import WIRE_DTYPE_NAMES
from reducerd.bench.host import command_line
from reducerd.bench.train.config import DEFAULT_SYSTEMS, TRAIN_SYSTEMS, Accelerator, TrainConfig
from reducerd.bench.train.specs import MODELS, model_spec
from reducerd.bench.units import parse_rate

__all__ = ["main", "build_parser", "config_from_argv", "UsageError"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reducerd bench",
        description="Whole data-parallel training steps of a model whose parameters are "
                    "real and whose accelerator compute is modeled as time per layer, "
                    "through reducerd's DDP comm hook and DistributedOptimizer and DDP over "
                    "Gloo (float32, float16), for each worker count; step time, samples/s, "
                    "scaling efficiency and the communication hidden behind compute.")
    parser.add_argument("--train", required=True, choices=sorted(MODELS), metavar="MODEL",
                        help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--workers", default="1,2,4,8", metavar="LIST",
                        help="worker counts, one worker per node (default 1,2,4,8; include 1 "
                             "for scaling efficiency)")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), metavar="LIST",
                        help=f"from {', '.join(TRAIN_SYSTEMS)} (default all)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first, the first one checked (default 3)")
    parser.add_argument("--comm-steps", type=int, default=5,
                        help="steps with compute off, timing communication alone (default 5)")
    parser.add_argument("--batch", type=int, help="samples per worker and step (default: "
                                                  "the model's, 64)")
    parser.add_argument("--accelerator-tflops", type=float, default=125.0,
                        help="the modeled accelerator's peak in TFLOP/s (default 125: a V100's "
                             "fp16 tensor cores)")
    parser.add_argument("--utilisation", type=float,
                        help="fraction of the peak a step reaches (default: the model's; "
                             "resnet50 0.25, bert-large 0.40)")
    parser.add_argument("--real-link", default="100gbit", metavar="RATE",
                        help="each worker's link in the real setting (default 100gbit; "
                             "25gbit: the common cloud one), whose ratio of compute to "
                             "communication --time-scale keeps")
    parser.add_argument("--byte-scale", type=float, default=100.0, metavar="S",
                        help="every gradient tensor S times smaller (default 100)")
    parser.add_argument("--time-scale", type=float, metavar="T",
                        help="every modeled compute time T times longer (default: with "
                             "--emulate-cluster, real link / RATE / S, which keeps compute "
                             "and communication in the real setting's ratio; else 1)")
    parser.add_argument("--wire-dtype", default="float16", choices=sorted(WIRE_DTYPE_NAMES),
                        help="reducerd's wire dtype (default float16); the 8-bit ones "
                             "with the shims' error feedback (on by default for them)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: parameters and gradients on the GPU, each layer's FLOPs "
                             "computed there for real (bfloat16 matrix products; the workers "
                             "share the first GPU) instead of modeled as time (default cpu)")
    shared.add_emulation_arguments(parser)
    shared.add_output_arguments(parser, "scaling efficiency against workers (needs matplotlib)")
    shared.add_run_arguments(parser, "fail a run when no step finishes for this long (default 300)")
    return parser


def _workers(text: str) -> tuple[int, ...]:
    try:
        counts = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        raise UsageError(f"--workers {text!r}: comma-separated integers, e.g. 1,2,4,8") from None
    if not counts or counts[0] < 1:
        raise UsageError(f"--workers {text!r}: every count must be >= 1")
    return tuple(counts)


def _systems(text: str) -> tuple[str, ...]:
    words = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [w for w in words if w not in TRAIN_SYSTEMS]
    if unknown or not words:
        raise UsageError(f"--systems {text!r}: choose from {', '.join(TRAIN_SYSTEMS)}")
    return tuple(s for s in TRAIN_SYSTEMS if s in words)


def config_from_argv(argv: list[str]) -> TrainConfig:
    """Parse and validate; raise UsageError naming the argument."""
    args = build_parser().parse_args(argv)
    workers, systems = _workers(args.workers), _systems(args.systems)
    rate, delay = shared.emulation(args, workers[-1], "workers")
    try:
        real_link = parse_rate(args.real_link)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.steps < 1 or args.warmup < 1 or args.comm_steps < 1:
        raise UsageError("--steps, --warmup and --comm-steps must be >= 1")
    if args.batch is not None and args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    if args.accelerator_tflops <= 0:
        raise UsageError("--accelerator-tflops must be > 0")
    utilisation = (args.utilisation if args.utilisation is not None
                   else model_spec(args.train).default_utilisation)
    if not 0 < utilisation <= 1:
        raise UsageError(f"--utilisation must be in (0, 1], got {utilisation}")
    if args.byte_scale < 1:
        raise UsageError(f"--byte-scale must be >= 1, got {args.byte_scale}")
    if args.time_scale is not None and args.time_scale <= 0:
        raise UsageError(f"--time-scale must be > 0, got {args.time_scale}")
    shared.check_run_arguments(args)
    if args.device == "cuda":
        if args.time_scale is not None:
            raise UsageError("--time-scale: with --device cuda the compute is real and cannot "
                             "be scaled; choose --byte-scale and the link rate instead")
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device on this machine")
        time_scale = 1.0
    elif args.time_scale is not None:
        time_scale = args.time_scale
    elif rate:
        time_scale = real_link / rate / args.byte_scale
    else:
        time_scale = 1.0
    return TrainConfig(
        model=args.train, workers=workers, systems=systems, steps=args.steps,
        warmup=args.warmup, comm_steps=args.comm_steps, batch=args.batch,
        accelerator=Accelerator("V100" if args.accelerator_tflops == 125.0 else "custom",
                                args.accelerator_tflops * 1e12, utilisation),
        byte_scale=args.byte_scale, time_scale=time_scale, real_link_bytes_per_s=real_link,
        emulate_cluster=args.emulate_cluster, rate_bytes_per_s=rate, emulate_delay_s=delay,
        emulate_mtu=args.emulate_mtu, wire_dtype=args.wire_dtype, lr=args.lr,
        json_path=args.json, plot_path=args.plot, stall_timeout_s=args.stall_timeout,
        log_dir=args.log_dir, device=args.device,
        command=command_line("reducerd bench", argv))


def main(argv: list[str]) -> int:
    """`reducerd bench --train ...`: 0 when every run finished, 1 on a failure, 2 on usage."""
    return shared.run_command("reducerd bench --train", argv, config_from_argv, _run)


def _run(config: TrainConfig) -> int:
    from reducerd.bench.train.runner import run_train  # the run's imports only for a run

    return run_train(config)
