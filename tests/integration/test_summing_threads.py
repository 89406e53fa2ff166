"""A real daemon summing on two threads (--threads 2), with real worker processes.

Scenarios: 8 workers reduce float16, bfloat16 and float32 wires (sum and
mean, one element to several chunks) through a --threads 2 daemon, each
result within the float64 bound of core_cases.error_bound; with 2 workers
the results are bit-identical to a --threads 1 daemon's (a + b == b + a in
float32, whichever contribution a summing thread takes first); 32 load
generator contributors get every sum exact; the daemon says it sums on two
threads, logs no error and drains cleanly (exit 0).
"""

from __future__ import annotations

import re
import time

import pytest
from core_cases import matrix_worker
from support import run_workers, start_daemon

from reducerd.bench.loadgen import LoadSpec, run_load

pytestmark = pytest.mark.timeout(300)

CASES = [("float16", "sum", 300_001, "float32"), ("bfloat16", "mean", 70_000, "float32"),
         ("float32", "sum", 600_000, "float32"), ("float16", "mean", 1, "float16"),
         ("float32", "mean", 4097, "float64")]
DATA_RE = re.compile(r"data plane on (\S+):(\d+)")


def data_port(daemon) -> int:
    deadline = time.monotonic() + 10
    while (match := DATA_RE.search(daemon.log())) is None:
        assert time.monotonic() < deadline, f"no data port in the log:\n{daemon.log()}"
        time.sleep(0.02)
    return int(match.group(2))


def reduce_through(threads: int, world_size: int) -> tuple[list[list[dict]], str]:
    # --pool-chunk-bytes 0 --pool-busy-cores 0: every chunk, small as these are, on the
    # summing threads, however idle the daemon.
    daemon = start_daemon("--threads", str(threads), "--pool-chunk-bytes", "0",
                          "--pool-busy-cores", "0",
                          "--round-timeout", "60")
    try:
        results = run_workers(matrix_worker, world_size,
                              args=([daemon.address], CASES, f"threads{threads}"),
                              timeout=240)
    finally:
        code = daemon.stop()
    log = daemon.log()
    assert code == 0, log
    return results, log


def test_eight_workers_through_two_summing_threads_are_within_the_bound():
    results, log = reduce_through(threads=2, world_size=8)
    for rank_results in results:
        assert len(rank_results) == len(CASES)
        for case in rank_results:
            assert case["ratio"] <= 1.0, case
    digests = {case["case"]: case["digest"] for case in results[0]}
    for rank_results in results[1:]:  # every rank got the very same bytes
        assert {case["case"]: case["digest"] for case in rank_results} == digests
    assert "summing on 2 threads" in log
    assert "ERROR" not in log and "Traceback" not in log, log


def test_two_workers_are_bit_identical_to_one_summing_thread():
    inline, inline_log = reduce_through(threads=1, world_size=2)
    pooled, _ = reduce_through(threads=2, world_size=2)
    assert "summing on" not in inline_log  # --threads 1: the loop thread sums inline
    for rank in range(2):
        assert [c["digest"] for c in pooled[rank]] == [c["digest"] for c in inline[rank]]
        assert all(c["ratio"] <= 1.0 for c in pooled[rank])


def test_many_contributors_get_exact_sums_from_two_summing_threads():
    daemon = start_daemon("--threads", "2", "--pool-chunk-bytes", "0", "--pool-busy-cores", "0",
                          "--round-timeout", "60")
    try:
        spec = LoadSpec("127.0.0.1", data_port(daemon), contributors=32,
                        key_bytes=400_000, chunk_bytes=64 << 10, rounds=3, warmup=1,
                        timeout_s=60)
        result = run_load(spec, processes=2)
    finally:
        assert daemon.stop() == 0
    assert result["errors"] == []
    assert result["chunks_timed"] == 32 * len(spec.chunk_numels) * 3
    log = daemon.log()
    assert "WARNING" not in log and "ERROR" not in log, log
