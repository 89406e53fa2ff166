"""`reducerd bench --emulate-cluster`: byte counts, node placement, namespaces always removed.

Runs only as root where `ip netns add` works; skipped otherwise. Uses a high
rate and tiny sizes, so the links are never the point: the structure and the
byte counts are.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from bench_checks import HAS_TORCH, check_results

from reducerd.bench.netns import PREFIX


def _netns_works() -> bool:
    if os.geteuid() != 0:
        return False
    probe = f"rbenchprobe-{uuid.uuid4().hex[:8]}"
    try:
        added = subprocess.run(["ip", "netns", "add", probe], capture_output=True,
                               timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    if added:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return added


pytestmark = pytest.mark.skipif(not _netns_works(),
                                reason="needs root and a working `ip netns add`")

EMULATED_KEYS = {"bytes_sent_per_worker", "bytes_received_per_worker",
                 "theory_bytes_per_worker", "line_rate_bound_s"}
NODE_KEYS = {"bytes_sent_per_node", "bytes_received_per_node"}


def namespaces_of(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines()
            if line.startswith(f"{PREFIX}{pid}-")]


def start_bench(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "reducerd", "bench", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_emulated_cluster_counts_bytes_per_worker_and_node(tmp_path: Path):
    """2 nodes x 2 workers, 1 daemon: every byte field, counts near theory, namespaces gone."""
    out = tmp_path / "bench.json"
    baselines = "gloo-float32" if HAS_TORCH else "none"
    bench = start_bench("--workers", "4", "--daemons", "1", "--workers-per-node", "2",
                        "--sizes", "256K", "--iters", "2", "--warmup", "1",
                        "--emulate-cluster", "10gbit", "--baselines", baselines, "--no-ddp-hook",
                        "--json", str(out))
    stdout, stderr = bench.communicate(timeout=150)
    assert bench.returncode == 0, stderr + stdout
    assert namespaces_of(bench.pid) == []
    data = json.loads(out.read_text())
    systems = ["reducerd"] + (["gloo-float32"] if HAS_TORCH else [])
    check_results(data, systems, [256 << 10], EMULATED_KEYS | NODE_KEYS)
    by_system = {r["system"]: r for r in data["results"]}
    reducerd = by_system["reducerd"]
    # Node-local aggregation: the node's link carries the float16 model
    # (128 KiB) once each way, however many workers the node runs; a worker's
    # share is half of it. Headers add ~1-2 % at MTU 9000.
    assert reducerd["theory_bytes_per_worker"] == 64 << 10
    for key in ("bytes_sent_per_node", "bytes_received_per_node"):
        assert (128 << 10) <= reducerd[key] <= 1.15 * (128 << 10), reducerd
    assert reducerd["bytes_sent_per_worker"] == pytest.approx(
        reducerd["bytes_sent_per_node"] / 2, abs=1)
    # Daemon link: one model per node (2) each way over a 10 Gbit/s link.
    assert reducerd["line_rate_bound_s"] == pytest.approx(2 * (128 << 10) / 1.25e9)
    if HAS_TORCH:
        ring = by_system["gloo-float32"]
        # Ranks placed node by node: one ring edge in and out per node, 2(N-1)/N models.
        assert ring["theory_bytes_per_worker"] == round(1.5 * (256 << 10) / 2)
        assert 1.5 * (256 << 10) <= ring["bytes_sent_per_node"] <= 1.15 * 1.5 * (256 << 10)


def test_int8_beside_reducerd_float16_counts_each_wires_own_bytes(tmp_path: Path):
    """--wire-dtype int8 --baselines reducerd-float16,tcp-floor-float16 on 2 nodes: each
    system's bytes near its own dtype's theory (int8 with its scales), about half
    float16's; the floor (plain TCP, no work) carries float16's model too."""
    out = tmp_path / "bench.json"
    bench = start_bench("--workers", "2", "--daemons", "1", "--sizes", "256K", "--iters", "2",
                        "--warmup", "1", "--emulate-cluster", "10gbit", "--wire-dtype", "int8",
                        "--baselines", "reducerd-float16,tcp-floor-float16", "--no-ddp-hook",
                        "--stall-timeout", "60", "--json", str(out))
    stdout, stderr = bench.communicate(timeout=120)
    assert bench.returncode == 0, stderr + stdout
    assert namespaces_of(bench.pid) == []
    data = json.loads(out.read_text())
    check_results(data, ["reducerd", "reducerd-float16", "tcp-floor-float16"], [256 << 10],
                  EMULATED_KEYS)
    by_system = {r["system"]: r for r in data["results"]}
    numel = (256 << 10) // 4
    theory = {"reducerd": 4 * numel // 128 + numel, "reducerd-float16": 2 * numel,
              "tcp-floor-float16": 2 * numel}
    for system, model in theory.items():
        r = by_system[system]
        assert r["theory_bytes_per_worker"] == model
        for key in ("bytes_sent_per_worker", "bytes_received_per_worker"):
            assert model <= r[key] <= 1.15 * model, (system, r)
    assert by_system["reducerd"]["bytes_sent_per_worker"] < \
        0.6 * by_system["reducerd-float16"]["bytes_sent_per_worker"]


def test_interrupt_and_leftovers_leave_no_namespace():
    """A leftover of a dead run is removed at start; Ctrl-C mid-run removes everything."""
    dead_pid = (1 << 22) + 1 + os.getpid() % 1000  # above the largest pid_max Linux allows
    leftover = f"{PREFIX}{dead_pid}-sw"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    try:
        bench = start_bench("--workers", "2", "--daemons", "1", "--sizes", "64M",
                            "--iters", "50", "--warmup", "1", "--baselines", "none",
                            "--emulate-cluster", "100mbit")
        deadline = time.monotonic() + 60
        while len(namespaces_of(bench.pid)) < 4 and time.monotonic() < deadline:
            assert bench.poll() is None, bench.communicate()
            time.sleep(0.2)
        assert len(namespaces_of(bench.pid)) == 4  # switch, 2 nodes, 1 daemon host
        time.sleep(3)  # let the workers start sending
        bench.send_signal(signal.SIGINT)
        stdout, stderr = bench.communicate(timeout=60)
        assert bench.returncode == 130, stderr
        assert "interrupted" in stderr
        assert f"removed leftover namespace {leftover}" in stderr
        assert namespaces_of(bench.pid) == []
        assert namespaces_of(dead_pid) == []
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True)
