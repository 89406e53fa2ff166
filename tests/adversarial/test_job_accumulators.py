"""Probe: one job that opens chunks it never completes cannot take every job's room.

A chunk's float32 accumulator is held from its first contribution until its
last (or the round timeout). A job whose rank 0 sends shard after shard of a
world of 2, and whose rank 1 never comes, held every byte of
--max-inflight-bytes the daemon's connections leave (56 of 64 MiB here), so
another job's first chunk was refused with RESOURCE_EXHAUSTED until the
round timeout. Now one job's open chunks hold --max-inflight-bytes-per-job
at most (default: half the limit; reducerd.core.limits.job_refusal): the greedy
job's chunks beyond it are refused, naming the option, a good job is served
beside it, and everything is given back at the round timeout.
"""

import grpc
import numpy as np
from probes import (
    RSS_SLACK,
    MiB,
    RawStream,
    assert_alive,
    get_status,
    good_job,
    job_status,
    limited_daemon,
    rss_bytes,
    shard,
    wait_until,
)
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

LIMIT = 64 * MiB
SHARE = LIMIT // 2
CHUNK = 4 * MiB  # float32: as many accumulator bytes
SENT = 16  # 64 MiB of accumulators asked for


def _greedy_shard(index: int) -> pb.Shard:
    """Rank 0 of a world of 2 that never completes: one open chunk per key."""
    return shard("greedy", 0, 2, np.ones(CHUNK // 4, np.float32), key=f"k{index}")


def test_a_job_that_never_completes_its_chunks_keeps_to_its_share(tmp_path):
    daemon = limited_daemon("--max-inflight-bytes", str(LIMIT), "--round-timeout", "10",
                            log_dir=tmp_path)
    stream = None
    try:
        before = rss_bytes(daemon)
        stream = RawStream(daemon.address, inband=True)
        for index in range(SENT):
            stream.send(_greedy_shard(index))
        # Each shard either opened a chunk or was refused: all are counted.
        assert wait_until(lambda: (job_status(daemon, "greedy").open_chunks
                                   + job_status(daemon, "greedy").chunks_failed) == SENT, 5)
        greedy = job_status(daemon, "greedy")
        assert greedy.open_chunks == SHARE // CHUNK, greedy  # was 14: 56 MiB
        assert greedy.chunks_failed == SENT - SHARE // CHUNK, greedy
        assert greedy.open_chunk_bytes == SHARE, greedy  # GetStatus names who holds it
        assert get_status(daemon.address).bytes_held == SHARE
        # The refused shards' payloads were read and freed: the daemon gives
        # its heaps' free memory back after refusals (memory.HeapTrimmer, once
        # a second; before, RSS +88 MiB in one CI-like run against this bound).
        wait_until(lambda: rss_bytes(daemon) - before < SHARE + RSS_SLACK, 5)
        grown = rss_bytes(daemon) - before
        assert grown < SHARE + RSS_SLACK, f"RSS +{grown / MiB:.0f} MiB"
        for _ in range(SENT - SHARE // CHUNK):  # the refusals, in-band
            refusal = stream.next_reply(timeout=5)
            assert isinstance(refusal, pb.Shard), refusal
            assert refusal.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "--max-inflight-bytes-per-job" in refusal.error_message, refusal

        # The rest of the limit is the other jobs': one is served exactly (1 MiB per rank).
        good_job([daemon.address], size=1 << 18, timeout=5)
        # ... while the greedy chunks were still open (not yet expired).
        assert job_status(daemon, "greedy").open_chunks == SHARE // CHUNK

        # At the round timeout the greedy chunks fail and give everything back.
        assert wait_until(lambda: get_status(daemon.address).bytes_held == 0, 20)
        assert job_status(daemon, "greedy").open_chunks == 0
        assert_alive(daemon)
    finally:
        if stream is not None:
            stream.close()
        daemon.stop()
