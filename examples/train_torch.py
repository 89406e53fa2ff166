"""Train a small PyTorch model with N workers through reducerd, via reducer_client.torch.

The daemons must be running; say where with REDUCER_ADDRESSES (and, if you
like, REDUCER_JOB, REDUCER_WIRE_DTYPE, REDUCER_TIMEOUT, REDUCER_TOKEN).

    # launch N workers on this machine (each gets REDUCER_RANK / REDUCER_WORLD_SIZE)
    REDUCER_ADDRESSES=127.0.0.1:50051,127.0.0.1:50052 python examples/train_torch.py --workers 2

    # or run one worker, started by your own launcher (REDUCER_RANK and
    # REDUCER_WORLD_SIZE set, or torchrun's RANK and WORLD_SIZE)
    python examples/train_torch.py

Each worker holds its share of a synthetic classification set and trains a
two-layer network with rt.DistributedOptimizer (gradients averaged during
backward), after rt.broadcast_parameters / rt.broadcast_optimizer_state.
Rank 0 prints the loss averaged over all workers every few steps, the
step time and gradient throughput, and at the end a plain rt.allreduce
benchmark. Exit status 0 when every worker finished.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

FEATURES, CLASSES, SAMPLES = 256, 10, 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=0,
                        help="launch this many local workers (default: run one worker, "
                             "rank and world size from the environment)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128, help="per worker")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--bench-mib", type=float, default=16.0,
                        help="size of the float32 tensor of the final allreduce benchmark "
                             "(0 to skip)")
    return parser.parse_args(argv)


def launch(args: argparse.Namespace) -> int:
    """Start args.workers copies of this script as ranks 0..N-1; wait for all."""
    if "REDUCER_ADDRESSES" not in os.environ:
        print("set REDUCER_ADDRESSES=HOST:PORT,... (the running reducerd daemons)",
              file=sys.stderr)
        return 2
    worker_argv = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                   if name != "workers"]
    env = {**os.environ, "REDUCER_WORLD_SIZE": str(args.workers)}
    env.setdefault("REDUCER_JOB", f"train-torch-{os.getpid()}")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *worker_argv],
                              env={**env, "REDUCER_RANK": str(rank)})
             for rank in range(args.workers)]
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait())
            if codes[-1] != 0:
                break  # one failed: the others would only wait for their timeout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if failed:
        print(f"worker(s) {failed} failed", file=sys.stderr)
        return 1
    return 0


def train(args: argparse.Namespace) -> None:
    """One worker: rank and world size from the environment (rt.init())."""
    import reducer_client.torch as rt
    import torch
    from torch import nn

    torch.set_num_threads(1)
    reducer = rt.init()
    rank, world_size = rt.rank(), rt.size()

    # A synthetic data set, the same on every worker; each trains on its share.
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=gen)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    inputs = centers[labels] + 6.0 * torch.randn(SAMPLES, FEATURES, generator=gen)
    share = slice(rank * SAMPLES // world_size, (rank + 1) * SAMPLES // world_size)
    inputs, labels = inputs[share], labels[share]

    torch.manual_seed(rank)  # different on purpose: broadcast_parameters fixes it
    model = nn.Sequential(nn.Linear(FEATURES, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, CLASSES))
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr,
                                                  momentum=0.9),
                                  named_parameters=model.named_parameters())
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(opt, root_rank=0)

    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wire = getattr(reducer, "wire_dtype", "?")
    if rank == 0:
        print(f"{world_size} workers, {grad_bytes / 2**20:.2f} MiB of float32 gradients "
              f"per step, {wire} on the wire", flush=True)
    step_s: list[float] = []
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, args.steps + 1):
        index = torch.randint(0, inputs.shape[0], (args.batch_size,), generator=gen)
        start = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs[index]), labels[index])
        loss.backward()
        opt.step()
        step_s.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.steps:
            mean_loss = rt.allreduce(loss.detach(), name="loss").item()
            if rank == 0:
                recent = statistics.median(step_s[-args.log_every:])
                print(f"step {step:4d}  loss {mean_loss:.4f}  step {recent * 1e3:6.1f} ms  "
                      f"gradients {grad_bytes / recent / 2**20:7.1f} MiB/s", flush=True)

    if args.bench_mib > 0:
        tensor = torch.randn(int(args.bench_mib * 2**20 / 4))
        rt.allreduce(tensor, name="bench")  # warm-up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            rt.allreduce(tensor, name="bench")
            times.append(time.perf_counter() - start)
        best = min(times)
        if rank == 0:
            print(f"allreduce of {args.bench_mib:g} MiB float32 ({wire} on the wire): "
                  f"{best * 1e3:.1f} ms, {args.bench_mib / best:.0f} MiB/s per worker",
                  flush=True)
    rt.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workers:
        return launch(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
