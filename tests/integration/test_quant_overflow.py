"""A sum beyond an 8-bit wire's range reaches every worker non-finite, never clipped.

Real daemons on 127.0.0.1, two worker processes, op "sum", each 8-bit wire,
and each way a daemon sums: inline on its event loop (--threads 1, the C
kernels), on its C summing threads (--threads 2 --pool-chunk-bytes 0), and
in NumPy (REDUCER_WIRE_NUMPY=1, the workers too). Each rank sends values
every wire carries (300, -300, 1, 100) whose sums E4M3 cannot carry (600,
-600: above 464), values whose sums E5M2 cannot (40000 each: 80000 is
beyond 61440), and one element only rank 1 makes too large (1e5: beyond
both FP8 formats, within int8). Every worker must get the same bits: the
reducer's definition, each contribution quantized, summed in float32, the
sum quantized (computed here with reducer_wire.quant's NumPy reference),
which is the wire's overflow where the contract says (E5M2 +-Inf, E4M3 NaN,
written positive; int8 carries float32's range).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from reducer_client import ReducerClient
from reducer_wire import dtypes, quant
from support import run_workers, running_daemons

pytestmark = pytest.mark.timeout(180)

WIRES = ("int8", "fp8_e4m3", "fp8_e5m2")
MODES = {"inline": ((), {}), "threads": (("--threads", "2", "--pool-chunk-bytes", "0"), {}),
         "numpy": ((), {"REDUCER_WIRE_NUMPY": "1"})}
# Per rank: [300, -300, 1, 100, 40000, -40000, x] with x = 1 on rank 0, 1e5 on rank 1,
# then ordinary values into a second int8 block.
NUMEL = 7 + 250


def rank_input(rank: int) -> np.ndarray:
    x = np.random.default_rng([3, rank]).uniform(-1.0, 1.0, NUMEL).astype(np.float32)
    x[:7] = [300.0, -300.0, 1.0, 100.0, 40000.0, -40000.0, 1.0 if rank == 0 else 1e5]
    return x


def _rounded(values: np.ndarray, wire: str) -> np.ndarray:
    dtype = dtypes.EIGHT_BIT_DTYPES[wire]
    data = np.empty(dtypes.wire_nbytes(dtype, values.size), np.uint8)
    quant.encode(values, dtype, data, use_c=False)
    out = np.empty(values.size, np.float32)
    quant.decode(data, dtype, out, use_c=False)
    return out


def reducer_sum(wire: str) -> np.ndarray:
    """Q(Q(x_0) + Q(x_1)): what a reducer returns by definition."""
    with np.errstate(invalid="ignore", over="ignore"):
        total = _rounded(rank_input(0), wire) + _rounded(rank_input(1), wire)
    return _rounded(total, wire)


def overflow_worker(rank: int, world: int, addresses: list[str], job: str) -> dict:
    out = {}
    for wire in WIRES:
        with ReducerClient(addresses, job=f"{job}-{wire}", rank=rank, world_size=world,
                           wire_dtype=wire, timeout=30) as client:
            got = client.allreduce(rank_input(rank), key="k", op="sum")
            out[wire] = (got, hashlib.sha256(got.tobytes()).hexdigest())
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_sums_beyond_the_range_arrive_non_finite_on_every_rank(tmp_path, monkeypatch, mode):
    args, env = MODES[mode]
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the daemons' and the workers' environment
    with running_daemons(2, *args, log_dir=tmp_path, round_timeout=30) as d:
        results = run_workers(overflow_worker, 2, (d.addresses, f"ovf-{mode}"), timeout=120)
    for wire in WIRES:
        (got, digest), (_, other) = results[0][wire], results[1][wire]
        assert digest == other, (mode, wire)  # every rank the same bits
        want = reducer_sum(wire)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), (mode, wire, got[:7])
        assert np.array_equal(got[~nan], want[~nan]), (mode, wire, got[:7], want[:7])
        assert np.array_equal(np.signbit(got), np.signbit(want)), (mode, wire)
        head = got[:7]
        if wire == "int8":  # float32's range: everything carried
            assert np.isfinite(got).all(), (mode, head)
        elif wire == "fp8_e5m2":  # 600, -600, 2, 200 carried; the rest Inf with its sign
            assert np.isfinite(head[:4]).all(), (mode, head)
            assert head[4:].tolist() == [np.inf, -np.inf, np.inf], (mode, head)
        else:  # E4M3 has no infinity: its overflow is NaN, always positive
            assert np.isnan(head[[0, 1, 4, 5, 6]]).all(), (mode, head)
            assert not np.signbit(head[[0, 1, 4, 5, 6]]).any(), (mode, head)
            assert np.isfinite(head[[2, 3]]).all(), (mode, head)
        assert np.isfinite(got[7:]).all(), (mode, wire)  # the ordinary values
