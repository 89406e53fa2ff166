"""Worker side of each system: one allreduce of a flat float32 gradient, four ways.

reducerd twice: the core's allreduce(out=) and a DDP bucket through the
PyTorch shim's comm hook (the path a DDP user takes), then Gloo and MXNet.
"reducerd-float16" etc. are the core's path again over that wire dtype.

A `Comm` hides how one system allreduces; `run_sweep` times any of them the
same way. Frameworks are imported inside the constructors, so this module
loads in either virtual environment (the MXNet one has no grpc or torch).

Every rank holds the value 1 + rank % 4 in every element, so the sum is a
small integer, exact in float16 for any worker count the bench allows, and
each result is checked exactly after the timed iterations (on reducerd's
8-bit wires within their derived bound instead, _allowed_error).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from reducerd.bench.comm import Comm
from reducerd.bench.config import REDUCERD_SYSTEMS, REDUCERD_WIRE_BASELINES, TCP_FLOOR_SYSTEMS
from reducerd.bench.netns import read_counters

__all__ = ["Comm", "make_comm", "run_sweep", "rank_value"]

# How many barriers the byte-count calibration averages over.
_CALIBRATION_BARRIERS = 7


def rank_value(rank: int) -> int:
    return 1 + rank % 4


def _expected(world_size: int) -> int:
    return sum(rank_value(r) for r in range(world_size))


# reducer_wire.quant.ERROR_BOUND_DOC: the relative error of rounding one
# value to an 8-bit wire. int8: 1/254 (1 + 2^-14) of the block's largest
# |value|, which is the value itself here (a rank's elements are all equal);
# FP8: the unit roundoff. The values are >= 1, so the bound's subnormal
# terms vanish (and they stay below E4M3's 448 up to 112 ranks).
_EIGHT_BIT_REL = {"int8": (1 + 2 ** -14) / 254, "fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3}


def _allowed_error(spec: dict[str, Any], expected: int) -> float:
    """How far a result may be from `expected`: 0 but on reducerd's 8-bit wires.

    There: each positive contribution rounded (rel of S in all), the float32
    sum of N (g), the hook's division by N (2^-24), the result rounded (rel).
    """
    rel = _EIGHT_BIT_REL.get(spec["wire_dtype"])  # the system's own wire dtype
    if rel is None or spec["system"] not in REDUCERD_SYSTEMS:
        return 0.0
    n = spec["world_size"]
    g = (n - 1) * 2.0 ** -24 / (1 - (n - 1) * 2.0 ** -24)
    inner = rel + g * (1 + rel) + 2.0 ** -24 * (1 + g) * (1 + rel)
    return (inner + rel * (1 + inner)) * expected


def _reducer_client(spec: dict[str, Any]) -> Any:
    from reducer_client import ReducerClient

    # Node-local aggregation reads REDUCER_LOCAL_RANK/SIZE, which the runner
    # sets for every worker.
    return ReducerClient(
        addresses=spec["addresses"], job=spec["job"], rank=spec["rank"],
        world_size=spec["world_size"], wire_dtype=spec["wire_dtype"],
        timeout=spec["stall_timeout_s"], chunk_bytes=spec.get("chunk_bytes"),
        link_gbit=spec.get("link_gbit"))


class ReducerdComm(Comm):
    """ReducerClient.allreduce of the float32 array (casts to the wire dtype inside)."""

    def __init__(self, spec: dict[str, Any], client: Any = None) -> None:
        self.client = _reducer_client(spec) if client is None else client
        self.rank = spec["rank"]
        self._token = np.zeros(1, dtype=np.float32)

    def prepare(self, numel: int) -> None:
        self.key = f"bench/{numel}"
        self.values = np.full(numel, rank_value(self.rank), dtype=np.float32)
        self.x = self.values.copy()
        # The result goes into one buffer for all iterations, as Gloo and MXNet
        # reduce into theirs: no fresh 64 MiB to page in per call.
        self.out = np.empty_like(self.x)

    def refill(self) -> None:
        # The input is written before each call, as a backward pass writes the
        # gradients and as every other system's refill does: an input left
        # untouched from call to call took 7 % less time (clean cache lines,
        # no write-backs), a state no training step has.
        np.copyto(self.x, self.values)

    def run(self) -> None:
        self.client.allreduce(self.x, key=self.key, out=self.out)

    def result(self) -> np.ndarray:
        return self.out

    def barrier(self) -> None:
        self.client.allreduce(self._token, key="bench/barrier")

    def close(self) -> None:
        self.client.close()


class _Bucket:
    """What reducer_client.torch.allreduce_hook calls on DDP's dist.GradBucket."""

    def __init__(self, index: int, buffer: Any) -> None:
        self._index, self._buffer = index, buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> Any:
        return self._buffer

    def parameters(self) -> list[Any]:
        return []  # join() would copy them from the last joiner; the bench never joins


