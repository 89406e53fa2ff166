"""Loopback integration: real daemons, real worker processes, float64 oracle.

Tolerances come from core_cases.error_bound: a per-element bound derived from
one rounding to the wire dtype on the way in, float32 accumulation of W terms,
and one rounding on the way out. A result outside it is a real bug (a lost
or doubled contribution moves elements by O(1), far beyond it).
"""

import pytest
from core_cases import broadcast_worker, interleaved_worker, matrix_worker, out_worker
from support import run_workers

WIRES = ("float16", "bfloat16", "float32")
ODD = 1001
KIB = 256  # 1 KiB of float32 gradient
MIB8 = 2 << 20  # 8 MiB of float32


def _cases(sizes, ops=("sum", "mean"), wires=WIRES, dtype="float32"):
    return [(w, op, n, dtype) for w in wires for op in ops for n in sizes]


def _check(results, cases):
    first = results[0]
    assert len(first) == len(cases)
    for rank_results in results:
        for result in rank_results:
            assert result["ratio"] <= 1.0, result
    for i in range(len(cases)):  # every rank got the same bytes
        assert len({r[i]["digest"] for r in results}) == 1, cases[i]


@pytest.mark.parametrize("num_daemons,world_size", [(2, 2), (3, 3), (2, 8), (3, 8)])
def test_sum_and_mean_against_float64(daemons, num_daemons, world_size):
    sizes = [1, ODD, KIB, MIB8] if world_size <= 3 else [1, ODD, KIB]
    cases = _cases(sizes)
    cases += [("float16", "mean", ODD, "float16"), ("float32", "sum", ODD, "float64")]
    with daemons(num_daemons) as d:
        results = run_workers(matrix_worker, world_size, (d.addresses, cases), timeout=240)
    _check(results, cases)


@pytest.mark.slow
@pytest.mark.parametrize("num_daemons,world_size,wires", [
    (2, 2, ("float16", "bfloat16", "float32")),
    (3, 3, ("float16",)),  # 3 daemons' uneven split; the other wires are the 2-daemon run's
])
def test_64_mib_and_8_mib_with_8_workers(daemons, num_daemons, world_size, wires):
    cases = _cases([16 << 20], ops=("mean",), wires=tuple(w for w in wires if w != "float32"))
    if "float32" in wires:
        cases += _cases([16 << 20], ops=("sum",), wires=("float32",))
    with daemons(num_daemons) as d:
        results = run_workers(matrix_worker, world_size, (d.addresses, cases), timeout=400)
        if num_daemons == 2:
            cases8 = _cases([MIB8], ops=("mean",), wires=("float16",))
            _check(run_workers(matrix_worker, 8, (d.addresses, cases8, "m8"), timeout=400),
                   cases8)
    _check(results, cases)


def test_many_keys_interleaved_and_two_jobs_at_once(daemons):
    """Two jobs of 3 workers share 2 daemons, same key names, keys issued in a
    different order on every rank: every result matches its own job's data."""
    from concurrent.futures import ThreadPoolExecutor

    with daemons(2) as d, ThreadPoolExecutor(1) as pool:
        other = pool.submit(run_workers, interleaved_worker, 3, (d.addresses, "job-b"),
                            timeout=180)  # job B runs beside job A
        ratios_a = run_workers(interleaved_worker, 3, (d.addresses, "job-a"), timeout=180)
        ratios_b = other.result(timeout=200)
    for ratios in (*ratios_a, *ratios_b):
        assert len(ratios) == 3 * 21 and max(ratios) <= 1.0


def test_broadcast_is_exact_from_a_non_zero_root(daemons):
    with daemons(2) as d:
        results = run_workers(broadcast_worker, 3, (d.addresses,))
    for result in results:
        assert result == {"float32_exact": True, "float16_exact": True,
                          "float64_is_float32_rounding": True,
                          "dtypes": ["float16", "float32", "float64"]}


@pytest.mark.parametrize("node_local", [False, True])
def test_out_receives_the_result_also_in_place(daemons, node_local):
    with daemons(2) as d:
        results = run_workers(out_worker, 2, (d.addresses, f"out-{node_local}", node_local))
    assert results[0] == results[1]
