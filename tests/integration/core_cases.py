"""Worker functions and the numerical oracle for the loopback integration tests.

Inputs are generated from (seed, rank, case) so every worker can rebuild all
ranks' inputs and check its result against a float64 reference itself: the
big arrays never cross process boundaries.
"""

from __future__ import annotations

import hashlib
import random
import zlib

import numpy as np
from reducer_client import ReducerClient, ReducerError

# Unit roundoff of each wire dtype: rounding to it moves a value by at most u * |value|.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}
# float16 subnormals: rounding near zero moves a value by at most half of 2^-24.
ABS_ROUNDOFF = {"float16": 2.0 ** -25, "bfloat16": 0.0, "float32": 0.0}
U32 = 2.0 ** -24


def make_input(seed: int, rank: int, case: int, numel: int, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, case])
    return rng.standard_normal(numel, dtype=np.float32).astype(dtype)


def error_bound(inputs: list[np.ndarray], reference: np.ndarray, wire_dtype: str,
                op: str) -> np.ndarray:
    """Per-element bound on |result - reference| for this pipeline.

    Each input is rounded once to the wire dtype (u_w |x_r|), the float32 sum
    of W terms adds at most (W-1) u_32 sum|x_r|, MEAN's float32 division one
    more u_32, and the result is rounded once to the wire dtype (u_w |ref|).
    The small factor covers second-order terms.
    """
    world = len(inputs)
    u_w, abs_w = UNIT_ROUNDOFF[wire_dtype], ABS_ROUNDOFF[wire_dtype]
    magnitude = np.zeros(reference.shape, dtype=np.float64)
    for x in inputs:
        magnitude += np.abs(x.astype(np.float64))
    scale = 1.0 / world if op == "mean" else 1.0
    bound = (u_w + world * U32) * magnitude * scale + (u_w + U32) * np.abs(reference)
    bound += (world * abs_w) * scale + abs_w
    return bound * 1.01


def check_allreduce(client: ReducerClient, seed: int, case: int, numel: int,
                    op: str, dtype=np.float32, shape=None) -> dict:
    """Allreduce one case and compare with the float64 reference of all ranks' inputs."""
    world, rank = client.world_size, client.rank
    inputs = [make_input(seed, r, case, numel, dtype) for r in range(world)]
    x = inputs[rank] if shape is None else inputs[rank].reshape(shape)
    out = client.allreduce(x, key=f"case/{case}", op=op)
    assert out.dtype == x.dtype and out.shape == x.shape, (out.dtype, out.shape)
    reference = sum(i.astype(np.float64) for i in inputs)
    if op == "mean":
        reference = reference / world
    bound = error_bound(inputs, reference, client.wire_dtype, op)
    if dtype == np.float16:  # the output itself is rounded to float16 once more
        bound += UNIT_ROUNDOFF["float16"] * np.abs(reference) + ABS_ROUNDOFF["float16"]
    error = np.abs(out.reshape(-1).astype(np.float64) - reference)
    ratio = float(np.max(error / bound)) if numel else 0.0
    return {"case": case, "ratio": ratio, "digest": hashlib.sha256(out.tobytes()).hexdigest(),
            "max_rel": float(np.max(error / np.maximum(np.abs(reference), 1e-3)))}


def matrix_worker(rank: int, world_size: int, addresses: list[str], cases: list[tuple],
                  job: str = "matrix") -> list[dict]:
    """Run every (wire_dtype, op, numel, dtype) case in order; one client per wire dtype."""
    results = []
    clients: dict[str, ReducerClient] = {}
    try:
        for case, (wire_dtype, op, numel, dtype) in enumerate(cases):
            client = clients.get(wire_dtype)
            if client is None:
                client = clients[wire_dtype] = ReducerClient(
                    addresses, job=f"{job}-{wire_dtype}", rank=rank, world_size=world_size,
                    wire_dtype=wire_dtype, timeout=120)
            result = check_allreduce(client, 1234, case, numel, op, np.dtype(dtype))
            results.append(result | {"wire_dtype": wire_dtype, "op": op, "numel": numel,
                                     "transports": client.transports})
    finally:
        for client in clients.values():
            client.close()
    return results


def interleaved_worker(rank: int, world_size: int, addresses: list[str], job: str,
                       rounds: int = 3) -> list[dict]:
    """Many keys in flight at once, issued in a different order on every rank."""
    sizes = [1, 3, 100, 1000, 4097, 65_536, 300_001] * 3
    results = []
    with ReducerClient(addresses, job=job, rank=rank, world_size=world_size,
                       wire_dtype="float32", chunk_bytes=64 << 10, timeout=60) as client:
        for round_ in range(rounds):
            order = list(range(len(sizes)))
            random.Random(rank * 1000 + round_).shuffle(order)
            futures = {}
            for i in order:  # per key the order is the same, across keys it is not
                x = make_input(round_, rank, i, sizes[i]) * (1 + zlib.crc32(job.encode()) % 3)
                futures[i] = client.allreduce_async(x, key=f"grad/{i}", op="sum")
            for i, future in futures.items():
                inputs = [make_input(round_, r, i, sizes[i]) * (1 + zlib.crc32(job.encode()) % 3)
                          for r in range(world_size)]
                reference = sum(x.astype(np.float64) for x in inputs)
                bound = error_bound(inputs, reference, "float32", "sum")
                out = future.result()
                results.append(float(np.max(np.abs(out - reference) / bound)))
    return results


