"""`reducerd bench --train`: model shapes, FLOPs-derived times, scaling, a tiny loopback run.

The loopback run never asserts on timing: only that every figure is there,
consistent with its definition, and that one step of every system lands
within the float64 reference's bound for its wire dtype.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reducerd.bench.train.cli import UsageError, config_from_argv
from reducerd.bench.train.config import Accelerator, TrainConfig, layer_times, scaled_numel
from reducerd.bench.train.report import comm_theory
from reducerd.bench.train.specs import bert_large, resnet50, tiny

CONTRACT_KEYS = {"system", "model", "workers", "step_time_s", "samples_per_s",
                 "scaling_efficiency", "comm_hidden_fraction"}
FOUR_SYSTEMS = ["reducerd-ddp", "reducerd-optimizer", "gloo-ddp-float32", "gloo-ddp-float16"]


def test_resnet50_has_torchvisions_parameters():
    """torchvision's resnet50 has 25,557,032 parameters in 161 tensors (BN buffers aside)."""
    spec = resnet50()
    shapes = {p.name: p.shape for p in spec.params}
    assert spec.param_count == 25_557_032 and len(spec.params) == 161
    assert spec.params[0].name == "conv1.weight" and spec.params[-1].name == "fc.bias"
    assert shapes["layer3.0.downsample.0.weight"] == (1024, 512, 1, 1)
    assert shapes["layer4.2.conv2.weight"] == (512, 512, 3, 3)
    assert shapes["fc.weight"] == (1000, 2048)
    # 4.09 G multiply-adds per 224x224 image, the architecture's published figure.
    assert spec.forward_flop_per_sample / 2 == pytest.approx(4.09e9, rel=0.01)


def test_bert_large_has_its_parameters():
    """Embeddings, 24 layers and pooler: 335,141,888 (the encoder and embeddings alone
    334,092,288), within 1% of the 335M usually quoted."""
    spec = bert_large()
    assert spec.param_count == 335_141_888
    assert spec.param_count - 1024 * 1024 - 1024 == 334_092_288
    assert spec.param_count == pytest.approx(335e6, rel=0.01)
    assert len(spec.params) == 5 + 24 * 16 + 2
    shapes = {p.name: p.shape for p in spec.params}
    assert shapes["embeddings.word_embeddings.weight"] == (30522, 1024)
    assert shapes["encoder.layer.23.intermediate.dense.weight"] == (4096, 1024)
    assert shapes["encoder.layer.0.output.dense.weight"] == (1024, 4096)
    # Per token: 2 FLOPs per encoder weight, and the attention matmuls 4 s h per layer.
    h, s = 1024, 128
    per_token = 2 * 24 * 12 * h * h + 4 * s * h * 24 + 2 * h * h / s
    assert spec.forward_flop_per_sample == pytest.approx(per_token * s, rel=1e-12)


def test_layer_times_follow_the_flops():
    spec = bert_large()
    acc = Accelerator("V100", 125e12, 0.40)
    times = layer_times(spec, 64, acc, time_scale=5.0)
    assert len(times) == len(spec.layers)
    for layer, (forward_s, backward_s) in zip(spec.layers, times, strict=True):
        assert forward_s == pytest.approx(layer.forward_flop_per_sample * 64 / 50e12 * 5)
        assert backward_s == pytest.approx(2 * forward_s)
    # A step of BERT-large, batch 64 at 128 tokens, at 50 TFLOP/s: 3 x 5.05 PFLOP.
    real_step_s = sum(f + b for f, b in times) / 5.0
    assert real_step_s == pytest.approx(3 * 64 * spec.forward_flop_per_sample / 50e12)
    assert 0.25 < real_step_s < 0.35


def test_time_scale_keeps_compute_and_communication_in_the_real_ratio():
    config = config_from_argv(["--train", "bert-large", "--emulate-cluster", "200mbit",
                               "--byte-scale", "100"])
    assert config.time_scale == pytest.approx(5.0)  # 100 Gbit/s / 200 Mbit/s / 100
    grad_bytes = 2 * config.spec.param_count  # float16
    scaled_bytes = 2 * sum(scaled_numel(p.numel, 100) for p in config.spec.params)
    compute_real = sum(f + b for f, b in config.times()) / config.time_scale
    compute_emulated = sum(f + b for f, b in config.times())
    ratio_real = grad_bytes / config.real_link_bytes_per_s / compute_real
    ratio_emulated = scaled_bytes / config.rate_bytes_per_s / compute_emulated
    assert ratio_emulated == pytest.approx(ratio_real, rel=1e-3)  # rounding up tiny tensors
    assert config.bucket_bytes == (25 << 20) // 100
    assert config_from_argv(["--train", "tiny"]).time_scale == 1.0  # loopback


