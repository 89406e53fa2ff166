"""Horovod's own example scripts, ported by changing the import, on real daemons.

examples/horovod/ holds six of Horovod's examples with the horovod import
changed to reducer_client (and the few marked edits each port's header
lists: offline data, Keras 3). Each runs here as 2 worker processes on 2
real daemons on loopback, for a few steps on synthetic data, and must exit
0 on every rank with its own closing output. A further test checks that the
ports differ from Horovod's originals (examples/horovod/upstream) only in
lines that import reducer_client or are marked "reducerd port".
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support import collect_outputs, running_daemons

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "horovod"
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"
WORLD_SIZE = 2
# Each run takes 5-30 s on an idle 2-core machine (the TensorFlow ones trace a
# MobileNetV3Small); this only bounds a hang on a machine shared with other work.
EXAMPLE_TIMEOUT_S = 240.0


def _run(script: str, args: list[str], cwd: Path, python: str = sys.executable,
         env: dict[str, str] | None = None) -> list[str]:
    """Run the example as WORLD_SIZE ranks on 2 fresh daemons; each rank's output."""
    with running_daemons(2, log_dir=cwd) as daemons:
        job = uuid.uuid4().hex
        procs = []
        for rank in range(WORLD_SIZE):
            rank_env = dict(os.environ, REDUCER_ADDRESSES=",".join(daemons.addresses),
                            REDUCER_JOB=job, REDUCER_RANK=str(rank),
                            REDUCER_WORLD_SIZE=str(WORLD_SIZE), REDUCER_TIMEOUT="60",
                            OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
            procs.append(subprocess.Popen([python, str(EXAMPLES / script), *args], cwd=cwd,
                                          env=rank_env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outputs = collect_outputs(procs, EXAMPLE_TIMEOUT_S)
        for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
            assert proc.returncode == 0, f"{script} rank {rank} exited {proc.returncode}:\n{out}"
        return outputs


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed in this environment")


@pytest.mark.parametrize("fp16", [False, True])
def test_pytorch_synthetic_benchmark(tmp_path, fp16):
    _needs("torch")
    outputs = _run("pytorch_synthetic_benchmark.py",
                   ["--model", "tinynet", "--batch-size", "4", "--num-warmup-batches", "1",
                    "--num-batches-per-iter", "2", "--num-iters", "2"]
                   + (["--fp16-allreduce"] if fp16 else []), tmp_path)
    assert "Total img/sec on 2 CPU(s)" in outputs[0]


def test_pytorch_mnist(tmp_path):
    _needs("torch")
    outputs = _run("pytorch_mnist.py", ["--epochs", "1", "--batch-size", "32",
                                        "--test-batch-size", "64",
                                        "--gradient-predivide-factor", "2.0"], tmp_path,
                   env={"REDUCER_EXAMPLE_SAMPLES": "512", "HOME": str(tmp_path)})
    assert "Test set: Average loss" in outputs[0]


def test_tensorflow2_keras_synthetic_benchmark(tmp_path):
    _needs("tensorflow")
    outputs = _run("tensorflow2_keras_synthetic_benchmark.py",
                   ["--model", "MobileNetV3Small", "--batch-size", "2",
                    "--num-batches-per-iter", "2", "--num-iters", "2", "--no-cuda"], tmp_path)
    assert "Total img/sec on 2 CPU(s)" in outputs[0]


def test_tensorflow2_synthetic_benchmark(tmp_path):
    _needs("tensorflow")
    outputs = _run("tensorflow2_synthetic_benchmark.py",
                   ["--model", "MobileNetV3Small", "--batch-size", "2",
                    "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                    "--num-iters", "2", "--no-cuda", "--fp16-allreduce"], tmp_path)
    assert "Total img/sec on 2 CPU(s)" in outputs[0]


def test_tensorflow2_keras_mnist(tmp_path):
    """Its callbacks too: broadcast, metric average, warmup (lr logged), checkpoint."""
    _needs("tensorflow")
    outputs = _run("tensorflow2_keras_mnist.py", [], tmp_path,
                   env={"REDUCER_EXAMPLE_SAMPLES": "512", "REDUCER_EXAMPLE_STEPS": "8",
                        "REDUCER_EXAMPLE_EPOCHS": "2"})
    assert "lr:" in outputs[0] and (tmp_path / "checkpoint-2.h5").exists()


def test_mxnet_mnist(tmp_path):
    """Unchanged but for the import; its own check: validation accuracy > 0.96."""
    if not MXNET_PYTHON.exists():
        pytest.skip("no .venv-mxnet")
    for rank in range(WORLD_SIZE):
        subprocess.run([str(MXNET_PYTHON), str(EXAMPLES / "_offline.py"), "mxnet-data",
                        str(tmp_path / f"data-{rank}")], check=True, timeout=60,
                       env=dict(os.environ, REDUCER_EXAMPLE_SAMPLES="4096"))
    outputs = _run("mxnet_mnist.py", ["--epochs", "1", "--no-cuda"], tmp_path,
                   python=str(MXNET_PYTHON))
    assert "Validation: accuracy=" in outputs[0]


PORTS = ["pytorch_synthetic_benchmark.py", "pytorch_mnist.py",
         "tensorflow2_keras_synthetic_benchmark.py", "tensorflow2_synthetic_benchmark.py",
         "tensorflow2_keras_mnist.py", "mxnet_mnist.py"]


@pytest.mark.parametrize("name", PORTS)
def test_port_changes_only_imports_and_marked_lines(name):
    original = (EXAMPLES / "upstream" / f"{name}.orig").read_text().splitlines()
    ported = (EXAMPLES / name).read_text().splitlines()
    header = next(i for i, line in enumerate(ported) if not line.startswith("#")) \
        if not original[0].startswith("#") else \
        next(i for i, line in enumerate(ported) if line == original[0])
    assert "Apache License, Version 2.0" in "\n".join(ported[:header])
    removed, added = [], []
    for line in difflib.unified_diff(original, ported[header:], lineterm="", n=0):
        if line.startswith(("---", "+++", "@@")):
            continue
        (removed if line.startswith("-") else added).append(line[1:])
    reindented = {r.strip() for r in removed}
    for line in added:
        assert ("reducerd port" in line or "reducer_client" in line
                or line.strip() in reindented or line.strip() in ("try:", "")), line
    # The horovod imports are the ones replaced.
    assert any("import horovod." in r for r in removed)
    assert not any("horovod." in a and "reducer_client" not in a and "hvd" not in a
                   for a in added)
