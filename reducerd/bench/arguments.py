"""The command-line parts `reducerd bench` and `reducerd bench --train` share.

The emulated cluster's flags, the outputs (--json, --plot), the run's limits
and logs (--stall-timeout, --log-dir), their checks, and main()'s exit
statuses: 0 ran, 1 failed (or could not run: session.BenchError), 2 usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from reducerd.bench.units import parse_rate, parse_time

__all__ = ["UsageError", "MAX_HOSTS", "add_emulation_arguments", "add_output_arguments",
           "add_run_arguments", "emulation", "check_run_arguments", "run_command"]

MAX_HOSTS = 250  # one /24 per role inside 198.18.0.0/15 (netns.py)

ConfigT = TypeVar("ConfigT")


class UsageError(ValueError):
    """An argument is wrong; the message names it."""


def add_emulation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--emulate-cluster", metavar="RATE",
                        help="every host in its own network namespace, each link shaped "
                             "to RATE both ways (tc syntax, e.g. 200mbit); needs root")
    parser.add_argument("--emulate-delay", metavar="TIME",
                        help="with --emulate-cluster: netem delay added on every link, "
                             "each way (e.g. 100us); needs the sch_netem kernel module")
    parser.add_argument("--emulate-mtu", type=int, default=9000, metavar="BYTES",
                        help="with --emulate-cluster: link MTU (default 9000, jumbo frames "
                             "as in AWS VPCs; 1500 costs more CPU per byte)")


def add_output_arguments(parser: argparse.ArgumentParser, plot_help: str) -> None:
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure here")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help=plot_help)


def add_run_arguments(parser: argparse.ArgumentParser, stall_help: str) -> None:
    parser.add_argument("--stall-timeout", type=float, default=300.0, metavar="SECONDS",
                        help=stall_help)
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="keep every process's log here (default: a temporary "
                             "directory, removed after a successful run)")


def emulation(args: argparse.Namespace, hosts: int, hosts_named: str) -> tuple[float | None,
                                                                               float]:
    """(link rate in bytes/s or None, netem delay in s) of the emulation flags, checked.

    hosts: the most hosts of one role the run needs; hosts_named says which
    flags set them ("workers and daemons") in the error.
    """
    try:
        rate = parse_rate(args.emulate_cluster) if args.emulate_cluster else None
        delay_s = parse_time(args.emulate_delay) if args.emulate_delay else 0.0
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.emulate_delay and not args.emulate_cluster:
        raise UsageError("--emulate-delay needs --emulate-cluster")
    if not 576 <= args.emulate_mtu <= 65000:
        raise UsageError(f"--emulate-mtu must be in [576, 65000], got {args.emulate_mtu}")
    if args.emulate_cluster and hosts > MAX_HOSTS:
        raise UsageError(f"--emulate-cluster supports at most {MAX_HOSTS} {hosts_named}")
    return rate, delay_s


def check_run_arguments(args: argparse.Namespace) -> None:
    """--stall-timeout positive; --plot only with matplotlib installed."""
    if args.stall_timeout <= 0:
        raise UsageError("--stall-timeout must be > 0")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install matplotlib "
                         "(or the project's 'bench' extra)")


def run_command(prog: str, argv: list[str], parse: Callable[[list[str]], ConfigT],
                run: Callable[[ConfigT], int]) -> int:
    """parse(argv) then run(config): a UsageError or BenchError printed after `prog`."""
    try:
        config = parse(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from reducerd.bench.session import BenchError  # the run's imports only for a run

    try:
        return run(config)
    except BenchError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
