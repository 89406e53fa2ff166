"""Command line of `reducerd bench --train MODEL`: parse, validate, run, report."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from reducerd.bench.train.config import DEFAULT_SYSTEMS, TRAIN_SYSTEMS, Accelerator, TrainConfig
from reducerd.bench.train.specs import MODELS, model_spec
from reducerd.bench.units import parse_rate, parse_time

__all__ = ["main", "build_parser", "config_from_argv", "UsageError"]

MAX_HOSTS = 250  # one /24 per role inside 198.18.0.0/15 (netns.py)


class UsageError(ValueError):
    """An argument is wrong; the message names it."""


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
                        help="each worker's link in the real setting (default 100gbit)")
    parser.add_argument("--byte-scale", type=float, default=100.0, metavar="S",
                        help="every gradient tensor S times smaller (default 100)")
    parser.add_argument("--time-scale", type=float, metavar="T",
                        help="every modeled compute time T times longer (default: with "
                             "--emulate-cluster, real link / RATE / S, which keeps compute "
                             "and communication in the real setting's ratio; else 1)")
    parser.add_argument("--wire-dtype", default="float16", choices=("float16", "bfloat16",
                                                                    "float32"),
                        help="reducerd's wire dtype (default float16)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument("--emulate-cluster", metavar="RATE",
                        help="every host in its own network namespace, links shaped to RATE "
                             "(tc syntax, e.g. 200mbit); needs root")
    parser.add_argument("--emulate-delay", metavar="TIME",
                        help="with --emulate-cluster: netem delay on every link, each way")
    parser.add_argument("--emulate-mtu", type=int, default=9000, metavar="BYTES")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure here")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="scaling efficiency against workers (needs matplotlib)")
    parser.add_argument("--stall-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="fail a run when no step finishes for this long (default 300)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="keep every process's log here")
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
    try:
        rate = parse_rate(args.emulate_cluster) if args.emulate_cluster else None
        real_link = parse_rate(args.real_link)
        delay = parse_time(args.emulate_delay) if args.emulate_delay else 0.0
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
    if args.emulate_delay and not args.emulate_cluster:
        raise UsageError("--emulate-delay needs --emulate-cluster")
    if args.emulate_cluster and workers[-1] > MAX_HOSTS:
        raise UsageError(f"--emulate-cluster supports at most {MAX_HOSTS} workers")
    if args.stall_timeout <= 0:
        raise UsageError("--stall-timeout must be > 0")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install matplotlib")
    if args.time_scale is not None:
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
        log_dir=args.log_dir)


def main(argv: list[str]) -> int:
    """`reducerd bench --train ...`: 0 when every run finished, 1 on a failure, 2 on usage."""
    try:
        config = config_from_argv(argv)
    except UsageError as exc:
        print(f"reducerd bench --train: error: {exc}", file=sys.stderr)
        return 2
    from reducerd.bench.train.runner import TrainBenchError, run_train

    try:
        return run_train(config)
    except TrainBenchError as exc:
        print(f"reducerd bench --train: {exc}", file=sys.stderr)
        return 1
