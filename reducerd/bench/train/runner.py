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
import sys
import time
from typing import Any

from rich.console import Console

from reducerd.bench.netns import Host, loopback_host
from reducerd.bench.procs import Proc, ProcessSet, SystemFailed, follow_workers
from reducerd.bench.session import (
    BenchError,
    BenchSession,
    free_port,
    progress_bar,
    results_console,
    start_daemons,
)
from reducerd.bench.train.config import TrainConfig
from reducerd.bench.train.report import aggregate, render_tables, write_json, write_plot

__all__ = ["run_train", "TrainBenchError"]

_GLOO_BASE_PORT = 29500  # Gloo masters' ports inside our own namespaces

# The bench cannot run at all (e.g. --emulate-cluster without root): the sweep's error.
TrainBenchError = BenchError


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
        "device": config.device,
        # The clients size their chunks for the emulated links, as an operator would set.
        "link_gbit": config.rate_bytes_per_s * 8e-9 if config.rate_bytes_per_s else None,
        **extra})


def _run_workers(workers: int, config: TrainConfig, nodes: list[Host],
                 daemon_hosts: list[Host], procs: ProcessSet, on_event,
                 ) -> None:
    """Every system at one worker count, in the same worker processes (torch imported once)."""
    nodes, daemon_hosts = nodes[:workers], daemon_hosts[:workers]
    master = nodes[0]
    # A port per (worker count, system): no run binds one a previous run left in TIME_WAIT.
    first = _GLOO_BASE_PORT + config.workers.index(workers) * len(config.systems)
    masters = {system: f"{master.address}:"
                       f"{free_port() if master.netns is None else first + i}"
               for i, system in enumerate(config.systems)}
    extra: dict[str, Any] = {"masters": masters, "job": f"train-{os.getpid()}-n{workers}",
                             "systems": list(config.systems)}
    helpers: list[Proc] = []  # must outlive the workers
    if any(s.startswith("reducerd-") for s in config.systems):
        helpers, extra["addresses"] = start_daemons(procs, daemon_hosts, "reducerd-daemon",
                                                     config.stall_timeout_s)
    started = []
    for rank, host in enumerate(nodes):
        spec = _worker_spec(config, rank, workers, **extra)
        argv = host.command([sys.executable, "-m", "reducerd.bench.train.worker", spec])
        # One intra-op thread each: the modeled compute needs none, the CPUs
        # belong to the network path.
        env = {"GLOO_SOCKET_IFNAME": host.iface or "lo", "OMP_NUM_THREADS": "1"}
        started.append(procs.start(f"n{workers}-worker{rank}", argv, env, rank=rank))
    follow_workers(started, helpers, config.stall_timeout_s, on_event)


def run_train(config: TrainConfig) -> int:
    """Run every (worker count, system); print and write the figures.

    Returns 0 when every run finished, 1 when one failed, 130 when interrupted;
    partial results are reported anyway.
    """
    console = Console(stderr=True)
    records: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    failed: dict[str, str] = {}
    started = time.monotonic()
    with BenchSession(console, config.log_dir, "reducerd-train-") as session:
        if config.emulate_cluster:
            cluster = session.emulate_cluster(
                config.emulate_cluster, config.rate_bytes_per_s or 0, config.max_workers,
                config.max_workers, config.emulate_delay_s, config.emulate_mtu,
                f"{config.max_workers} node(s) and as many daemon hosts")
            nodes, daemon_hosts = cluster.nodes, cluster.daemons
        else:
            nodes = [loopback_host(f"n{k}") for k in range(config.max_workers)]
            daemon_hosts = [loopback_host(f"d{k}") for k in range(config.max_workers)]
        per_system = config.warmup - 1 + config.steps + config.comm_steps
        with progress_bar(console, 40) as progress:
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
                    _run_workers(workers, config, nodes, daemon_hosts, session.procs, on_event)
                except SystemFailed as exc:
                    failed[f"N={workers}"] = str(exc).splitlines()[0]
                    console.print(f"[red]N={workers} failed:[/] {exc}")
                finally:
                    session.procs.stop_all()
                progress.update(task, completed=(index + 1) * len(config.systems) * per_system)
    results = aggregate(config, records)
    session.keep_records({f"{s}@{n}": r for (s, n), r in records.items()})
    if results:
        render_tables(results_console(), config, results)
    if config.json_path:
        write_json(config.json_path, config, results, failed, time.monotonic() - started)
        session.wrote(config.json_path)
    if config.plot_path and results:
        write_plot(config.plot_path, config, results)
        session.wrote(config.plot_path)
    return session.finish(bool(failed))