class CoreMeanComm(ReducerdComm):
    """The core's allreduce(op="mean", out=) of what DdpHookComm's bucket holds,
    on DdpHookComm's client: the reference the hook is paired with."""

    def __init__(self, spec: dict[str, Any], client: Any) -> None:
        super().__init__(spec, client)
        self.world_size = spec["world_size"]

    def prepare(self, numel: int) -> None:
        super().prepare(numel)
        self.values *= self.world_size  # the mean is then the core path's sum

    def run(self) -> None:
        self.client.allreduce(self.x, key=self.key, op="mean", out=self.out)


class DdpHookComm(ReducerdComm):
    """A float32 DDP bucket through reducer_client.torch.allreduce_hook, as DDP calls it.

    The hook averages the bucket in place (DDP's default is a mean), so each
    rank fills it with world_size times its value: the mean is the core
    path's sum, a small integer exact in float16 (up to 4 * 512 ranks). The
    timed region is the hook call and the wait for its future, what DDP's
    backward pays for the bucket; refill() restores the bucket outside it.

    `reference` is the same reduction through the core (CoreMeanComm):
    run_sweep times it in every iteration beside the hook, in alternating
    order, so the hook's cost over the core is measured against the same
    daemons at the same moment, not against another phase of the run.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        import reducer_client.torch as rt
        import torch

        super().__init__(spec)
        self.torch, self.hook = torch, rt.allreduce_hook
        self.world_size = spec["world_size"]
        self.reference = CoreMeanComm(spec, self.client)

    def prepare(self, numel: int) -> None:
        self.src = self.torch.full((numel,), float(rank_value(self.rank) * self.world_size),
                                   dtype=self.torch.float32)
        self.bucket = _Bucket(0, self.src.clone())
        self.reference.prepare(numel)

    def refill(self) -> None:
        self.bucket.buffer().copy_(self.src)
        self.reference.refill()

    def run(self) -> None:
        # _Bucket stands in for dist.GradBucket: it has what the hook calls.
        self.hook(self.client, self.bucket).wait()  # type: ignore[arg-type]

    def result(self) -> np.ndarray:
        return self.bucket.buffer().numpy()


class GlooComm(Comm):
    """torch.distributed all_reduce over Gloo; float16 as DDP's fp16_compress_hook does it.

    float32: the bucket is reduced in place. float16: cast to float16, reduce,
    copy back into the float32 bucket; the casts are timed, as in the hook.
    """

    def __init__(self, spec: dict[str, Any], dtype: str) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.half = torch, dist, dtype == "float16"
        self.rank = spec["rank"]
        dist.init_process_group(
            "gloo", init_method=f"tcp://{spec['master']}", rank=spec["rank"],
            world_size=spec["world_size"],
            timeout=datetime.timedelta(seconds=spec["stall_timeout_s"]))

    def prepare(self, numel: int) -> None:
        self.src = self.torch.full((numel,), float(rank_value(self.rank)),
                                   dtype=self.torch.float32)
        self.bucket = self.src.clone()

    def refill(self) -> None:
        self.bucket.copy_(self.src)

    def run(self) -> None:
        if self.half:
            compressed = self.bucket.to(self.torch.float16)
            self.dist.all_reduce(compressed)
            self.bucket.copy_(compressed)
        else:
            self.dist.all_reduce(self.bucket)

    def result(self) -> np.ndarray:
        return self.bucket.numpy()

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


class MxnetComm(Comm):
    """MXNet KVStore dist_sync (ps-lite): push then pull, as Gluon's Trainer does.

    On CPU the store sums into the pushed array itself, so refill() restores
    it before every iteration, outside the timed region. The array is in the
    pushed dtype; float16 input is cast from float32 outside the timed region
    (ps-lite has no cast of its own to time).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        import mxnet as mx

        self.mx, self.dtype, self.rank = mx, spec["mxnet_dtype"], spec["rank"]
        self.kv = mx.kv.create("dist_sync")
        self._token = mx.nd.zeros((1,), dtype="float32")
        self.kv.init("bench/barrier", self._token)

    def prepare(self, numel: int) -> None:
        self.key = f"bench/{numel}"
        self.kv.init(self.key, self.mx.nd.zeros((numel,), dtype=self.dtype))
        self.src = np.full(numel, rank_value(self.rank), dtype=self.dtype)
        self.x = self.mx.nd.array(self.src, dtype=self.dtype)

    def refill(self) -> None:
        self.x[:] = self.src
        self.x.wait_to_read()

    def run(self) -> None:
        self.kv.push(self.key, self.x)
        self.kv.pull(self.key, out=self.x)
        self.x.wait_to_read()

    def result(self) -> np.ndarray:
        return self.x.asnumpy().astype(np.float32)

    def barrier(self) -> None:
        # kv._barrier() is ps-lite's worker barrier (no data moves).
        self.kv._barrier()

    def close(self) -> None:
        self.mx.nd.waitall()


