"""Command line of `reducerd plan`: parse, plan, print, and write the JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from reducer_wire.dtypes import WIRE_DTYPES, wire_block, wire_nbytes

from reducerd.plan.capacity import (
    ClusterSpec,
    chunk_of,
    chunk_work,
    cores_to_fill_link,
    daemons_for,
    efficiency,
    link_efficiency,
    plan_reducerd,
    plan_ring,
)
from reducerd.plan.models import resolve_model
from reducerd.plan.presets import PRESETS
from reducerd.plan.report import render
from reducerd.plan.units import parse_rate, parse_time

__all__ = ["main", "build_parser", "plan_from_argv", "UsageError", "DEFAULT_DAEMON_RATE_GBPS"]

# Measured on the project's 2-core machine, loopback, one daemon process (one
# core): 1.20-1.28 GB of float16 input per daemon CPU-second (issue 19).
DEFAULT_DAEMON_RATE_GBPS = 1.2


class UsageError(ValueError):
    """An argument is wrong; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reducerd plan",
        description="Project a data-parallel cluster's gradient traffic per step, for "
                    "reducerd and for a ring allreduce: bytes per link, the daemons that "
                    "keep the workers' links full, communication time per step. The model "
                    "is in docs/explanation/performance.md.")
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS),
        help="a named setting (flags given beside it win): "
             + "; ".join(f"{name}: {p.description}" for name, p in PRESETS.items()))
    add("--model", metavar="SIZE_OR_NAME",
        help="a model name (resnet50, bert-large, ...), a parameter count ('340M params') "
             "or the float32 gradient's size (1.3G: K, M, G powers of 1024; 1.3GB: of 1000)")
    add("--workers", type=int, metavar="N", help="worker nodes (machines)")
    add("--gpus-per-node", type=int, metavar="G",
        help="GPU processes per worker node; reducerd sums them inside the node first")
    add("--link", metavar="RATE", help="each worker node's link, each way (100gbit, 25Gbit/s)")
    add("--daemon-link", metavar="RATE", help="each daemon's link (default: --link)")
    add("--daemons", type=int, metavar="D",
        help="reducer daemons, each with its own link (default: as many as keep the "
             "workers' links full)")
    add("--wire-dtype", choices=sorted(WIRE_DTYPES), help="gradient dtype on the wire, "
        "for reducerd and the ring alike (default float16)")
    add("--daemon-rate", type=float, metavar="GBPS",
        help="what one daemon core sums: GB (1e9 bytes) of wire input per CPU-second, as "
             "`reducerd bench` prints it (default "
             f"{DEFAULT_DAEMON_RATE_GBPS}, float16 on the project's loopback runs)")
    add("--daemon-cores", metavar="C",
        help="summing cores per daemon link: reducerd --threads, or daemon processes "
             "per reducer node (default 1); 'fill': as many as keep the link full")
    add("--chunk-bytes", type=int, metavar="BYTES",
        help="chunk size on the wire (default: the client's for --link, "
             "reducer_wire.layout.pipelined_chunk_bytes)")
    add("--latency", metavar="TIME", help="one-way latency per message hop (e.g. 20us; "
        "default 0: bandwidth only)")
    add("--mtu", type=int, metavar="BYTES", help="link MTU, for the header overhead "
        "(default 9000)")
    add("--compute-time", type=float, metavar="SECONDS",
        help="compute per step without communication: projects scaling efficiency")
    add("--overlap", type=float, metavar="FRACTION",
        help="share of the compute that communication runs beside (default 0; about "
             "0.67 when buckets are reduced during backward)")
    add("--steps", type=int, metavar="K", help="steps to train: projects the total time")
    add("--json", type=Path, metavar="FILE", help="write every figure here")
    return parser


_DEFAULTS: dict[str, Any] = {"gpus_per_node": 1, "wire_dtype": "float16",
                             "daemon_rate": DEFAULT_DAEMON_RATE_GBPS, "daemon_cores": 1,
                             "latency": "0", "mtu": 9000, "overlap": 0.0}


