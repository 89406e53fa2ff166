"""Worker functions for the fault tests (module level: spawned workers import them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
from reducer_client import ReducerClient, ReducerError

PARAMS = 300_001  # a few chunks per daemon with 256 KiB chunks


def gradient(params: np.ndarray, rank: int, step: int) -> np.ndarray:
    """A deterministic, parameter-dependent 'gradient' (any double count shows).

    Quantized to multiples of 2^-12 below 8 in magnitude, so float32 sums of a
    few of them are exact in any order: runs can be compared bit for bit.
    """
    rng = np.random.default_rng([rank, step])
    raw = 0.1 * params + rng.standard_normal(params.size).astype(np.float32)
    return (np.round(np.clip(raw, -7, 7) * 4096) / 4096).astype(np.float32)


def training_worker(rank: int, world_size: int, addresses: list[str], steps: int,
                    progress_dir: str, step_sleep_s: float = 0.0) -> bytes:
    """SGD on a flat float32 vector; writes its step to progress_dir/rank."""
    params = np.zeros(PARAMS, dtype=np.float32)
    progress = Path(progress_dir) / str(rank)
    with ReducerClient(addresses, job="train", rank=rank, world_size=world_size,
                       wire_dtype="float32", chunk_bytes=256 << 10, timeout=60) as client:
        for step in range(steps):
            grad = client.allreduce(gradient(params, rank, step), key="grads", op="sum")
            params -= np.float32(0.01) * grad
            progress.write_text(str(step))
            time.sleep(step_sleep_s)
        reconnects = sum(link.reconnects for link in client._links)
    return params.tobytes() + reconnects.to_bytes(4, "little")


def suicidal_worker(rank: int, world_size: int, addresses: list[str], victim: int,
                    round_timeout_s: float) -> dict:
    """All ranks do one good round; then `victim` dies (SIGKILL) mid-round.
    The Python path (REDUCER_CLIENT_C_LOOP=0): the victim's half-sent round is
    made by muting one DaemonLink, which the C loop would not go through."""
    with ReducerClient(addresses, job="kill", rank=rank, world_size=world_size,
                       timeout=30, environ={"REDUCER_CLIENT_C_LOOP": "0"}) as client:
        x = np.ones(1 << 20, dtype=np.float32)
        client.allreduce(x, key="grads")
        if rank == victim:
            # Die with the round half sent: daemon 0 gets our chunks, daemon 1 never.
            client._links[1].send = lambda *args: None
        future = client.allreduce_async(x, key="grads")
        if rank == victim:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            future.result()
            return {"error": None}
        except ReducerError as exc:
            return {"error": (exc.code.name, str(exc)), "elapsed": time.monotonic() - start}


def outlive_daemon_worker(rank: int, world_size: int, addresses: list[str],
                          progress_dir: str) -> dict:
    """Keep allreducing after the daemons are killed for good: must fail in time."""
    progress = Path(progress_dir) / str(rank)
    with ReducerClient(addresses, job="gone", rank=rank, world_size=world_size,
                       timeout=3) as client:
        x = np.ones(1000, dtype=np.float32)
        client.allreduce(x, key="k")
        progress.write_text("ready")
        while not (Path(progress_dir) / "killed").exists():
            time.sleep(0.05)
        start = time.monotonic()
        try:
            client.allreduce(x, key="k")
            return {"error": None}
        except ReducerError as exc:
            return {"error": (exc.code.name, str(exc)), "elapsed": time.monotonic() - start}


# `python -c FAULTY_DAEMON FAULT reducerd-args...`: a daemon whose own code
# raises for job "boom" in one place, FAULT: "shard_in" or "delivered" (the
# metrics observer) or "contribute" (the reduction table); other jobs work.
FAULTY_DAEMON = """
import sys
from reducerd.core import reduction
from reducerd.ops import metrics
from reducerd.__main__ import main

FAULT = sys.argv.pop(1)


def raising_for_boom(original, job_of):
    def method(self, *args):
        if job_of(*args) == "boom":
            raise RuntimeError(f"injected fault in {FAULT}")
        return original(self, *args)
    return method


if FAULT == "shard_in":
    metrics.Metrics.shard_in = raising_for_boom(metrics.Metrics.shard_in, lambda job, *_: job)
elif FAULT == "delivered":
    metrics.Metrics.delivered = raising_for_boom(metrics.Metrics.delivered,
                                                 lambda d: d.chunk.job)
elif FAULT == "contribute":
    reduction.ReductionTable.contribute = raising_for_boom(
        reduction.ReductionTable.contribute, lambda chunk, *_: chunk.job)
else:
    raise SystemExit(f"unknown fault {FAULT!r}")
sys.exit(main(sys.argv[1:]))
"""