def test_the_cloud_link_keeps_its_own_ratio_and_the_theory_follows_it():
    """--real-link 25gbit: time scaled 4x less than at 100 Gbit/s for the same
    emulated link; the theory per link is a ring's 2(N-1)/N of the gradient
    and reducerd's 1x, at the emulated rate and in the real setting."""
    fast = config_from_argv(["--train", "bert-large", "--emulate-cluster", "200mbit"])
    cloud = config_from_argv(["--train", "bert-large", "--emulate-cluster", "200mbit",
                              "--real-link", "25gbit"])
    assert cloud.real_link_bytes_per_s == 25e9 / 8
    assert cloud.time_scale == pytest.approx(fast.time_scale / 4)  # 25 / 0.2 / 100
    scaled = sum(scaled_numel(p.numel, cloud.byte_scale) for p in cloud.spec.params)
    ring = comm_theory(cloud, "gloo-ddp-float16", 8)
    ours = comm_theory(cloud, "reducerd-ddp", 8)
    assert ring["link_factor"] == 1.75 and ours["link_factor"] == 1.0
    assert ring["comm_theory_s"] == pytest.approx(2 * scaled * 1.75 / 25e6)
    assert ours["comm_theory_s"] == pytest.approx(2 * scaled / 25e6)  # float16 wire
    assert ours["real_comm_theory_s"] == pytest.approx(
        2 * cloud.spec.param_count / (25e9 / 8))
    assert comm_theory(fast, "reducerd-ddp", 8)["real_comm_theory_s"] == pytest.approx(
        ours["real_comm_theory_s"] / 4)
    assert comm_theory(config_from_argv(["--train", "tiny"]), "reducerd-ddp", 2)[
        "comm_theory_s"] is None  # loopback: no line rate


@pytest.mark.timeout(120)
def test_tiny_run_at_the_cloud_ratio_prints_the_theory(tmp_path: Path):
    """The smallest real run with --real-link 25gbit: the JSON records the link,
    each result its theory, and the table prints them."""
    out = tmp_path / "train.json"
    done = _run_bench("--train", "tiny", "--workers", "3", "--systems",
                      "reducerd-ddp,gloo-ddp-float16", "--steps", "2", "--warmup", "1",
                      "--comm-steps", "1", "--byte-scale", "1", "--real-link", "25gbit",
                      "--json", str(out), "--stall-timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    data = json.loads(out.read_text())
    assert data["config"]["real_link_bytes_per_s"] == 25e9 / 8
    params = data["config"]["param_count"]
    factors = {"reducerd-ddp": 1.0, "gloo-ddp-float16": 4 / 3}
    for r in data["results"]:
        assert r["link_factor"] == pytest.approx(factors[r["system"]])
        assert r["real_comm_theory_s"] == pytest.approx(
            2 * params * factors[r["system"]] / (25e9 / 8))
        assert r["comm_theory_s"] is None
    assert "real theory ms" in done.stdout and "25 Gbit/s" in done.stdout


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0,2"], "every count must be >= 1"),
    (["--workers", "two"], "comma-separated integers"),
    (["--systems", "reducerd,gloo"], "choose from"),
    (["--byte-scale", "0.5"], "--byte-scale must be >= 1"),
    (["--utilisation", "1.5"], "--utilisation must be in"),
    (["--warmup", "0"], "must be >= 1"),
    (["--emulate-delay", "1ms"], "needs --emulate-cluster"),
    (["--real-link", "fast"], "rate 'fast'"),
    (["--device", "cuda", "--time-scale", "2"], "compute is real and cannot be scaled"),
])
def test_bad_arguments_are_named(argv: list[str], message: str):
    with pytest.raises(UsageError, match=message):
        config_from_argv(["--train", "tiny", *argv])


def test_an_unknown_device_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        config_from_argv(["--train", "tiny", "--device", "tpu"])
    assert "--device: invalid choice: 'tpu'" in capsys.readouterr().err


