"""`reducerd bench` arguments, units and the theory figures: pure, fast, no processes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from reducerd.bench.cli import UsageError, build_parser, config_from_argv, main
from reducerd.bench.config import BenchConfig
from reducerd.bench.figures import aggregate, line_rate_bound_s, theory_bytes_per_node
from reducerd.bench.runner import _available
from reducerd.bench.systems import Comm
from reducerd.bench.units import parse_rate, parse_sizes, parse_time

BASE = ["--workers", "4", "--daemons", "2"]


@pytest.mark.parametrize("text, expected", [
    ("1K,1M,64M", [1024, 1 << 20, 64 << 20]),
    ("64m,1k,1K", [1024, 64 << 20]),
    ("1K:8K", [1024, 2048, 4096, 8192]),
    ("1K:256M:4", [1 << k for k in range(10, 29, 2)]),
    ("4096", [4096]),
])
def test_sizes(text, expected):
    assert parse_sizes(text) == expected


@pytest.mark.parametrize("text", ["", "1X", "3", "1K:512", "1K:4K:1", "-4K", "1K,,2Q"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_sizes(text)


@pytest.mark.parametrize("text, bytes_per_s", [
    ("200mbit", 25e6), ("1gbit", 125e6), ("10mbps", 10e6), ("1000000", 125e3),
    ("1mibit", (1 << 20) / 8),
])
def test_rates_in_tc_syntax(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s)


def test_times():
    assert parse_time("2ms") == pytest.approx(2e-3)
    assert parse_time("500us") == pytest.approx(5e-4)
    with pytest.raises(ValueError):
        parse_time("fast")


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0", "--daemons", "1"], "--workers"),
    (["--workers", "2", "--daemons", "0"], "--daemons"),
    (BASE + ["--sizes", "1Q"], "size"),
    (BASE + ["--sizes", "6"], "multiple of 4"),
    (BASE + ["--baselines", "horovod"], "baseline 'horovod'"),
    (BASE + ["--workers-per-node", "3"], "must divide"),
    (BASE + ["--emulate-cluster", "fast"], "rate 'fast'"),
    (BASE + ["--emulate-delay", "1ms"], "needs --emulate-cluster"),
    (BASE + ["--iters", "0"], "--iters"),
    (BASE + ["--emulate-cluster", "1gbit", "--emulate-mtu", "100"], "--emulate-mtu"),
    (BASE + ["--baselines", "reducerd-float16"], "reducerd-float16 is reducerd itself"),
    (BASE + ["--wire-dtype", "int8", "--baselines", "gloo,reducerd-int8"],
     "reducerd-int8 is reducerd itself"),
    (BASE + ["--baselines", "reducerd-fp16"], "baseline 'reducerd-fp16'"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(UsageError, match=message):
        config_from_argv(argv)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_workers_and_daemons_are_required(capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_argv(["--workers", "2"])
    assert exc.value.code == 2
    assert "--daemons" in capsys.readouterr().err


def test_defaults():
    config = config_from_argv(BASE)
    assert config.sizes_bytes[0] == 1024 and config.sizes_bytes[-1] == 256 << 20
    assert config.systems == ("reducerd", "reducerd-ddp-hook", "gloo-float32",
                              "gloo-float16", "mxnet-ps")
    assert config.wire_dtype == "float16" and config.busbw_factor == pytest.approx(1.5)
    assert config_from_argv(BASE + ["--baselines", "none"]).systems == (
        "reducerd", "reducerd-ddp-hook")
    assert config_from_argv(BASE + ["--baselines", "none", "--no-ddp-hook"]).systems == (
        "reducerd",)


def test_reducerd_over_another_wire_dtype_is_a_baseline():
    config = config_from_argv(BASE + ["--wire-dtype", "int8", "--baselines",
                                      "gloo-float16,reducerd-float16,reducerd-fp8_e4m3"])
    # Run order: reducerd's own paths, then reducerd over fixed wires, then the rest.
    assert config.systems == ("reducerd", "reducerd-ddp-hook", "reducerd-float16",
                              "reducerd-fp8_e4m3", "gloo-float16")
    assert [config.wire_dtype_of(s) for s in config.systems[:4]] == [
        "int8", "int8", "float16", "fp8_e4m3"]
    with pytest.raises(ValueError, match="gloo-float16"):
        config.wire_dtype_of("gloo-float16")
    help_text = " ".join(build_parser().format_help().split())
    assert "reducerd-DTYPE (DTYPE one of float16, bfloat16, float32, int8, fp8_e4m3, " \
           "fp8_e5m2" in help_text


def test_help_does_not_import_frameworks():
    code = ("import sys\nfrom reducerd.__main__ import main\n"
            "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = {'torch', 'tensorflow', 'mxnet', 'grpc', 'numpy'} & set(sys.modules)\n"
            "print('HEAVY', sorted(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "--emulate-cluster" in out
    assert "HEAVY []" in out


def test_missing_mxnet_environment_is_skipped_with_a_reason(tmp_path):
    skipped: dict[str, str] = {}
    config = config_from_argv(BASE + ["--baselines", "mxnet", "--no-ddp-hook"])
    systems = _available(config, tmp_path / "no-such-python", skipped)
    assert systems == ["reducerd"]
    assert "no MXNet environment" in skipped["mxnet-ps"]


def test_without_torch_the_hook_and_gloo_are_skipped_with_a_reason(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    skipped: dict[str, str] = {}
    systems = _available(config_from_argv(BASE + ["--baselines", "gloo"]),
                         tmp_path / "no-such-python", skipped)
    assert systems == ["reducerd"]
    assert set(skipped) == {"reducerd-ddp-hook", "gloo-float32", "gloo-float16"}
    assert all("torch is not installed" in reason for reason in skipped.values())


def _config(**changes) -> BenchConfig:
    return BenchConfig(workers=4, daemons=2, sizes_bytes=(16 << 20,), **changes)


def test_theory_bytes():
    config = _config(emulate_cluster="200mbit", rate_bytes_per_s=25e6)
    model_fp16 = 8 << 20
    assert theory_bytes_per_node("reducerd", 16 << 20, config) == model_fp16
    # The DDP hook's path moves exactly what the core's does.
    assert theory_bytes_per_node("reducerd-ddp-hook", 16 << 20, config) == model_fp16
    assert line_rate_bound_s("reducerd-ddp-hook", 16 << 20, config) == \
        line_rate_bound_s("reducerd", 16 << 20, config)
    assert theory_bytes_per_node("gloo-float32", 16 << 20, config) == 1.5 * (16 << 20)
    assert theory_bytes_per_node("gloo-float16", 16 << 20, config) == 1.5 * model_fp16
    # D = N/2: each daemon link carries two models, which bounds the time.
    assert line_rate_bound_s("reducerd", 16 << 20, config) == 2 * model_fp16 / 25e6
    per_node = _config(workers_per_node=2, emulate_cluster="200mbit", rate_bytes_per_s=25e6)
    # reducerd's client aggregates inside the node by default: the model once per node.
    assert theory_bytes_per_node("reducerd", 16 << 20, per_node) == model_fp16
    assert theory_bytes_per_node("reducerd", 16 << 20, per_node, node_aggregation=False) \
        == 2 * model_fp16
    assert theory_bytes_per_node("mxnet-ps", 16 << 20, per_node) == 2 * model_fp16


def test_aggregate_takes_the_slowest_rank_per_iteration():
    config = BenchConfig(workers=2, daemons=1, sizes_bytes=(1024,), iters=3)
    records = {"reducerd": {0: [{"size_bytes": 1024, "times_s": [1.0, 2.0, 3.0]}],
                            1: [{"size_bytes": 1024, "times_s": [4.0, 1.0, 1.0]}]}}
    (result,) = aggregate(config, records)
    assert result["time_s"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert result["algbw_GBps"] == pytest.approx(1024 / 3.0 / 1e9)
    assert result["busbw_GBps"] == pytest.approx(result["algbw_GBps"])  # 2(N-1)/N = 1


def test_aggregate_pairs_the_hook_with_the_core_iteration_by_iteration():
    """paired_core: the core's slowest rank per iteration, and the hook's slowest over it."""
    config = BenchConfig(workers=2, daemons=1, sizes_bytes=(1024,), iters=3)
    records = {"reducerd-ddp-hook": {
        0: [{"size_bytes": 1024, "times_s": [1.0, 2.0, 3.0], "reference_times_s": [2.0, 1.0, 1.0]}],
        1: [{"size_bytes": 1024, "times_s": [4.0, 1.0, 1.0], "reference_times_s": [1.0, 4.0, 2.0]}],
    }}
    (result,) = aggregate(config, records)
    assert result["time_s"] == {"median": 3.0, "min": 2.0, "max": 4.0}  # 4, 2, 3
    paired = result["paired_core"]
    assert paired["time_s"] == {"median": 2.0, "min": 2.0, "max": 4.0}  # 2, 4, 2
    # 4/2, 2/4, 3/2: the ratio of the same iteration, not of the two medians (1.5).
    assert paired["ratio"] == {"median": 1.5, "min": 0.5, "max": 2.0}
    plain = {"reducerd": {rank: [{"size_bytes": 1024, "times_s": [1.0, 1.0, 1.0],
                                  "reference_times_s": None}] for rank in (0, 1)}}
    assert "paired_core" not in aggregate(config, plain)[0]


def test_run_sweep_alternates_the_reference_and_checks_both():
    """The hook's reference runs in every iteration, first in odd ones and second in
    even ones, each after a barrier; warm-up left out; a wrong reference fails the run."""
    from reducerd.bench.systems import run_sweep

    log: list[str] = []

    class Fake:
        def __init__(self, name, value):
            self.name, self.value = name, value

        def prepare(self, numel):  # as DdpHookComm: its reference's too
            self.out = np.zeros(numel, np.float32)
            if hasattr(self, "reference"):
                self.reference.prepare(numel)

        def refill(self):
            self.out[:] = 0
            if hasattr(self, "reference"):
                self.reference.refill()

        def run(self):
            log.append(self.name)
            self.out[:] = self.value

        def result(self):
            return self.out

        def barrier(self):
            log.append("barrier")

        check = Comm.check

    comm, reference = Fake("hook", 3), Fake("core", 3)
    comm.reference = reference
    events = []
    spec = {"world_size": 2, "system": "reducerd-ddp-hook", "wire_dtype": "float16",
            "sizes_bytes": [16], "warmup": 1, "iters": 3}
    run_sweep(comm, spec, lambda event, **fields: events.append((event, fields)))
    runs = [entry for entry in log if entry != "barrier"]
    assert runs == ["hook", "core", "core", "hook", "hook", "core", "core", "hook"]
    assert log.count("barrier") == 8  # one before each run, none after (no interface)
    (size,) = [fields for event, fields in events if event == "size"]
    assert len(size["times_s"]) == len(size["reference_times_s"]) == 3
    reference.value = 4  # the expected sum of ranks 0 and 1 is 1 + 2
    with pytest.raises(AssertionError, match="the core beside it"):
        run_sweep(comm, spec, lambda event, **fields: None)


def test_result_check_is_exact_but_on_the_8bit_wires():
    from reducerd.bench.systems import _allowed_error

    def spec(system, wire):
        return {"system": system, "wire_dtype": wire, "world_size": 4}
    for wire in ("float16", "bfloat16", "float32"):
        assert _allowed_error(spec("reducerd", wire), 10) == 0.0
    assert _allowed_error(spec("gloo-float16", "int8"), 10) == 0.0  # its own exact sums
    # About two roundings of the wire's relative size, never much more.
    for wire, rel in (("int8", 1 / 254), ("fp8_e4m3", 2 ** -4), ("fp8_e5m2", 2 ** -3)):
        for system in ("reducerd", "reducerd-ddp-hook"):
            allowed = _allowed_error(spec(system, wire), 10)
            assert 2 * rel * 10 < allowed < 2.1 * rel * (1 + rel) * 10, (wire, allowed)


def test_theory_and_allowed_error_follow_each_reducerd_systems_own_wire_dtype():
    import json

    from reducerd.bench.launch import _worker_spec
    from reducerd.bench.netns import loopback_host
    from reducerd.bench.systems import _allowed_error

    config = _config(wire_dtype="int8", emulate_cluster="200mbit", rate_bytes_per_s=25e6,
                     baselines=("reducerd-float16", "reducerd-float32", "gloo-float16"))
    numel = (16 << 20) // 4
    int8_bytes = 4 * -(-numel // 128) + numel  # a float32 scale per 128 codes
    assert theory_bytes_per_node("reducerd", 16 << 20, config) == int8_bytes
    assert theory_bytes_per_node("reducerd-float16", 16 << 20, config) == 2 * numel
    assert theory_bytes_per_node("reducerd-float32", 16 << 20, config) == 4 * numel
    assert theory_bytes_per_node("gloo-float16", 16 << 20, config) == 1.5 * 2 * numel
    # D = N/2: two models on each daemon link, in that system's own dtype.
    assert line_rate_bound_s("reducerd-float16", 16 << 20, config) == 2 * 2 * numel / 25e6
    host = loopback_host("n0")
    specs = {s: json.loads(_worker_spec(s, 0, config, host)) for s in config.systems}
    assert {s: spec["wire_dtype"] for s, spec in specs.items()} == {
        "reducerd": "int8", "reducerd-ddp-hook": "int8", "reducerd-float16": "float16",
        "reducerd-float32": "float32", "gloo-float16": "int8"}
    # Exact sums on the 16- and 32-bit wires, the derived bound on int8 only.
    assert _allowed_error({**specs["reducerd-float16"], "world_size": 4}, 10) == 0.0
    assert _allowed_error({**specs["reducerd-float32"], "world_size": 4}, 10) == 0.0
    assert _allowed_error({**specs["reducerd"], "world_size": 4}, 10) > 2 * 10 / 254
    int8_baseline = {"system": "reducerd-int8", "wire_dtype": "int8", "world_size": 4}
    assert _allowed_error(int8_baseline, 10) == _allowed_error(specs["reducerd"], 10)
