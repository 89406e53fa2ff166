"""Run the training bench: for each worker count, each system in turn; then report.

The workers of one count run every system one after another in the same
processes (torch is imported once per worker, not once per system), each
system with its own reducerd job and its own Gloo master port.

One worker per node; reducerd's systems get as many daemons as workers, one
per daemon host (with fewer daemons at the same link rate each daemon link
would carry more than a ring's). On the emulated cluster the namespaces are
built once for the largest worker count and the first N nodes and daemon
hosts serve a run with N workers. Every child process is stopped after each
run and every namespace removed at the end, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from reducerd.bench import netns
from reducerd.bench.netns import Host, loopback_host
from reducerd.bench.procs import Proc, ProcessSet, SystemFailed, follow_workers, wait_for_log
from reducerd.bench.train.config import TrainConfig
from reducerd.bench.train.report import aggregate, render_tables, write_json, write_plot
from reducerd.local import LISTEN_RE

__all__ = ["run_train", "TrainBenchError"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_READY_TIMEOUT_S = 60.0
_GLOO_BASE_PORT = 29500  # Gloo masters' ports inside our own namespaces


class TrainBenchError(RuntimeError):
    """The bench cannot run at all (e.g. --emulate-cluster without root)."""


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_spec(config: TrainConfig, rank: int, workers: int, **extra: Any) -> str:
    acc = config.accelerator
    return json.dumps({
        "rank": rank, "world_size": workers, "model": config.model,
        "batch": config.batch_per_worker, "accelerator": acc.name,
        "peak_flops": acc.peak_flops, "utilisation": acc.utilisation,
        "byte_scale": config.byte_scale, "time_scale": config.time_scale,
        "steps": config.steps, "warmup": config.warmup, "comm_steps": config.comm_steps,
        "lr": config.lr, "wire_dtype": config.wire_dtype,
        "bucket_bytes": config.bucket_bytes, "stall_timeout_s": config.stall_timeout_s,
        **extra})


def _start_daemons(hosts: list[Host], config: TrainConfig, procs: ProcessSet,
                   ) -> tuple[list[Proc], list[str]]:
    """One daemon per host; (their processes, their addresses) once all listen."""
    daemons = []
    for i, host in enumerate(hosts):
        argv = host.command([sys.executable, "-m", "reducerd", "--listen", f"{host.address}:0",
                             "--round-timeout", str(config.stall_timeout_s),
                             "--drain-grace", "2"])
        daemons.append(procs.start(f"reducerd-daemon{i}", argv, {}))
    return daemons, [
        f"{host.address}:{wait_for_log(d, LISTEN_RE.pattern, _READY_TIMEOUT_S).group(2)}"
        for host, d in zip(hosts, daemons, strict=True)]


def _run_workers(workers: int, config: TrainConfig, nodes: list[Host],
                 daemon_hosts: list[Host], procs: ProcessSet, on_event,
                 ) -> None:
    """Every system at one worker count, in the same worker processes (torch imported once)."""
    nodes, daemon_hosts = nodes[:workers], daemon_hosts[:workers]
    master = nodes[0]
    # A port per (worker count, system): no run binds one a previous run left in TIME_WAIT.
    first = _GLOO_BASE_PORT + config.workers.index(workers) * len(config.systems)
    masters = {system: f"{master.address}:"
                       f"{_free_port() if master.netns is None else first + i}"
               for i, system in enumerate(config.systems)}
    extra: dict[str, Any] = {"masters": masters, "job": f"train-{os.getpid()}-n{workers}",
                             "systems": list(config.systems)}
    helpers: list[Proc] = []  # must outlive the workers
    if any(s.startswith("reducerd-") for s in config.systems):
        helpers, extra["addresses"] = _start_daemons(daemon_hosts, config, procs)
    started = []
    for rank, host in enumerate(nodes):
        spec = _worker_spec(config, rank, workers, **extra)
        argv = host.command([sys.executable, "-m", "reducerd.bench.train.worker", spec])
        # One intra-op thread each: the modeled compute needs none, the CPUs
        # belong to the network path.
        env = {"GLOO_SOCKET_IFNAME": host.iface or "lo", "OMP_NUM_THREADS": "1"}
        started.append(procs.start(f"n{workers}-worker{rank}", argv, env, rank=rank))
    follow_workers(started, helpers, config.stall_timeout_s, on_event)


def _cluster(config: TrainConfig, console: Console) -> netns.Cluster:
    try:
        netns.check_available()
        for name in netns.cleanup_leftovers():
            console.print(f"removed leftover namespace {name}")
        cluster = netns.Cluster(config.emulate_cluster or "", config.rate_bytes_per_s or 0,
                                config.max_workers, config.max_workers,
                                config.emulate_delay_s, config.emulate_mtu)
        console.print(f"emulated cluster: {config.max_workers} node(s) and as many daemon "
                      f"hosts, links {config.emulate_cluster} each way")
        cluster.create()
    except netns.NetnsError as exc:
        raise TrainBenchError(str(exc)) from None
    return cluster


def run_train(config: TrainConfig) -> int:
    """Run every (worker count, system); print and write the figures.

    Returns 0 when every run finished, 1 when one failed, 130 when interrupted;
    partial results are reported anyway.
    """
    console = Console(stderr=True)
    log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="reducerd-train-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = ProcessSet(log_dir)
    cluster: netns.Cluster | None = None
    records: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    interrupted = False
    in_main = threading.current_thread() is threading.main_thread()
    previous = ({sig: signal.signal(sig, _interrupt) for sig in _STOP_SIGNALS[1:]}
                if in_main else {})
    started = time.monotonic()
    try:
        if config.emulate_cluster:
            cluster = _cluster(config, console)
            nodes, daemon_hosts = cluster.nodes, cluster.daemons
        else:
            nodes = [loopback_host(f"n{k}") for k in range(config.max_workers)]
            daemon_hosts = [loopback_host(f"d{k}") for k in range(config.max_workers)]
        per_system = config.warmup - 1 + config.steps + config.comm_steps
        with Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("starting", total=len(config.workers)
                                     * len(config.systems) * per_system)
            for index, workers in enumerate(config.workers):
                progress.update(task, description=f"N={workers}: starting")

                def on_event(proc: Proc, event: dict[str, Any], workers: int = workers) -> None:
                    kind = event["event"]
                    if kind in ("check", "result"):
                        ranks = records.setdefault((event["system"], workers), {})
                        ranks.setdefault(proc.rank, {})[kind] = event  # type: ignore[arg-type]
                    elif kind == "iter" and proc.rank == 0:
                        progress.update(task, advance=1, description=(
                            f"{event['system']} N={workers} {event['phase']} "
                            f"{event['iteration'] + 1}"))
                try:
                    _run_workers(workers, config, nodes, daemon_hosts, procs, on_event)
                except SystemFailed as exc:
                    failed[f"N={workers}"] = str(exc).splitlines()[0]
                    console.print(f"[red]N={workers} failed:[/] {exc}")
                finally:
                    procs.stop_all()
                progress.update(task, completed=(index + 1) * len(config.systems) * per_system)
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
    results = aggregate(config, records)
    if config.log_dir is not None:
        (log_dir / "records.json").write_text(json.dumps(
            {f"{s}@{n}": r for (s, n), r in records.items()}))
    if results:
        out = Console() if Console().is_terminal else Console(width=200)
        render_tables(out, config, results)
    if config.json_path:
        write_json(config.json_path, config, results, failed, time.monotonic() - started)
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