def test_cuda_device_is_refused_without_a_gpu_and_keeps_compute_unscaled():
    torch = pytest.importorskip("torch")
    argv = ["--train", "tiny", "--device", "cuda", "--emulate-cluster", "200mbit"]
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="torch sees no CUDA device"):
            config_from_argv(argv)
    else:
        config = config_from_argv(argv)
        assert (config.device, config.time_scale) == ("cuda", 1.0)
        assert config.record()["device"] == "cuda"
    assert config_from_argv(["--train", "tiny"]).device == "cpu"
    record = TrainConfig(model="tiny", workers=(1,), device="cuda").record()
    assert record["modeled_compute_s"] is None and record["real_compute_s"] is None
    assert record["accelerator"] == {"name": "cuda:0 (real compute)"}
    assert TrainConfig(model="tiny", workers=(1,)).record()["modeled_compute_s"] > 0


torch = pytest.importorskip("torch")


@pytest.mark.timeout(60)
def test_modeled_model_produces_gradients_layer_by_layer_in_backward_order():
    from reducerd.bench.train.modeled import ComputeClock, build_model

    spec = resnet50()
    clock = ComputeClock()
    clock.enabled = False
    model = build_model(spec, [(0.0, 0.0)] * len(spec.layers), 1000, clock, rank=1)
    sizes = [p.numel() for p in model.parameters()]
    assert sizes == [scaled_numel(p.numel, 1000) for p in spec.params]
    order: list[int] = []
    for index, param in enumerate(model.parameters()):
        param.register_post_accumulate_grad_hook(lambda p, i=index: order.append(i))
    model(torch.zeros(1)).sum().backward()
    layer_of = [i for i, layer in enumerate(spec.layers) for _ in layer.params]
    assert [layer_of[i] for i in order] == sorted((layer_of[i] for i in order), reverse=True)
    assert len(order) == len(sizes)
    for layer in model.modeled_layers():  # rank 1's gradient: p - 2 c
        for p, c in zip(layer.parameters(recurse=False), layer.targets, strict=True):
            assert torch.allclose(p.grad, p.detach() - 2 * c)
    full = build_model(tiny(), [(0.0, 0.0)] * 4, 1, clock, rank=0)
    assert [tuple(p.shape) for p in full.parameters()] == [p.shape for p in tiny().params]


def test_clock_waits_at_least_what_it_is_asked_and_keeps_the_total():
    from reducerd.bench.train.modeled import ComputeClock

    clock = ComputeClock()
    start = time.perf_counter()
    for _ in range(20):
        clock.run(0.002)
    elapsed = time.perf_counter() - start
    waited, _ = clock.take()
    assert waited >= 0.040 - 1e-3  # late wake-ups shorten later waits, never the total
    assert elapsed < 0.040 * 2 + 0.1
    clock.enabled = False
    clock.run(1.0)
    assert clock.take()[0] == 0.0


def test_optimizer_starts_buckets_during_backward():
    """Several buckets: all but the ones holding the first layers leave before backward ends."""
    import reducer_client.torch as rt
    from reducer_client.testing import LocalGroup

    from reducerd.bench.train.modeled import ComputeClock, build_model
    from reducerd.bench.train.trainers import TimedReducer
    from reducerd.bench.train.worker import _launch_figures

    spec = resnet50()
    clock = ComputeClock()
    model = build_model(spec, [(0.0, 0.0002)] * len(spec.layers), 1000, clock, rank=0)
    reducer = TimedReducer(LocalGroup(1).client(0))
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  bucket_bytes=8 << 10, reducer=reducer)
    clock.take()
    model(torch.zeros(1)).sum().backward()
    opt.step()
    figures = _launch_figures(reducer.take(), clock.take()[1])
    assert figures["launches"] >= 5
    assert figures["launched_in_backward"] >= 1 - 2 / figures["launches"]
    assert figures["launch_lag_s"] < 0.05


