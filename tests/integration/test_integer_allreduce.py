"""Integer allreduce is exact: each integer dtype travels as itself, the
daemons sum in int64 and the result wraps around to the dtype's width, as the
dtype's own addition does (Horovod's sum over MPI or Gloo).

The reference is NumPy's addition in the dtype itself (wrapping), so a
result rounded through float32 anywhere (2^24 and beyond are not all
float32s) or saturated instead of wrapped differs in some element.
"""

import numpy as np
import pytest
from integer_cases import INTEGER_DTYPES, integer_worker, rank_values
from support import run_workers

NUMEL = 100_000  # several chunks a key on each daemon


@pytest.mark.timeout(180)
def test_integer_sums_are_exact_and_wrap_as_the_dtype_does(daemons):
    with daemons(2, round_timeout=30) as d:
        results = run_workers(integer_worker, 2, (d.addresses, NUMEL), timeout=150)
    for dtype in INTEGER_DTYPES:
        with np.errstate(over="ignore"):
            expected = rank_values(dtype, 0, NUMEL) + rank_values(dtype, 1, NUMEL)
        assert expected.dtype == np.dtype(dtype)
        for rank, result in enumerate(results):
            got_dtype, raw = result[dtype]
            assert got_dtype == dtype, (rank, dtype)
            got = np.frombuffer(raw, dtype=dtype)
            wrong = np.flatnonzero(got != expected)
            assert wrong.size == 0, (f"rank {rank} {dtype}: {wrong.size} elements differ, "
                                     f"first at {wrong[:3]}: {got[wrong[:3]]} vs "
                                     f"{expected[wrong[:3]]}")
    for result in results:
        assert "integer allreduce sums only" in result["mean"]


def test_integer_sums_would_differ_through_float32():
    """The reference can tell: the same sums through float32 lose elements."""
    for dtype in ("int32", "int64"):
        a, b = rank_values(dtype, 0, NUMEL), rank_values(dtype, 1, NUMEL)
        with np.errstate(over="ignore"):
            exact = a + b
        through_float32 = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float64)
        assert np.any(through_float32 != exact.astype(np.float64))