def _settings(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset] if args.preset else None
    for name, value in {**_DEFAULTS, **(preset.flags if preset else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    missing = [flag for flag in ("--model", "--workers", "--link")
               if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        raise UsageError(f"{', '.join(missing)} required (or a --preset)")
    return args


def _parsed(flag: str, parse: Any, text: str) -> Any:
    try:
        return parse(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def plan_from_argv(argv: list[str]) -> dict[str, Any]:
    """Every figure of the plan, as `--json` writes it; UsageError names a bad flag."""
    return _plan(_settings(argv))


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    model = _parsed("--model", resolve_model, args.model)
    link = _parsed("--link", parse_rate, args.link)
    daemon_link = _parsed("--daemon-link", parse_rate, args.daemon_link) \
        if args.daemon_link else link
    if not args.daemon_rate > 0:
        raise UsageError(f"--daemon-rate must be a positive GB per CPU-second, "
                         f"got {args.daemon_rate}")
    for flag, value in (("--compute-time", args.compute_time), ("--steps", args.steps)):
        if value is not None and not 0 < value < math.inf:
            raise UsageError(f"{flag} must be > 0 and finite, got {value}")
    if not 0 <= args.overlap <= 1:
        raise UsageError(f"--overlap must be in [0, 1], got {args.overlap}")
    dtype = WIRE_DTYPES[args.wire_dtype]
    spec = ClusterSpec(
        params=model.params, wire_bytes_per_param=wire_nbytes(dtype, model.params) / model.params,
        wire_block=wire_block(dtype), wire_block_bytes=wire_nbytes(dtype, wire_block(dtype)),
        nodes=args.workers, gpus_per_node=args.gpus_per_node, link_Bps=link,
        daemon_link_Bps=daemon_link, daemon_rate_Bps_per_core=args.daemon_rate * 1e9,
        daemons=args.daemons, chunk_bytes=args.chunk_bytes,
        latency_s=_parsed("--latency", parse_time, args.latency), mtu=args.mtu)
    spec = replace(spec, daemon_cores=_cores(args.daemon_cores, spec))
    try:
        ours, ring = plan_reducerd(spec), plan_ring(spec)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OverflowError:  # a rate so small (say --daemon-rate 1e-320) that D is infinite
        raise UsageError("the inputs give an infinite number of daemons or time: check "
                         "--link, --daemon-link and --daemon-rate") from None
    plan: dict[str, Any] = {
        "inputs": {"model": model.name, "params": model.params, "wire_dtype": args.wire_dtype,
                   "model_bytes": spec.model_bytes, "float32_gradient_bytes": 4 * model.params,
                   "workers": spec.nodes, "gpus_per_node": spec.gpus_per_node,
                   "ranks": spec.ranks, "link_Bps": link, "daemon_link_Bps": daemon_link,
                   "daemons": args.daemons, "daemon_rate_GBps_per_core": args.daemon_rate,
                   "daemon_cores": spec.daemon_cores, "chunk_bytes": args.chunk_bytes,
                   "latency_s": spec.latency_s, "mtu": spec.mtu,
                   "link_efficiency": link_efficiency(spec.mtu)},
        "reducerd": ours.as_dict(), "ring": ring.as_dict(),
        "reducerd_time_over_ring": ours.time_s / ring.time_s if ring.time_s else None,
    }
    if args.compute_time:
        plan["training"] = _training(args.compute_time, args.overlap, args.steps,
                                     ours.time_s, ring.time_s)
    if args.preset:
        plan["preset"] = {"name": args.preset, "description": PRESETS[args.preset].description,
                          "reported": PRESETS[args.preset].reported}
    return plan


def _cores(text: Any, spec: ClusterSpec) -> int:
    """--daemon-cores; 'fill': what keeps a daemon link full at the chunks of
    the daemons the links alone need (--daemons, else N Rw / Rd)."""
    if str(text).strip().lower() == "fill":
        if spec.mtu < 576 or not spec.daemon_rate_Bps_per_core > 0:
            return 1  # check() names the bad input
        daemons = spec.daemons or daemons_for(spec, spec.daemon_link_Bps)
        work = chunk_work(chunk_of(spec, daemons))
        return cores_to_fill_link(spec.daemon_link_Bps, spec.daemon_rate_Bps_per_core,
                                  spec.mtu, work)
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--daemon-cores: expected a whole number or 'fill', got {text!r}") \
            from None


def _training(compute_s: float, overlap: float, steps: int | None, ours_s: float,
              ring_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"compute_time_s": compute_s, "overlap": overlap, "steps": steps}
    for name, comm_s in (("reducerd", ours_s), ("ring", ring_s)):
        eff = efficiency(compute_s, comm_s, overlap)
        step_s = compute_s / eff
        out[name] = {"step_time_s": step_s, "scaling_efficiency": eff,
                     "minutes_to_train": steps * step_s / 60 if steps else None}
    return out


def main(argv: list[str]) -> int:
    """`reducerd plan ...`: 0 with the plan printed, 2 on a bad argument."""
    try:
        args = _settings(argv)
        plan = _plan(args)
    except UsageError as exc:
        print(f"reducerd plan: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(plan))
    if args.json:
        try:
            args.json.write_text(json.dumps(plan, indent=2) + "\n")
        except OSError as exc:
            print(f"reducerd plan: error: --json {args.json}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    return 0