def _run_bench(*args: str, timeout: float = 110) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reducerd", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_tiny_loopback_run_every_system(tmp_path: Path):
    """N = 1, 2 on loopback: the contract's fields, consistent figures, and one step of
    every system within its wire dtype's bound of the float64 reference."""
    out, plot = tmp_path / "train.json", tmp_path / "train.png"
    systems = [*FOUR_SYSTEMS, "reducerd-optimizer-xbar", "reducerd-backend"]
    done = _run_bench("--train", "tiny", "--workers", "1,2", "--systems", ",".join(systems),
                      "--steps", "3", "--warmup", "1", "--comm-steps", "2", "--byte-scale",
                      "1", "--json", str(out), "--plot", str(plot), "--stall-timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    data = json.loads(out.read_text())
    assert data["config"]["failed"] == {} and data["config"]["param_count"] == 2720
    assert data["config"]["host"]["command"].startswith("reducerd bench --train tiny ")
    results = {(r["system"], r["workers"]): r for r in data["results"]}
    assert set(results) == {(s, n) for s in systems for n in (1, 2)}
    batch = data["config"]["batch_per_worker"]
    for (system, workers), r in results.items():
        assert CONTRACT_KEYS <= set(r) and r["model"] == "tiny"
        t = r["step_time_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
        assert r["samples_per_s"] == pytest.approx(workers * batch / t["median"])
        single = results[(system, 1)]["samples_per_s"]
        assert r["scaling_efficiency"] == pytest.approx(r["samples_per_s"] / (workers * single))
        hidden = r["comm_hidden_fraction"]
        assert hidden is None or 0 <= hidden <= 1
        assert 0 < r["compute_s"] <= t["max"] and r["comm_alone_s"] > 0
        assert r["max_error_over_bound"] <= 1  # the worker fails the run otherwise
        if system.startswith("reducerd-"):
            assert r["reductions_per_step"] >= 1
    assert results[("reducerd-ddp", 1)]["scaling_efficiency"] == 1.0
    assert math.isclose(data["config"]["modeled_compute_s"],
                        sum(3 * 2e9 * batch / 50e12 for _ in range(4)))
    for system in systems:
        assert system in done.stdout  # the tables
    assert "1 node against 2 nodes" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("wire", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("world_size", [2, 8])
def test_eight_bit_first_step_bound_holds_and_is_not_vacuous(wire: str, world_size: int):
    """The training bench's 8-bit bound against one step done with the wire's own
    rounding: every rank's gradient quantized, summed in float32, divided,
    the mean quantized once, then p - lr g in float32."""
    import numpy as np
    from reducer_wire import convert, dtypes

    from reducerd.bench.train.modeled import eight_bit_error_bound

    rng = np.random.default_rng(world_size)
    numel, lr, code = 4096, 0.01, dtypes.WIRE_DTYPES[wire]
    p0 = rng.normal(0, 0.05, numel)
    c = rng.normal(0, 0.02, numel) * np.repeat(10.0 ** rng.uniform(-3, 0, numel // 64), 64)
    grads = [p0 - (r + 1) * c for r in range(world_size)]  # the bench's quadratic loss
    total = np.zeros(numel, np.float32)
    for g in grads:
        decoded = np.empty(numel, np.float32)
        convert.from_wire(convert.to_wire(g.astype(np.float32), code), code, decoded)
        total += decoded
    mean = np.empty(numel, np.float32)
    convert.from_wire(convert.to_wire(total / np.float32(world_size), code), code, mean)
    got = p0.astype(np.float32) - np.float32(lr) * mean
    reference = p0 - lr * np.mean(grads, axis=0)
    largest = np.max(np.abs(grads), axis=0)
    bound = eight_bit_error_bound(reference, largest, lr, world_size, wire, float(largest.max()))
    ratio = np.abs(got - reference) / bound
    assert ratio.max() <= 1
    assert ratio.max() > 0.05  # a bound 20 times too loose would check nothing


@pytest.mark.timeout(120)
def test_tiny_run_on_the_int8_wire_lands_within_its_bound(tmp_path: Path):
    """The 8-bit wires train too (issue 20), every reducerd system's first step
    checked against int8's bound, the DistributedOptimizer's flags included."""
    out = tmp_path / "train.json"
    done = _run_bench("--train", "tiny", "--workers", "2", "--systems",
                      "reducerd-ddp,reducerd-optimizer", "--wire-dtype", "int8", "--steps", "2",
                      "--warmup", "1", "--comm-steps", "1", "--byte-scale", "1", "--json",
                      str(out), "--stall-timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    data = json.loads(out.read_text())
    assert data["config"]["failed"] == {} and data["config"]["wire_dtype"] == "int8"
    for result in data["results"]:
        assert 0 < result["max_error_over_bound"] <= 1, result
