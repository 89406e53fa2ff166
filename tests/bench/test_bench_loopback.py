"""A tiny `reducerd bench` sweep on loopback: every system's results, the JSON's schema.

Never asserts on timing: only that each figure is there, positive and consistent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_checks import HAS_MATPLOTLIB, HAS_MXNET_ENV, HAS_TORCH, check_results

from reducerd.bench.runner import CPU_TICKS_TO_MEASURE

SIZES = [4096, 65536]


def run_bench(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reducerd", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_loopback_sweep_every_system(tmp_path: Path):
    """2 workers, 2 daemons, two tiny sizes: reducerd, Gloo fp32/fp16, ps-lite and the
    tcp-floor all report."""
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["--workers", "2", "--daemons", "2", "--sizes", "4K,64K", "--iters", "2",
            "--warmup", "1", "--baselines", "gloo,mxnet,tcp-floor", "--json", str(out)]
    if HAS_MATPLOTLIB:
        args += ["--plot", str(plot)]
    done = run_bench(*args)
    assert done.returncode == 0, done.stderr + done.stdout
    data = json.loads(out.read_text())
    systems = ["reducerd"]
    # The shim's path (a DDP bucket through the hook), beside the core's.
    systems += ["reducerd-ddp-hook", "gloo-float32", "gloo-float16"] if HAS_TORCH else []
    systems += ["mxnet-ps"] if HAS_MXNET_ENV else []
    systems += ["tcp-floor"]
    check_results(data, systems, SIZES)
    config = data["config"]
    assert config["workers"] == 2 and config["daemons"] == 2
    assert config["sizes_bytes"] == SIZES and config["failed"] == {}
    assert config["emulate_cluster"] is None
    # What the figures were measured on, when and with what (the results pages show it).
    assert config["host"]["command"] == "reducerd bench " + " ".join(args)
    assert config["host"]["cpu_model"] and config["host"]["date"].endswith("Z")
    if not HAS_MXNET_ENV:
        assert "mxnet-ps skipped" in done.stderr
    for system in systems:
        assert system in done.stdout  # the table
    if HAS_MATPLOTLIB:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failing_system_is_reported_and_the_rest_still_runs(tmp_path: Path):
    """A broken MXNet interpreter fails mxnet-ps alone: exit 1, reducerd's results kept."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no mxnet here' >&2\nexit 3\n")
    fake.chmod(0o755)
    out = tmp_path / "bench.json"
    done = run_bench("--workers", "2", "--daemons", "1", "--sizes", "4K", "--iters", "1",
                     "--warmup", "0", "--baselines", "mxnet", "--mxnet-python", str(fake),
                     "--json", str(out), "--stall-timeout", "30", "--no-ddp-hook")
    assert done.returncode == 1, done.stderr
    assert "mxnet-ps failed" in done.stderr
    data = json.loads(out.read_text())
    check_results(data, ["reducerd"], [4096])
    assert "mxnet-ps" in data["config"]["failed"]


def test_reducerd_over_float16_beside_the_int8_wire_in_one_run(tmp_path: Path):
    """--wire-dtype int8 --baselines reducerd-float16: both on fresh daemons, both sums
    checked by the workers (int8 within its bound, float16 exactly), one ratio."""
    out = tmp_path / "bench.json"
    done = run_bench("--workers", "2", "--daemons", "2", "--sizes", "1M", "--iters", "2",
                     "--warmup", "1", "--baselines", "reducerd-float16", "--wire-dtype",
                     "int8", "--no-ddp-hook", "--stall-timeout", "60", "--json", str(out))
    assert done.returncode == 0, done.stderr + done.stdout
    data = json.loads(out.read_text())
    check_results(data, ["reducerd", "reducerd-float16"], [1 << 20])
    config = data["config"]
    assert config["systems"] == ["reducerd", "reducerd-float16"]
    assert config["wire_dtype"] == "int8" and config["failed"] == {}
    # The daemons' input after the first step: int8 codes and their scales.
    numel = (1 << 20) // 4
    assert config["reducerd_daemons"]["input_bytes"] == 2 * 2 * (4 * numel // 128 + numel)
    # Every reducerd system's daemons report theirs, in the wire dtype they send.
    servers = config["server_cpu"]
    assert servers["reducerd"] == config["reducerd_daemons"]
    assert servers["reducerd-float16"]["input_bytes"] == 2 * 2 * 2 * numel
    # A rate only where /proc's clock ticks measured enough CPU time, and then the true one.
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    for figures in servers.values():
        assert figures["cpu_s"] >= 0, servers
        if figures["cpu_s"] < CPU_TICKS_TO_MEASURE * tick_s:
            assert figures["input_GB_per_cpu_s"] is None, servers
        else:
            expected = figures["input_bytes"] / 1e9 / figures["cpu_s"]
            rate = figures["input_GB_per_cpu_s"]
            assert rate == pytest.approx(expected, rel=0.02, abs=0.001), servers
    assert "reducerd-float16 daemons:" in done.stderr
    assert "reducerd-float16" in done.stdout  # its row, with its ratio
    assert re.search(r"reducerd-float16\s.*\d\.\d\dx", done.stdout), done.stdout


def test_every_system_gets_its_input_written_before_each_timed_call():
    """reducerd's core row rewrites its input before each call (refill), as the
    hook, Gloo and MXNet rows do: an input left untouched from call to call
    is a cache state no training step has (it took 7 % less time here)."""
    import numpy as np

    from reducerd.bench.systems import ReducerdComm

    spec = {"addresses": ["127.0.0.1:1"], "job": "refill", "rank": 1, "world_size": 2,
            "wire_dtype": "float16", "stall_timeout_s": 5.0}
    comm = ReducerdComm(spec)
    try:
        comm.prepare(1000)
        first = comm.x.copy()
        comm.x[:] = -1.0  # what a call in place, or anything else, left there
        comm.refill()
        assert np.array_equal(comm.x, first) and comm.out is not comm.x
    finally:
        comm.close()
