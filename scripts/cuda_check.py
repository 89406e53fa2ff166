"""The CUDA paths on a GPU machine, in one prepared run (scripts/cuda_check.sh sets it up).

    python scripts/cuda_check.py OUT_DIR [--quick]

1. The machine: GPU, driver, torch, CPU model.
2. tests/cuda: the DDP hook and the DistributedOptimizer on CUDA tensors
   against DDP over Gloo on the same GPU; exact broadcasts, allreduce and
   allgather of CUDA tensors (pytest, real daemons, two workers on one GPU).
3. Horovod's pytorch_synthetic_benchmark.py (the import changed), a real
   torchvision ResNet-50 on CUDA through the DistributedOptimizer: 1 and 2
   ranks, float32 and float16 wire.
4. `reducerd bench --train MODEL --device cuda`: each layer's FLOPs computed
   on the GPU for real, reducerd's hook and optimizer beside DDP over Gloo
   (float32 and float16), JSON into OUT_DIR.

Each part runs under its own time limit and the script goes on after a
failure; it exits 1 if any part failed. Output: OUT_DIR/cuda_check.log and
the bench JSON files.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Log:
    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def run(log: Log, title: str, argv: list[str], limit_s: float,
        env: dict[str, str] | None = None) -> tuple[bool, str]:
    log(f"\n=== {title}\n$ {' '.join(argv)}")
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
                              env=dict(os.environ, **(env or {})))
        out, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as exc:
        out = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMED OUT after {limit_s} s"
        ok = False
    log(out.rstrip()[-6000:])
    log(f"--- {title}: {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.1f} s")
    return ok, out


def machine(log: Log) -> None:
    import torch

    log(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"device {torch.cuda.get_device_name(0)}, python {sys.version.split()[0]}")
    cpu = subprocess.run(["sh", "-c", "lscpu | grep -E 'Model name|^CPU\\(s\\)'"],
                         capture_output=True, text=True).stdout
    log(cpu.strip())
    from reducer_wire import convert

    try:
        import reducerd.core._sumpool  # noqa: F401
        pool = "C"
    except ImportError:
        pool = "Python"
    log(f"reducer_wire C kernels: {convert.accelerated()}; the daemon's summing pool: {pool}")


def horovod_example(log: Log, world: int, fp16: bool, batches: int) -> bool:
    from reducerd.ops.local import running_daemons

    script = ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"
    argv = [sys.executable, str(script), "--model", "resnet50", "--batch-size", "64",
            "--num-warmup-batches", "3", "--num-batches-per-iter", str(batches),
            "--num-iters", "3"] + (["--fp16-allreduce"] if fp16 else [])
    title = f"Horovod synthetic benchmark, resnet50, {world} rank(s), fp16={fp16}"
    log(f"\n=== {title}")
    with running_daemons(2, log_dir=Path(os.environ.get("TMPDIR", "/tmp"))) as daemons:
        job = uuid.uuid4().hex
        procs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, REDUCER_ADDRESSES=",".join(
                                      daemons.addresses), REDUCER_JOB=job,
                                      REDUCER_RANK=str(rank), REDUCER_WORLD_SIZE=str(world),
                                      REDUCER_TIMEOUT="120"))
                 for rank in range(world)]
        outputs, ok = [], True
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += "\nTIMED OUT"
            outputs.append(out)
            ok = ok and proc.returncode == 0
    log(outputs[0].rstrip()[-3000:])
    for rank, out in enumerate(outputs[1:], start=1):
        if "Error" in out or "Traceback" in out:
            log(f"rank {rank}:\n{out.rstrip()[-3000:]}")
    found = re.search(r"Total img/sec on \d+ GPU\(s\): ([\d.]+)", outputs[0])
    log(f"--- {title}: {'ok' if ok and found else 'FAILED'}"
        + (f", {found.group(1)} img/s in total" if found else ""))
    return bool(ok and found)


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    quick = "--quick" in argv
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Log(out_dir / "cuda_check.log")
    failed = []
    machine(log)
    ok, _ = run(log, "tests/cuda", [sys.executable, "-m", "pytest", "-q", "-s", "-p",
                                    "no:cacheprovider", "tests/cuda"], 200)
    if not ok:
        failed.append("tests/cuda")
    bench = [sys.executable, "-m", "reducerd", "bench", "--device", "cuda",
             "--systems", "reducerd-ddp,reducerd-optimizer,gloo-ddp-float32,gloo-ddp-float16",
             "--stall-timeout", "120"]
    for world, fp16 in ((1, False), (2, False), (2, True)):
        try:
            ok = horovod_example(log, world, fp16, 5)
        except Exception as exc:  # a daemon that did not start: the next part still runs
            log(f"--- horovod {world} rank(s) fp16={fp16}: FAILED: {exc!r}")
            ok = False
        if not ok:
            failed.append(f"horovod-{world}-fp16={fp16}")
    runs = [("bert-large", "100", "1,2,4"), ("bert-large", "10", "1,4"),
            ("resnet50", "1", "1,4")]
    for model, scale, workers in runs[:1] if quick else runs:
        name = f"train-{model}-s{scale}"
        ok, _ = run(log, name, bench + ["--train", model, "--byte-scale", scale, "--workers",
                                        workers, "--steps", "10", "--comm-steps", "3",
                                        "--json", str(out_dir / f"{name}.json")], 150)
        if not ok:
            failed.append(name)
    log(f"\nFAILED: {', '.join(failed)}" if failed else "\nALL PARTS OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
