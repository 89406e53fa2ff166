"""Run the whole benchmark: cluster, each system in turn, progress, report, cleanup.

Cleanup is unconditional: every child process is stopped and every namespace
removed in a `finally`, which SIGINT (KeyboardInterrupt), SIGTERM and SIGHUP
(turned into KeyboardInterrupt here) all reach; further signals are blocked
while it runs, so a second Ctrl-C cannot interrupt the cleanup itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from reducerd.bench import netns
from reducerd.bench.config import BenchConfig, wire_nbytes
from reducerd.bench.figures import aggregate
from reducerd.bench.launch import Placement, default_mxnet_python, launch, make_placement
from reducerd.bench.procs import Proc, ProcessSet, SystemFailed, cpu_seconds, follow_workers
from reducerd.bench.report import config_record, render_table, write_json, write_plot
from reducerd.bench.units import format_size

__all__ = ["run_bench", "BenchError"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class BenchError(RuntimeError):
    """The bench cannot run at all (e.g. --emulate-cluster without root)."""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


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


def _daemon_efficiency(config: BenchConfig, daemons: list[Proc],
                       cpu_after_first_step: float) -> dict[str, float]:
    """What the daemons received per CPU-second they used, from the end of the
    sweep's first step (start-up, imports and connecting left out) to its end."""
    steps = config.warmup + config.iters
    input_bytes = sum(wire_nbytes(config.wire_dtype, size // 4) * config.workers * steps
                      for size in config.sizes_bytes)
    input_bytes -= wire_nbytes(config.wire_dtype, config.sizes_bytes[0] // 4) * config.workers
    cpu_s = sum(cpu_seconds(d.process.pid) for d in daemons) - cpu_after_first_step
    return {"input_bytes": input_bytes, "cpu_s": round(cpu_s, 3),
            "input_GB_per_cpu_s": round(input_bytes / 1e9 / cpu_s, 3) if cpu_s else 0.0}


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
            if system == "reducerd" and not daemon_cpu_s:
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
    if system == "reducerd" and stats is not None and daemon_cpu_s:
        try:
            stats["reducerd_daemons"] = _daemon_efficiency(config, helpers, daemon_cpu_s[0])
        except (OSError, ValueError, IndexError):
            pass  # a daemon already gone: no figure
    return dict(per_rank)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


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
    log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="reducerd-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = ProcessSet(log_dir)
    cluster: netns.Cluster | None = None
    records: dict[str, dict[int, list[dict[str, Any]]]] = {}
    stats: dict[str, Any] = {}
    interrupted = False
    in_main = threading.current_thread() is threading.main_thread()
    previous = ({sig: signal.signal(sig, _interrupt) for sig in _STOP_SIGNALS[1:]}
                if in_main else {})
    try:
        if config.emulate_cluster:
            try:
                netns.check_available()
                for name in netns.cleanup_leftovers():
                    console.print(f"removed leftover namespace {name}")
                cluster = netns.Cluster(config.emulate_cluster, config.rate_bytes_per_s or 0,
                                        config.nodes, config.daemons, config.emulate_delay_s,
                                        config.emulate_mtu)
                console.print(f"emulated cluster: {config.nodes} node(s) and "
                              f"{config.daemons} daemon host(s), links "
                              f"{config.emulate_cluster} each way")
                cluster.create()
            except netns.NetnsError as exc:
                raise BenchError(str(exc)) from None
        placement = make_placement(config, cluster)
        steps = len(config.sizes_bytes) * (config.warmup + config.iters)
        with _progress(console) as progress:
            task = progress.add_task("starting", total=len(systems) * steps)
            for index, system in enumerate(systems):
                try:
                    records[system] = _run_system(system, config, placement, procs,
                                                  progress, task, mxnet_python, stats)
                except SystemFailed as exc:
                    failed[system] = str(exc).splitlines()[0]
                    console.print(f"[red]{system} failed:[/] {exc}")
                finally:
                    procs.stop_all()
                progress.update(task, completed=(index + 1) * steps)
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted:[/] stopping every process and namespace")
    finally:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            procs.stop_all()
            if cluster is not None:
                cluster.destroy()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return _report(console, config, systems, records, skipped, failed, interrupted, log_dir,
                   stats)


def _report(console: Console, config: BenchConfig, systems: list[str],
            records: dict[str, dict[int, list[dict[str, Any]]]], skipped: dict[str, str],
            failed: dict[str, str], interrupted: bool, log_dir: Path,
            stats: dict[str, Any]) -> int:
    results = aggregate(config, records)
    if config.log_dir is not None:  # raw per-rank, per-iteration records beside the logs
        (log_dir / "records.json").write_text(json.dumps(records))
    if results:
        out = Console()
        if not out.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
            out = Console(width=200)
        render_table(out, config, results)
    daemons = stats.get("reducerd_daemons")
    if daemons:
        console.print(f"reducerd daemons: {daemons['input_GB_per_cpu_s']:.2f} GB of "
                      f"{config.wire_dtype} input per daemon CPU-second "
                      f"({daemons['input_bytes'] / 1e9:.2f} GB in {daemons['cpu_s']:.2f} s)")
    if config.json_path:
        record = config_record(config, systems, skipped, failed)
        if daemons:
            record["reducerd_daemons"] = daemons
        write_json(config.json_path, record, results)
        console.print(f"wrote {config.json_path}")
    if config.plot_path and results:
        write_plot(config.plot_path, config, results)
        console.print(f"wrote {config.plot_path}")
    if failed or interrupted:
        console.print(f"process logs kept in {log_dir}")
        return 130 if interrupted else 1
    if config.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0
