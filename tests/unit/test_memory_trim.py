"""The daemon gives its heaps' free memory back when idle or at a memory limit
(reducerd.ops.memory.HeapTrimmer, the server's trim loop), measured in VmRSS."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.ops.memory import IDLE_CALLS, HeapTrimmer


def test_trimming_is_due_at_a_limit_and_once_when_idle_never_in_steady_traffic():
    trimmer = HeapTrimmer()
    if not trimmer.available:
        pytest.skip("no glibc malloc_trim")
    # Serving within its limits: something held, no waits.
    assert not any(trimmer.due(held_bytes=1 << 20, pressure=0) for _ in range(20))
    # A stream waited for room since the last call: due, each time it moves.
    assert trimmer.due(1 << 20, pressure=1)
    assert not trimmer.due(1 << 20, pressure=1)
    assert trimmer.due(1 << 20, pressure=3)
    # Nothing held: due once, at the IDLE_CALLS-th call, until something is held again.
    idle = [trimmer.due(0, 3) for _ in range(3 * IDLE_CALLS)]
    assert idle.index(True) == IDLE_CALLS - 1 and idle.count(True) == 1
    assert not trimmer.due(1, 3)  # gaps between training steps are shorter
    assert [trimmer.due(0, 3) for _ in range(IDLE_CALLS)][-1]


def test_the_budget_counts_every_wait_and_refusal_as_pressure(budget_class):
    budget = budget_class(1000, transport_reserve_bytes=100)
    assert budget.take_accumulator(900) and budget.pressure == 0
    assert not budget.take_accumulator(1) and budget.pressure == 1
    assert not budget.reserve(200, timeout_s=0) and budget.pressure == 2
    assert budget.reserve(100, timeout_s=0, job="j") and budget.pressure == 2
    budget.job_share_bytes = 100
    assert not budget.wait_job_room("j", 0) and budget.pressure == 3
    assert budget.wait_job_room("other", 0) and budget.pressure == 3
    budget.note_pressure()  # a job's own limit refused a chunk (reduction.py)
    assert budget.pressure == 4


_TRIM_RSS_SCRIPT = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from reducerd.bench.procs import proc_status
from reducerd.ops.memory import HeapTrimmer, tune_malloc
assert tune_malloc()  # as the daemon runs: blocks up to 64 MiB stay in the heap
rss = lambda: proc_status(os.getpid())["VmRSS"]
start = rss()
# Chunk-sized payloads freed out of order, every other one kept: a fragmented heap.
blocks = [bytearray(1 << 20) for _ in range(96)]
for block in blocks:
    block[::4096] = b"x" * len(block[::4096])
del blocks[::2]
held = rss()
trimmer = HeapTrimmer()
before_free = trimmer.free_bytes()
trimmed = trimmer.trim_if_due(held_bytes=1, pressure=1)
after = rss()
blocks += [bytearray(1 << 20) for _ in range(48)]  # the heap's pages come back
# Due, but less free than it keeps: no trim.
lean = HeapTrimmer(keep_bytes=1 << 40).trim_if_due(held_bytes=1, pressure=1)
print(json.dumps({"start": start, "held": held, "after": after, "trimmed": trimmed,
                  "free_before": before_free, "lean": lean}))
"""


def test_a_trim_gives_the_freed_chunks_back_in_vmrss():
    """48 MiB freed between 48 MiB kept: the heap keeps it all (tune_malloc's
    thresholds), a due trim gives most of it back; with less free than it
    keeps, a due trim does nothing."""
    if not HeapTrimmer().available:
        pytest.skip("no glibc malloc_trim")
    done = subprocess.run([sys.executable, "-c", _TRIM_RSS_SCRIPT], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    mib = 1 << 20
    assert got["held"] - got["start"] > 90 * mib, got  # all 96 touched, the freed kept
    assert got["trimmed"], got
    assert got["held"] - got["after"] > 40 * mib, got
    if got["free_before"] is not None:  # glibc 2.33 on: it says what is free
        assert got["free_before"] > 40 * mib and not got["lean"], got


def test_a_chunk_refused_by_its_jobs_own_limit_counts_as_pressure():
    table = ReductionTable(60.0, 1 << 30, max_open_chunks_per_job=1)
    one = np.ones(1, np.float16).tobytes()

    def open_chunk(key: str):
        return table.contribute(ChunkId("job", key, 0, 0),
                                Contribution(0, 2, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, one), 0)
    assert open_chunk("a") == [] and table.budget.pressure == 0
    [refusal] = open_chunk("b")
    assert refusal.error_code == "RESOURCE_EXHAUSTED" and table.budget.pressure == 1