def make_comm(spec: dict[str, Any]) -> Comm:
    system = spec["system"]
    if system == "reducerd" or system in REDUCERD_WIRE_BASELINES:
        return ReducerdComm(spec)  # "reducerd-float16" etc.: over spec["wire_dtype"]
    if system == "reducerd-ddp-hook":
        return DdpHookComm(spec)
    if system in ("gloo-float32", "gloo-float16"):
        return GlooComm(spec, system.removeprefix("gloo-"))
    if system == "mxnet-ps":
        return MxnetComm(spec)
    if system in TCP_FLOOR_SYSTEMS:
        from reducerd.bench.floor import FloorComm

        return FloorComm(spec)
    raise ValueError(f"unknown system {system!r}")


def _calibrate_barrier_bytes(comm: Comm, iface: str) -> tuple[float, float]:
    """(received, sent) bytes of one barrier, subtracted from each iteration.

    The median of several single barriers: stray traffic at start-up (a late
    connection, a framework's own handshake) must not be charged to every
    iteration.
    """
    comm.barrier()
    samples = []
    for _ in range(_CALIBRATION_BARRIERS):
        rx0, tx0 = read_counters(iface)
        comm.barrier()
        rx1, tx1 = read_counters(iface)
        samples.append((rx1 - rx0, tx1 - tx0))
    return (float(np.median([s[0] for s in samples])),
            float(np.median([s[1] for s in samples])))


def run_sweep(comm: Comm, spec: dict[str, Any], emit: Callable[..., None]) -> None:
    """Time warm-up + timed iterations of every size; emit one record per size.

    Each iteration starts after a barrier and is timed on this rank alone
    (the runner takes the slowest rank). With an interface to count, the
    counters are read before that barrier (no rank can have started yet) and
    after a second barrier that follows the allreduce (every rank is done);
    two barriers' bytes are subtracted.
    """
    iface = spec.get("iface")
    barrier_rx, barrier_tx = _calibrate_barrier_bytes(comm, iface) if iface else (0, 0)
    expected = _expected(spec["world_size"])
    allowed = _allowed_error(spec, expected)
    reference: Comm | None = getattr(comm, "reference", None)
    for size_bytes in spec["sizes_bytes"]:
        comm.prepare(size_bytes // 4)
        times_s: list[float] = []
        reference_s: list[float] = []
        received: list[float] = []
        sent: list[float] = []
        for it in range(spec["warmup"] + spec["iters"]):
            comm.refill()
            # The reference goes first in odd iterations, second in even ones,
            # and is left out of the byte counts (a barrier ends it first).
            if reference is not None and it % 2:
                reference_s.append(_timed(reference, barrier_after=bool(iface)))
            if iface:  # before the barrier: a node's other ranks may start right after it
                rx0, tx0 = read_counters(iface)
            elapsed = _timed(comm, barrier_after=bool(iface))
            if iface:
                rx1, tx1 = read_counters(iface)
            if reference is not None and not it % 2:
                reference_s.append(_timed(reference, barrier_after=False))
            if it >= spec["warmup"]:
                times_s.append(elapsed)
                if iface:
                    received.append(rx1 - rx0 - 2 * barrier_rx)
                    sent.append(tx1 - tx0 - 2 * barrier_tx)
            emit("iter", size_bytes=size_bytes, iteration=it)
        label = f"{spec['system']} {size_bytes} bytes"
        comm.check(size_bytes // 4, expected, allowed, label)
        if reference is not None:
            reference.check(size_bytes // 4, expected, allowed, f"{label}, the core beside it")
        emit("size", size_bytes=size_bytes, times_s=times_s,
             reference_times_s=reference_s[spec["warmup"]:] or None,
             bytes_received=received or None, bytes_sent=sent or None)


def _timed(comm: Comm, barrier_after: bool) -> float:
    """Seconds of one comm.run() on this rank, started after a barrier."""
    comm.barrier()
    start = time.perf_counter()
    comm.run()
    elapsed = time.perf_counter() - start
    if barrier_after:
        comm.barrier()
    return elapsed
