"""The 8-bit wires end to end: real daemons on 127.0.0.1, real worker processes.

Each worker rebuilds every rank's input, reduces its own through the daemons
with wire_dtype "int8", "fp8_e4m3" or "fp8_e5m2", and checks the result
against the float64 sum with the per-element bound of
reducer_wire.quant.ERROR_BOUND_DOC. The daemon's float32 result is not seen
by the client, so its block maxima (int8) and magnitudes (FP8) are bounded
from the exact sum plus the error before the last rounding. Chunks of 64 KiB
put several chunks on each daemon and end keys in partial blocks.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from reducer_client import ReducerClient
from reducer_wire import quant
from support import run_workers

pytestmark = pytest.mark.timeout(300)

WIRES = ("int8", "fp8_e4m3", "fp8_e5m2")
U32 = 2.0 ** -24
FP8 = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -9, 448.0), "fp8_e5m2": (2.0 ** -3, 2.0 ** -16, 57344.0)}
CASES = [("sum", 1), ("mean", 1001), ("sum", 200_003), ("mean", 200_003)]


def make_inputs(world: int, case: int, numel: int, wire: str) -> list[np.ndarray]:
    """Every rank's float32 input: magnitudes varying by segment, an outlier,
    a zero stretch; for FP8 scaled so inputs and sums stay inside its range."""
    rng = np.random.default_rng([20, case, numel])
    x = rng.standard_normal((world, numel))
    x *= 10.0 ** rng.uniform(-3, 1, (world, -(-numel // 1000))).repeat(1000, axis=1)[:, :numel]
    x[:, numel // 2] = 1e3
    x[0, : numel // 10] = 0.0
    if wire in FP8:
        x *= FP8[wire][2] / 2 / np.abs(x).sum(axis=0).max()
    return list(x.astype(np.float32))


def _block_max(values: np.ndarray) -> np.ndarray:
    """Each element's largest |value| in its 128-block of the key (chunks start on blocks)."""
    block = quant.INT8_BLOCK
    padded = np.zeros(-(-values.size // block) * block)
    padded[:values.size] = np.abs(values)
    return np.repeat(padded.reshape(-1, block).max(axis=1), block)[:values.size]


def wire_bound(inputs: list[np.ndarray], wire: str, op: str) -> np.ndarray:
    """The bound of quant.ERROR_BOUND_DOC, element by element."""
    world = len(inputs)
    wide = [x.astype(np.float64) for x in inputs]
    magnitude = sum(np.abs(x) for x in wide)
    exact = np.abs(sum(wide))
    if wire == "int8":
        def rounding(values):
            return _block_max(values) / 254 * (1 + 2.0 ** -14) + 2.0 ** -142
    else:
        u, a, _ = FP8[wire]

        def rounding(values):
            return u * np.abs(values) + a / 2
    e_in = sum(rounding(x) for x in wide)
    g = (world - 1) * U32 / (1 - (world - 1) * U32)
    before = e_in + g * (magnitude + e_in)  # error of the daemon's float32 sum
    if op == "mean":
        before = before / world + U32 * (1 + g) * (magnitude + e_in) / world
        exact = exact / world
    result_magnitude = exact + before  # bounds |y|, the daemon's float32 result
    return before + rounding(result_magnitude) + world * 2.0 ** -53 * magnitude


def quant_worker(rank: int, world: int, addresses: list[str], job: str) -> list[dict]:
    results = []
    for wire in WIRES:
        with ReducerClient(addresses, job=f"{job}-{wire}", rank=rank, world_size=world,
                           wire_dtype=wire, timeout=60, chunk_bytes=64 << 10) as client:
            for case, (op, numel) in enumerate(CASES):
                inputs = make_inputs(world, case, numel, wire)
                out = client.allreduce(inputs[rank], key=f"q/{case}", op=op)
                reference = sum(x.astype(np.float64) for x in inputs)
                if op == "mean":
                    reference /= world
                err = np.abs(out.astype(np.float64) - reference)
                results.append({"wire": wire, "op": op, "numel": numel, "dtype": str(out.dtype),
                                "ratio": float(np.max(err / wire_bound(inputs, wire, op))),
                                "max_err": float(err.max()),
                                "digest": hashlib.sha256(out.tobytes()).hexdigest()})
            # Broadcast is exact whatever the wire: it travels as float32.
            root = make_inputs(world, 99, 5000, "int8")[0] * np.float32(1 / 3)
            got = client.broadcast(root if rank == 0 else np.zeros_like(root), key="b",
                                   root_rank=0)
            results.append({"wire": wire, "broadcast_exact": bool(np.array_equal(got, root))})
    return results


@pytest.mark.parametrize("num_daemons,world_size", [(2, 2), (2, 4)])
def test_8bit_wires_against_float64_with_the_derived_bound(daemons, num_daemons, world_size):
    with daemons(num_daemons) as d:
        results = run_workers(quant_worker, world_size, (d.addresses, f"q{world_size}"),
                              timeout=240)
    for rank_results in results:
        for result in rank_results:
            if "broadcast_exact" in result:
                assert result["broadcast_exact"], result
                continue
            assert result["dtype"] == "float32"
            assert result["ratio"] <= 1.0, result
            if result["numel"] > 1:
                assert result["max_err"] > 0, result  # lossy wire: the check is not vacuous
    for i in range(len(results[0])):  # every rank got the same bytes
        assert len({r[i].get("digest") for r in results}) == 1
