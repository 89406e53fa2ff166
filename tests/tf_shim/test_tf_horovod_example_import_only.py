"""Horovod's tensorflow2_synthetic_benchmark.py with its import line changed
and nothing else (examples/horovod/ keeps a port with the Keras 3 edit
marked; this checks the edit is no longer needed): 2 ranks, 2 real daemons."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from support import collect_outputs, running_daemons  # noqa: E402

UPSTREAM = (Path(__file__).resolve().parents[2] / "examples" / "horovod" / "upstream"
            / "tensorflow2_synthetic_benchmark.py.orig")
TIMEOUT_S = 240


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_synthetic_benchmark_runs_by_the_import_change_alone(tmp_path):
    source = UPSTREAM.read_text()
    assert source.count("import horovod.tensorflow as hvd") == 1
    script = tmp_path / "benchmark.py"
    script.write_text(source.replace("import horovod.tensorflow as hvd",
                                     "import reducer_client.tensorflow as hvd"))
    args = ["--model", "MobileNetV3Small", "--batch-size", "2", "--num-warmup-batches", "1",
            "--num-batches-per-iter", "1", "--num-iters", "1", "--no-cuda"]
    with running_daemons(2, log_dir=tmp_path) as daemons:
        job = uuid.uuid4().hex
        procs = [subprocess.Popen(
            [sys.executable, str(script), *args], cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, REDUCER_ADDRESSES=",".join(daemons.addresses),
                     REDUCER_JOB=job, REDUCER_RANK=str(rank), REDUCER_WORLD_SIZE="2",
                     REDUCER_TIMEOUT="60", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
                     CUDA_VISIBLE_DEVICES=""))
            for rank in range(2)]
        outputs = collect_outputs(procs, TIMEOUT_S)
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{out[-3000:]}"
    assert "Total img/sec on 2 CPU(s)" in outputs[0]