def broadcast_worker(rank: int, world_size: int, addresses: list[str]) -> dict:
    """Broadcast float32, float16 and float64 arrays from rank 1 with a float16 wire."""
    with ReducerClient(addresses, job="bcast", rank=rank, world_size=world_size,
                       wire_dtype="float16") as client:
        values = {dtype: make_input(7, rank, 0, 10_001, dtype)
                  for dtype in (np.float32, np.float16, np.float64)}
        got = {np.dtype(d).name: client.broadcast(v, key=f"w/{np.dtype(d).name}", root_rank=1)
               for d, v in values.items()}
        root = {np.dtype(d).name: make_input(7, 1, 0, 10_001, d) for d in values}
        return {
            "float32_exact": bool(np.array_equal(got["float32"], root["float32"])),
            "float16_exact": bool(np.array_equal(got["float16"], root["float16"])),
            "float64_is_float32_rounding": bool(np.array_equal(
                got["float64"], root["float64"].astype(np.float32).astype(np.float64))),
            "dtypes": sorted(str(v.dtype) for v in got.values()),
        }


def mismatch_worker(rank: int, world_size: int, addresses: list[str]) -> dict:
    """Rank 1 sends one more element than the others; then all run a good allreduce."""
    with ReducerClient(addresses, job="mismatch", rank=rank, world_size=world_size,
                       timeout=30) as client:
        x = np.ones(100 + (rank == 1), dtype=np.float32)
        try:
            client.allreduce(x, key="bad")
            error = None
        except ReducerError as exc:
            error = (exc.code.name, str(exc))
        good = client.allreduce(np.full(10, rank + 1.0, dtype=np.float32), key="good")
        return {"error": error, "good": good.tolist()}


def silent_rank_worker(rank: int, world_size: int, addresses: list[str], silent: int,
                       ) -> dict:
    """Every rank but `silent` allreduces; return the error and how long it took."""
    import time

    if rank == silent:
        return {"silent": True}
    with ReducerClient(addresses, job="silent", rank=rank, world_size=world_size,
                       timeout=30) as client:
        start = time.monotonic()
        try:
            client.allreduce(np.ones(1000, dtype=np.float32), key="k")
            return {"error": None}
        except ReducerError as exc:
            return {"error": (exc.code.name, str(exc)), "elapsed": time.monotonic() - start}


def disagreeing_list_worker(rank: int, world_size: int, addresses: list[str],
                            rank1_settings: dict | None = None) -> dict:
    """Rank 1 lists the daemons in the other order, or (rank1_settings) cuts
    its keys otherwise: a clear error, not a stall."""
    import time

    mine = list(reversed(addresses)) if rank == 1 and not rank1_settings else list(addresses)
    settings = rank1_settings if rank == 1 and rank1_settings else {}
    with ReducerClient(mine, job="disagree", rank=rank, world_size=world_size,
                       timeout=30, **settings) as client:
        start = time.monotonic()
        try:
            client.allreduce(np.ones(1 << 20, dtype=np.float32), key="k")
            return {"error": None}
        except ReducerError as exc:
            return {"error": (exc.code.name, str(exc)), "elapsed": time.monotonic() - start}


def out_worker(rank: int, world_size: int, addresses: list[str], job: str,
               node_local: bool) -> list[str]:
    """allreduce(..., out=) into another array and in place equals a plain allreduce."""
    local = {"local_rank": rank, "local_size": world_size} if node_local else {
        "node_local": False}
    with ReducerClient(addresses, job=job, rank=rank, world_size=world_size, timeout=60,
                       **local) as client:
        x = make_input(99, rank, 0, 300_003).reshape(3, -1)
        plain = client.allreduce(x, key="plain")
        out = np.full_like(x, np.nan)
        into = client.allreduce(x, key="into", out=out)
        assert into is out
        inplace = x.copy()
        assert client.allreduce(inplace, key="inplace", out=inplace) is inplace
        for got in (into, inplace):
            assert got.shape == plain.shape and np.array_equal(got, plain)
        try:
            client.allreduce(x, key="bad", out=np.empty(x.size, dtype=x.dtype))
        except ValueError as exc:
            assert "out must be" in str(exc) and "shape (3, 100001)" in str(exc)
        else:
            raise AssertionError("an out of the wrong shape was accepted")
        return [hashlib.sha256(a.tobytes()).hexdigest() for a in (plain, into, inplace)]
