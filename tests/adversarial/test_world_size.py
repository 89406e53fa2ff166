"""Probe: shards that declare a huge world_size (issue 16, row 1).

Before: one 16-byte shard with world_size 2^32-1 made the daemon build the set
of missing ranks at the round timeout (RSS 68 MiB -> 22.8 GB, the loop froze,
every other job timed out); under a memory limit a MemoryError killed the
expiry task for good. Bounds now: such a shard is INVALID_ARGUMENT at once
under the default --max-world-size; with the limit raised to 2^32-1 the
daemon's cost follows what arrived: RSS grows by less than 32 MiB, GetStatus
answers in under a second with at most 64 missing ranks per chunk, the
failure message is under 2 KB, round timeouts keep firing, and a good job is
served exactly meanwhile.
"""

import time

import grpc
import pytest
from probes import (
    LONG,
    MiB,
    RawStream,
    assert_alive,
    get_status,
    good_job,
    limited_daemon,
    rss_bytes,
    shard,
)
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

HUGE = (1 << 32) - 1


def test_a_world_size_over_the_limit_is_refused_at_once(tmp_path):
    daemon = limited_daemon("--round-timeout", "2", log_dir=tmp_path)
    try:
        before = rss_bytes(daemon)
        stream = RawStream(daemon.address)
        start = time.monotonic()
        stream.send(shard("hostile", 0, HUGE, [1, 2, 3, 4]))
        error = stream.next_reply(timeout=5)
        assert time.monotonic() - start < 2
        assert isinstance(error, grpc.RpcError), error
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-world-size" in error.details() and "65536" in error.details()
        stream.close()
        assert not get_status(daemon.address).jobs  # nothing of it counted
        good_job([daemon.address])
        assert rss_bytes(daemon) - before < 32 * MiB
        assert_alive(daemon)
    finally:
        daemon.stop()


def test_a_huge_declared_world_size_costs_what_arrived(tmp_path):
    chunks = 2000 if LONG else 50
    daemon = limited_daemon("--round-timeout", "1.5", "--stalled-after", "0.1",
                            "--max-world-size", str(HUGE), log_dir=tmp_path)
    try:
        before = rss_bytes(daemon)
        stream = RawStream(daemon.address, inband=True)
        for i in range(chunks):
            stream.send(shard("hostile", 7, HUGE, [1, 2, 3, 4], key=f"k{i}"))
        time.sleep(0.5)
        start = time.monotonic()
        status = get_status(daemon.address)
        assert time.monotonic() - start < 1.0
        assert len(status.stalled) == min(chunks, 100)
        assert all(len(c.missing_ranks) == 64 for c in status.stalled)
        assert list(status.stalled[0].missing_ranks[:8]) == [0, 1, 2, 3, 4, 5, 6, 8]
        # Another job is served exactly, and promptly, while the huge rounds wait.
        assert good_job([daemon.address], job="good-during") < 10
        failures = [stream.next_reply(timeout=10) for _ in range(chunks)]
        for reply in failures:
            assert isinstance(reply, pb.Shard), reply
            assert reply.error_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert len(reply.error_message) < 2048
            assert f"and {HUGE - 1 - 64} more of {HUGE}" in reply.error_message
        # The expiry task lives on: a second wave times out too.
        stream.send(shard("hostile", 0, HUGE, [1, 2, 3, 4], key="again"))
        again = stream.next_reply(timeout=10)
        assert again.error_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        stream.close()
        assert good_job([daemon.address], job="good-after") < 10
        assert get_status(daemon.address).bytes_held == 0
        assert rss_bytes(daemon) - before < 32 * MiB
        assert_alive(daemon)
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()


@pytest.mark.parametrize("world_size", [1 << 22, 1 << 24])
def test_status_and_messages_stay_small_for_any_world_size(tmp_path, world_size):
    """The issue's 2^22 (36.6 MB message) and 2^24 (2.4 s GetStatus) cases."""
    daemon = limited_daemon("--round-timeout", "1", "--stalled-after", "0.1",
                            "--max-world-size", str(world_size), log_dir=tmp_path)
    try:
        stream = RawStream(daemon.address, inband=True)
        stream.send(shard("hostile", 0, world_size, [1.0]))
        time.sleep(0.3)
        start = time.monotonic()
        (stalled,) = get_status(daemon.address).stalled
        assert time.monotonic() - start < 0.5
        assert list(stalled.missing_ranks) == list(range(1, 65))
        reply = stream.next_reply(timeout=10)
        assert len(reply.error_message) < 2048
        stream.close()
    finally:
        daemon.stop()
