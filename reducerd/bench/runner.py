"""Run the whole benchmark: cluster, each system in turn, progress, report, cleanup.

The run's log folder, processes, cluster and their unconditional cleanup
(Ctrl-C, SIGTERM and SIGHUP included) are a session.BenchSession's.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from reducerd.bench.config import (
    REDUCERD_WIRE_BASELINES,
    TCP_FLOOR_SYSTEMS,
    BenchConfig,
    wire_nbytes,
)
from reducerd.bench.figures import aggregate
from reducerd.bench.launch import Placement, default_mxnet_python, launch, make_placement
from reducerd.bench.procs import Proc, ProcessSet, SystemFailed, cpu_seconds, follow_workers
from reducerd.bench.report import config_record, render_table, write_json, write_plot
from reducerd.bench.session import BenchError, BenchSession, progress_bar, results_console
from reducerd.bench.units import format_size

__all__ = ["run_bench", "BenchError"]


def _available(config: BenchConfig, mxnet_python: Path,
               skipped: dict[str, str]) -> list[str]:
    systems = []
    for system in config.systems:
        if ((system.startswith("gloo-") or system == "reducerd-ddp-hook")
                and importlib.util.find_spec("torch") is None):
            skipped[system] = "torch is not installed in this environment"
        elif system == "mxnet-ps" and not mxnet_python.exists():
            skipped[system] = (f"no MXNet environment at {mxnet_python} (`make test` creates "
                               ".venv-mxnet; or pass --mxnet-python)")
        else:
            systems.append(system)
    return systems


# Systems whose helper processes take every worker's wire bytes (reducerd's
# daemons, the tcp-floor's echo servers): their input per CPU-second is
# reported. The floor's is what plain TCP costs a process on this machine.
_SERVER_CPU_SYSTEMS = frozenset({"reducerd", *REDUCERD_WIRE_BASELINES, *TCP_FLOOR_SYSTEMS})
CPU_TICKS_TO_MEASURE = 5  # the least CPU time, in /proc clock ticks, a rate is given for


def _daemon_efficiency(config: BenchConfig, system: str, daemons: list[Proc],
                       cpu_after_first_step: float) -> dict[str, float | None]:
    """What the daemons (or echo servers) received per CPU-second they used,
    from the end of the sweep's first step (start-up, imports and connecting
    left out) to its end."""
    steps = config.warmup + config.iters
    wire = config.wire_dtype_of(system)
    input_bytes = sum(wire_nbytes(wire, size // 4) * config.workers * steps
                      for size in config.sizes_bytes)
    input_bytes -= wire_nbytes(wire, config.sizes_bytes[0] // 4) * config.workers
    cpu_s = sum(cpu_seconds(d.process.pid) for d in daemons) - cpu_after_first_step
    # /proc counts CPU time in clock ticks: under a few of them the rate is noise.
    measurable = cpu_s >= CPU_TICKS_TO_MEASURE / os.sysconf("SC_CLK_TCK")
    return {"input_bytes": input_bytes, "cpu_s": round(cpu_s, 3),
            "input_GB_per_cpu_s": round(input_bytes / 1e9 / cpu_s, 3) if measurable else None}


def _run_system(system: str, config: BenchConfig, placement: Placement, procs: ProcessSet,
                progress: Progress, task: Any, mxnet_python: Path,
                stats: dict[str, Any] | None = None) -> dict[int, list[dict[str, Any]]]:
    """One system's sweep; returns each rank's per-size records."""
    per_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    steps = config.warmup + config.iters
    progress.update(task, description=f"{system}: starting")

    daemon_cpu_s: list[float] = []  # the daemons' CPU time after the first step

    def on_event(proc: Proc, event: dict[str, Any]) -> None:
        if event["event"] == "size":
            per_rank[proc.rank].append(event)  # type: ignore[index]
        elif event["event"] == "iter" and proc.rank == 0:
            if system in _SERVER_CPU_SYSTEMS and not daemon_cpu_s:
                try:
                    daemon_cpu_s.append(sum(cpu_seconds(d.process.pid) for d in helpers))
                except (OSError, ValueError, IndexError):
                    daemon_cpu_s.append(float("nan"))
            progress.update(task, advance=1, description=f"{system} "
                            f"{format_size(event['size_bytes'])} "
                            f"{event['iteration'] + 1}/{steps}")

    run_id = f"{os.getpid()}-{time.monotonic_ns()}"
    workers, helpers = launch(system, config, placement, procs, run_id, mxnet_python)
    follow_workers(workers, helpers, config.stall_timeout_s, on_event)
    if system in _SERVER_CPU_SYSTEMS and stats is not None and daemon_cpu_s:
        try:
            stats[system] = _daemon_efficiency(config, system, helpers, daemon_cpu_s[0])
        except (OSError, ValueError, IndexError):
            pass  # a daemon already gone: no figure
    return dict(per_rank)


def run_bench(config: BenchConfig) -> int:
    """Run every system over the sweep, then print and write the figures.

    Returns 0 when every system ran (or was skipped with a reason), 1 when
    one failed, 130 when interrupted; partial results are reported anyway.
    """
    console = Console(stderr=True)
    mxnet_python = config.mxnet_python or default_mxnet_python()
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    systems = _available(config, mxnet_python, skipped)
    for system, reason in skipped.items():
        console.print(f"[yellow]{system} skipped:[/] {reason}")
    records: dict[str, dict[int, list[dict[str, Any]]]] = {}
    stats: dict[str, Any] = {}  # system -> its servers' input per CPU-second
    with BenchSession(console, config.log_dir, "reducerd-bench-") as session:
        cluster = None
        if config.emulate_cluster:
            cluster = session.emulate_cluster(
                config.emulate_cluster, config.rate_bytes_per_s or 0, config.nodes,
                config.daemons, config.emulate_delay_s, config.emulate_mtu,
                f"{config.nodes} node(s) and {config.daemons} daemon host(s)")
        placement = make_placement(config, cluster)
        steps = len(config.sizes_bytes) * (config.warmup + config.iters)
        with progress_bar(console, 28) as progress:
            task = progress.add_task("starting", total=len(systems) * steps)
            for index, system in enumerate(systems):
                try:
                    records[system] = _run_system(system, config, placement, session.procs,
                                                  progress, task, mxnet_python, stats)
                except SystemFailed as exc:
                    failed[system] = str(exc).splitlines()[0]
                    console.print(f"[red]{system} failed:[/] {exc}")
                finally:
                    session.procs.stop_all()
                progress.update(task, completed=(index + 1) * steps)
    return _report(session, config, systems, records, skipped, failed, stats)


def _report(session: BenchSession, config: BenchConfig, systems: list[str],
            records: dict[str, dict[int, list[dict[str, Any]]]], skipped: dict[str, str],
            failed: dict[str, str], stats: dict[str, Any]) -> int:
    console = session.console
    results = aggregate(config, records)
    session.keep_records(records)  # raw per-rank, per-iteration records beside the logs
    if results:
        render_table(results_console(), config, results)
    for system, figures in stats.items():
        kind = "daemon" if system.startswith("reducerd") else "echo server"
        rate = figures["input_GB_per_cpu_s"]
        rate_text = "too little CPU time to measure" if rate is None else f"{rate:.2f} GB"
        console.print(f"{system} {kind}s: {rate_text} of "
                      f"{config.wire_dtype_of(system)} input per {kind} CPU-second "
                      f"({figures['input_bytes'] / 1e9:.2f} GB in {figures['cpu_s']:.2f} s)")
    if config.json_path:
        record = config_record(config, systems, skipped, failed)
        if "reducerd" in stats:
            record["reducerd_daemons"] = stats["reducerd"]
        record["server_cpu"] = stats  # by system: reducerd's and the floor's
        write_json(config.json_path, record, results)
        session.wrote(config.json_path)
    if config.plot_path and results:
        write_plot(config.plot_path, config, results)
        session.wrote(config.plot_path)
    return session.finish(bool(failed))
