"""Start one system's processes where the placement says: daemons or servers, then workers.

Every system gets the same N worker processes on the same hosts (ranks
placed node by node); reducerd's D daemons and MXNet's S = D servers run on
the daemon hosts, MXNet's scheduler beside server 0.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from reducerd.bench.config import (
    CHUNKED_SYSTEMS,
    REDUCERD_SYSTEMS,
    REDUCERD_WIRE_BASELINES,
    TCP_FLOOR_SYSTEMS,
    BenchConfig,
)
from reducerd.bench.netns import Cluster, Host, loopback_host
from reducerd.bench.procs import Proc, ProcessSet, wait_for_log
from reducerd.bench.session import READY_TIMEOUT_S, free_port, start_daemons

__all__ = ["Placement", "make_placement", "launch", "default_mxnet_python"]

# Inside our own namespaces every port is free; on loopback we ask the kernel.
# Each system its own port, so that none waits on the previous one's sockets.
_NETNS_PORTS = {"reducerd": 50051, "reducerd-ddp-hook": 50052, "gloo-float32": 29501,
                "gloo-float16": 29502, "mxnet-ps": 9091,
                **{system: 50053 + i for i, system in enumerate(REDUCERD_WIRE_BASELINES)},
                **{system: 50070 + i for i, system in enumerate(TCP_FLOOR_SYSTEMS)}}


@dataclass(frozen=True)
class Placement:
    """Host of every rank (node by node) and of every daemon."""

    workers: list[Host]
    daemons: list[Host]
    workers_per_node: int

    @property
    def emulated(self) -> bool:
        return self.daemons[0].netns is not None


def make_placement(config: BenchConfig, cluster: Cluster | None) -> Placement:
    per_node = config.workers_per_node
    if cluster is not None:
        nodes, daemons = cluster.nodes, cluster.daemons
    else:
        nodes = [loopback_host(f"n{k}") for k in range(config.nodes)]
        daemons = [loopback_host(f"d{i}") for i in range(config.daemons)]
    workers = [nodes[rank // per_node] for rank in range(config.workers)]
    return Placement(workers, list(daemons), per_node)


def default_mxnet_python() -> Path:
    """.venv-mxnet/bin/python at the repository root (beside the reducerd package)."""
    return Path(__file__).resolve().parents[2] / ".venv-mxnet" / "bin" / "python"


def _port(system: str, host: Host) -> int:
    return _NETNS_PORTS[system] if host.netns is not None else free_port()


def _worker_spec(system: str, rank: int, config: BenchConfig, host: Host, **extra) -> str:
    # A reducerd system's own wire dtype: what its client sends and its check allows.
    wire_dtype = config.wire_dtype_of(system) \
        if system in CHUNKED_SYSTEMS else config.wire_dtype
    return json.dumps({
        "system": system, "rank": rank, "world_size": config.workers,
        "sizes_bytes": list(config.sizes_bytes), "iters": config.iters,
        "warmup": config.warmup, "wire_dtype": wire_dtype,
        "mxnet_dtype": config.mxnet_dtype, "stall_timeout_s": config.stall_timeout_s,
        "chunk_bytes": config.chunk_bytes, "iface": host.iface,
        # The clients size their chunks for the emulated links, as an operator would set.
        "link_gbit": config.rate_bytes_per_s * 8e-9 if config.rate_bytes_per_s else None,
        **extra})


def _start_workers(system: str, python: str, config: BenchConfig, placement: Placement,
                   procs: ProcessSet, env_of, **extra) -> list[Proc]:
    # One OpenMP thread per worker, every system alike (as the training bench
    # does): the cores are for the network path, and an OpenMP pool that spins
    # after the untimed refill (libgomp's default wait policy) would take one
    # from the timed region. A value the user set is kept.
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    workers = []
    for rank, host in enumerate(placement.workers):
        spec = _worker_spec(system, rank, config, host, **extra)
        argv = host.command([python, "-m", "reducerd.bench.worker", spec])
        workers.append(procs.start(f"{system}-worker{rank}", argv,
                                   {**threads, **env_of(rank, host)}, rank=rank))
    return workers


def _local_env(rank: int, placement: Placement) -> dict[str, str]:
    per_node = placement.workers_per_node
    return {"REDUCER_LOCAL_RANK": str(rank % per_node), "REDUCER_LOCAL_SIZE": str(per_node)}


def _launch_reducerd(system: str, config: BenchConfig, placement: Placement,
                     procs: ProcessSet, run_id: str) -> tuple[list[Proc], list[Proc]]:
    """Fresh daemons for `system` (one of REDUCERD_SYSTEMS), then its workers."""
    daemons, addresses = start_daemons(procs, placement.daemons, f"{system}-daemon",
                                       config.stall_timeout_s, lambda host: _port(system, host))
    workers = _start_workers(
        system, sys.executable, config, placement, procs,
        lambda rank, host: _local_env(rank, placement), addresses=addresses,
        job=f"bench-{run_id}")
    return workers, daemons


def _launch_gloo(system: str, config: BenchConfig, placement: Placement,
                 procs: ProcessSet) -> tuple[list[Proc], list[Proc]]:
    master = placement.workers[0]
    return _start_workers(
        system, sys.executable, config, placement, procs,
        lambda rank, host: {"GLOO_SOCKET_IFNAME": host.iface or "lo"},
        master=f"{master.address}:{_port(system, master)}"), []


def _launch_mxnet(config: BenchConfig, placement: Placement, procs: ProcessSet,
                  python: str) -> tuple[list[Proc], list[Proc]]:
    root = placement.daemons[0]
    common = {"DMLC_PS_ROOT_URI": root.address,
              "DMLC_PS_ROOT_PORT": str(_port("mxnet-ps", root)),
              "DMLC_NUM_SERVER": str(config.daemons), "DMLC_NUM_WORKER": str(config.workers),
              "PS_VERBOSE": "0"}

    def env(role: str, host: Host) -> dict[str, str]:
        return {**common, "DMLC_ROLE": role, "DMLC_NODE_HOST": host.address,
                "DMLC_INTERFACE": host.iface or "lo"}

    # Importing mxnet with DMLC_ROLE=scheduler/server runs that role, then exits.
    helpers = [procs.start("mxnet-scheduler", root.command([python, "-c", "import mxnet"]),
                           env("scheduler", root))]
    for i, host in enumerate(placement.daemons):
        helpers.append(procs.start(f"mxnet-server{i}",
                                   host.command([python, "-c", "import mxnet"]),
                                   env("server", host)))
    workers = _start_workers("mxnet-ps", python, config, placement, procs,
                             lambda rank, host: env("worker", host))
    return workers, helpers


def _launch_floor(system: str, config: BenchConfig, placement: Placement,
                  procs: ProcessSet) -> tuple[list[Proc], list[Proc]]:
    """An echo server (reducerd/bench/floor.py) on each daemon host, then the workers."""
    from reducerd.bench.floor import LISTENING

    servers, addresses = [], []
    for i, host in enumerate(placement.daemons):
        argv = host.command([sys.executable, "-m", "reducerd.bench.floor", "--listen",
                             f"{host.address}:{_port(system, host)}",
                             "--workers", str(config.workers)])
        servers.append(procs.start(f"{system}-server{i}", argv, {}))
    for host, server in zip(placement.daemons, servers, strict=True):
        port = wait_for_log(server, rf"{LISTENING} \S+:(\d+)", READY_TIMEOUT_S).group(1)
        addresses.append(f"{host.address}:{port}")
    return _start_workers(system, sys.executable, config, placement, procs,
                          lambda rank, host: {}, addresses=addresses), servers


def launch(system: str, config: BenchConfig, placement: Placement, procs: ProcessSet,
           run_id: str, mxnet_python: Path) -> tuple[list[Proc], list[Proc]]:
    """Start `system`; return (workers, helpers) where helpers must outlive the workers."""
    if system in REDUCERD_SYSTEMS:
        return _launch_reducerd(system, config, placement, procs, run_id)
    if system.startswith("gloo-"):
        return _launch_gloo(system, config, placement, procs)
    if system == "mxnet-ps":
        return _launch_mxnet(config, placement, procs, str(mxnet_python))
    if system in TCP_FLOOR_SYSTEMS:
        return _launch_floor(system, config, placement, procs)
    raise ValueError(f"unknown system {system!r}")
