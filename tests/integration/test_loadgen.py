"""The load generator (reducerd.bench.loadgen) against a real daemon on loopback.

16 contributors, each a data-plane connection, in 2 worker processes: every
result is compared bit for bit with the known sum, every chunk answered, no
error on either side. The known sums themselves are checked against a
float64 reference, and the checker is shown to catch a wrong one.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import encode_shard
from support import start_daemon

from reducerd.bench.loadgen import (
    EXACT_FLOAT16_INT,
    LoadSpec,
    LoadWorker,
    expected_sum,
    pattern_modulus,
    run_load,
)

pytestmark = pytest.mark.timeout(120)

DATA_RE = re.compile(r"data plane on (\S+):(\d+)")


def data_port(daemon) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        match = DATA_RE.search(daemon.log())
        if match:
            return int(match.group(2))
        time.sleep(0.02)
    raise AssertionError(f"no data port in the log:\n{daemon.log()}")


def open_sockets(pid: int) -> int:
    return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
               for fd in os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("contributors", [1, 3, 16, 256, 300])
def test_known_sums_are_exact_float16_integers(contributors):
    """The sum of every rank's (r + i) mod m, against float64, fits float16 exactly."""
    numel = 1000
    m = pattern_modulus(contributors)
    reference = sum(((r + np.arange(numel)) % m).astype(np.float64)
                    for r in range(contributors))
    assert reference.max() <= EXACT_FLOAT16_INT
    np.testing.assert_array_equal(expected_sum(contributors, numel).astype(np.float64),
                                  reference)


def test_sixteen_contributors_get_exact_sums_and_no_error():
    daemon = start_daemon("--round-timeout", "60")
    try:
        spec = LoadSpec("127.0.0.1", data_port(daemon), contributors=16,
                        key_bytes=300_000, chunk_bytes=64 << 10, rounds=3, warmup=1,
                        timeout_s=60)
        calls: list[str] = []
        sockets: dict[str, int] = {}

        def on(state: str) -> None:
            calls.append(state)
            sockets[state] = open_sockets(daemon.process.pid)

        result = run_load(spec, processes=2, on_connected=lambda: on("connected"),
                          on_ready=lambda: on("ready"), on_timed=lambda: on("timed"))
        deadline = time.monotonic() + 10  # the daemon closes each after its last frame
        while (closed := open_sockets(daemon.process.pid)) > sockets["timed"] - 16:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        assert daemon.stop() == 0
    assert result["errors"] == []
    assert calls == ["connected", "ready", "timed"]
    # on_timed comes after the last round and before any connection closes.
    assert sockets["ready"] == sockets["timed"]
    assert closed <= sockets["timed"] - 16
    chunks = len(spec.chunk_numels)
    assert chunks == 5  # 150,000 elements in chunks of 32,768
    assert result["chunks_timed"] == 16 * chunks * 3  # every contributor, chunk and round
    assert result["input_bytes"] == 16 * 300_000 * 3
    latency = result["chunk_latency_s"]
    assert 0 < latency["p50"] <= latency["p99"] <= latency["max"] < 60
    log = daemon.log()
    assert "WARNING" not in log and "ERROR" not in log, log


def test_the_checker_catches_a_wrong_sum():
    spec = LoadSpec("127.0.0.1", 1, contributors=4, key_bytes=2000, chunk_bytes=1000)
    worker = LoadWorker(spec, 0, 4)
    worker.pending = 2
    good = expected_sum(4, 500)
    bad = good.copy()
    bad[7] += 1
    for data in (good, bad):
        worker.on_reply(0, memoryview(encode_shard(
            job="loadgen", key="grad", round=0, offset=0, dtype=pb.DTYPE_FLOAT16,
            world_size=4, data=data.tobytes())))
    assert worker.errors == ["rank 0 round 0 offset 0: wrong sum"]
    assert worker.done.is_set()
