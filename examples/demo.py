"""make demo: 2 reducer daemons on 127.0.0.1, 2 workers training a small model.

With PyTorch installed (the .venv of `make demo` has it), the workers run
examples/train_torch.py: a small network trained with
reducer_client.torch.DistributedOptimizer, gradients averaged through the
daemons in float16. Without PyTorch (or with --numpy) each worker trains the
same kind of network written in NumPy and averages its flat gradient with
ReducerClient directly. Rank 0 prints the loss every few steps and the
reduction throughput. Everything the demo starts is stopped before it exits.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from reducerd.ops.local import running_daemons

WORKERS, DAEMONS, STEPS, HIDDEN = 2, 2, 60, 512
FEATURES, CLASSES, SAMPLES = 256, 10, 4096


def make_data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((CLASSES, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, SAMPLES)
    x = centers[labels] + 2.0 * rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    share = slice(rank * SAMPLES // WORKERS, (rank + 1) * SAMPLES // WORKERS)
    return x[share], labels[share]


def worker(rank: int, addresses: list[str], report: mp.Queue) -> None:
    from reducer_client import ReducerClient

    x, y = make_data(rank)
    rng = np.random.default_rng(42)  # same initial weights on every worker
    w1 = rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) / np.sqrt(FEATURES)
    w2 = rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32) / np.sqrt(HIDDEN)
    params = [w1, w2]
    lr, batch = 0.1, 128
    reduce_s, reduced_bytes = 0.0, 0
    with ReducerClient(addresses, job="demo", rank=rank, world_size=WORKERS,
                       wire_dtype="float16") as client:
        for step in range(STEPS):
            idx = rng.integers(0, len(x), batch)
            xb, yb = x[idx], y[idx]
            h = np.maximum(xb @ w1, 0)
            logits = h @ w2
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            loss = -np.mean(np.log(p[np.arange(batch), yb] + 1e-9))
            dlogits = p
            dlogits[np.arange(batch), yb] -= 1
            dlogits /= batch
            grads = [xb.T @ ((dlogits @ w2.T) * (h > 0)), h.T @ dlogits]
            flat = np.concatenate([g.ravel() for g in grads])
            start = time.perf_counter()
            flat = client.allreduce(flat, key="grads", op="mean")
            reduce_s += time.perf_counter() - start
            reduced_bytes += flat.nbytes
            offset = 0
            for p_ in params:
                p_ -= lr * flat[offset:offset + p_.size].reshape(p_.shape)
                offset += p_.size
            global_loss = client.allreduce(np.array([loss]), key="loss", op="mean")[0]
            if rank == 0 and (step % 10 == 0 or step == STEPS - 1):
                print(f"step {step:3d}  loss {global_loss:.4f}", flush=True)
    report.put((rank, reduce_s, reduced_bytes, float(np.abs(w1).sum() + np.abs(w2).sum())))


def run_torch_workers(addresses: list[str]) -> int:
    script = Path(__file__).resolve().parent / "train_torch.py"
    env = {**os.environ, "REDUCER_ADDRESSES": ",".join(addresses), "REDUCER_JOB": "demo",
           "REDUCER_WIRE_DTYPE": "float16", "OMP_NUM_THREADS": "1"}
    print(f"daemons: {', '.join(addresses)}; {WORKERS} PyTorch workers "
          "(reducer_client.torch.DistributedOptimizer), float16 wire", flush=True)
    return subprocess.run([sys.executable, str(script), "--workers", str(WORKERS),
                           "--steps", "60"], env=env, timeout=600).returncode


def main() -> int:
    use_torch = "--numpy" not in sys.argv and importlib.util.find_spec("torch") is not None
    with tempfile.TemporaryDirectory(prefix="reducerd-demo-") as tmp, \
            running_daemons(DAEMONS, log_dir=Path(tmp)) as daemons:
        if use_torch:
            return run_torch_workers(daemons.addresses)
        return run_numpy_workers(daemons.addresses)


def run_numpy_workers(addresses: list[str]) -> int:
    print(f"daemons: {', '.join(addresses)}; {WORKERS} workers, "
          f"{FEATURES * HIDDEN + HIDDEN * CLASSES:,} parameters, float16 wire")
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    workers = [ctx.Process(target=worker, args=(r, addresses, report)) for r in range(WORKERS)]
    for w in workers:
        w.start()
    results = sorted(report.get(timeout=300) for _ in workers)
    for w in workers:
        w.join(30)
    if any(w.exitcode != 0 for w in workers):
        print("a worker failed", file=sys.stderr)
        return 1
    checksums = {round(r[3], 3) for r in results}
    _, seconds, nbytes, _ = results[0]
    print(f"reduction throughput: {nbytes / seconds / 1e6:.1f} MB/s of float32 "
          f"gradient per worker ({STEPS} allreduces of {nbytes // STEPS:,} bytes, "
          f"{seconds / STEPS * 1e3:.1f} ms each)")
    print("workers agree on the weights" if len(checksums) == 1
          else f"weights differ between workers: {checksums}")
    return 0 if len(checksums) == 1 else 1

if __name__ == "__main__":
    sys.exit(main())
