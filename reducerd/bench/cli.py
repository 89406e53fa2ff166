"""Command line of `reducerd bench`: parse, validate, run, report."""

from __future__ import annotations

import argparse
from pathlib import Path

from reducerd.bench import arguments as shared
from reducerd.bench.arguments import UsageError
from reducerd.bench.config import (
    BASELINE_CHOICES,
    REDUCERD_WIRE_BASELINES,
    TCP_FLOOR_SYSTEMS,
    WIRE_DTYPE_NAMES,
    BenchConfig,
    systems_for,
)
from reducerd.bench.host import command_line
from reducerd.bench.units import parse_sizes

__all__ = ["main", "build_parser", "config_from_argv", "UsageError"]

DEFAULT_SIZES = "1K:256M:4"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reducerd bench",
        description="Allreduce float32 gradients over a sweep of sizes with reducerd "
                    "(D daemons, N worker processes) and, in the same run, with Gloo's "
                    "ring and MXNet's ps-lite parameter server; print time, algorithm "
                    "and bus bandwidth (nccl-tests' definitions) and the ratios. "
                    "`reducerd bench --train MODEL --help`: whole training steps instead.")
    parser.add_argument("--workers", type=int, required=True, metavar="N",
                        help="worker processes (ranks) for every system")
    parser.add_argument("--daemons", type=int, required=True, metavar="D",
                        help="reducerd daemons; also the MXNet servers (S = D)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, metavar="LIST",
                        help="float32 gradient sizes: 1K,1M,64M or MIN:MAX[:FACTOR] "
                             f"(K, M, G are powers of 1024; default {DEFAULT_SIZES})")
    parser.add_argument("--wire-dtype", default="float16", choices=sorted(WIRE_DTYPE_NAMES),
                        help="reducerd's wire dtype; MXNet pushes float16 when this is "
                             "float16, else float32 (default float16)")
    parser.add_argument("--iters", type=int, default=10, metavar="K",
                        help="timed iterations per size (default 10)")
    parser.add_argument("--warmup", type=int, default=3, metavar="K",
                        help="untimed iterations per size first (default 3)")
    gloo_mxnet = ", ".join(w for w in BASELINE_CHOICES
                           if w not in REDUCERD_WIRE_BASELINES + TCP_FLOOR_SYSTEMS[1:])
    parser.add_argument("--baselines", default="gloo,mxnet", metavar="LIST",
                        help=f"comma-separated, from {gloo_mxnet}, or reducerd-DTYPE "
                             f"(DTYPE one of {', '.join(WIRE_DTYPE_NAMES)}: reducerd's "
                             "core path over that wire dtype on fresh daemons, e.g. "
                             "--wire-dtype int8 --baselines reducerd-float16; not "
                             "--wire-dtype itself), or tcp-floor[-DTYPE] (reducerd's "
                             "chunks over plain TCP with no work: what the network alone "
                             "costs) (default gloo,mxnet; gloo means float32 and float16)")
    parser.add_argument("--no-ddp-hook", dest="ddp_hook", action="store_false",
                        help="do not time the PyTorch shim's path (a DDP bucket through "
                             "reducer_client.torch.allreduce_hook, system "
                             "reducerd-ddp-hook) beside the core's")
    shared.add_emulation_arguments(parser)
    parser.add_argument("--workers-per-node", type=int, default=1, metavar="L",
                        help="workers per node: with --emulate-cluster they share one "
                             "namespace and link (default 1)")
    shared.add_output_arguments(parser, "bandwidth against size, log-log (needs matplotlib)")
    parser.add_argument("--mxnet-python", type=Path, metavar="PATH",
                        help="interpreter with mxnet (default: .venv-mxnet/bin/python "
                             "at the repository root)")
    parser.add_argument("--chunk-bytes", type=int, metavar="BYTES",
                        help="reducerd client chunk size (default: the client's)")
    shared.add_run_arguments(parser, "fail a system when no iteration finishes for this "
                                     "long (default 300)")
    return parser


def config_from_argv(argv: list[str]) -> BenchConfig:
    """Parse and validate; raise UsageError naming the argument (argparse exits on --help)."""
    args = build_parser().parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
        baselines = systems_for([w.strip() for w in args.baselines.split(",") if w.strip()])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    itself = f"reducerd-{args.wire_dtype}"
    if itself in baselines:
        raise UsageError(f"--baselines {itself} is reducerd itself with --wire-dtype "
                         f"{args.wire_dtype}: compare another wire dtype (e.g. "
                         f"--wire-dtype int8 --baselines reducerd-float16)")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.daemons < 1:
        raise UsageError(f"--daemons must be >= 1, got {args.daemons}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if args.workers_per_node < 1 or args.workers % args.workers_per_node:
        raise UsageError(f"--workers-per-node {args.workers_per_node} must divide "
                         f"--workers {args.workers}")
    rate, delay = shared.emulation(args, max(args.workers, args.daemons), "workers and daemons")
    if args.chunk_bytes is not None and args.chunk_bytes < 4:
        raise UsageError("--chunk-bytes must be at least 4")
    shared.check_run_arguments(args)
    return BenchConfig(
        workers=args.workers, daemons=args.daemons, sizes_bytes=tuple(sizes),
        wire_dtype=args.wire_dtype, iters=args.iters, warmup=args.warmup,
        baselines=baselines, emulate_cluster=args.emulate_cluster, rate_bytes_per_s=rate,
        emulate_delay_s=delay, emulate_mtu=args.emulate_mtu,
        workers_per_node=args.workers_per_node,
        json_path=args.json, plot_path=args.plot, mxnet_python=args.mxnet_python,
        stall_timeout_s=args.stall_timeout, chunk_bytes=args.chunk_bytes,
        log_dir=args.log_dir, ddp_hook=args.ddp_hook,
        command=command_line("reducerd bench", argv))


def main(argv: list[str]) -> int:
    """`reducerd bench ...`: 0 when every system ran, 1 when one failed, 2 on usage errors."""
    if any(arg == "--train" or arg.startswith("--train=") for arg in argv):
        from reducerd.bench.train.cli import main as train_main  # whole training steps

        return train_main(argv)
    return shared.run_command("reducerd bench", argv, config_from_argv, _run)


def _run(config: BenchConfig) -> int:
    from reducerd.bench.runner import run_bench  # the run's imports only for a run

    return run_bench(config)
