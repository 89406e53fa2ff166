"""Probe: open chunks' bookkeeping is counted, not only their accumulators.

Scenario: one job token opens chunks of 2 bytes (one float16, rank 0 of 2,
never completed), each with a 1,000-character job id and key. Before, the
limit counted the accumulators alone: 65,536 such chunks (the per-job open
chunk limit) added +247 MiB of VmRSS with ASCII names and +589 MiB with
4-byte characters under --max-inflight-bytes 64 MiB, while bytes_held said
262,144. Now each open chunk's record (limits.chunk_record_bytes: a measured
CHUNK_RECORD_BYTES plus its names) counts against --max-record-bytes (by
default 1/8 of the limit, at least 4 MiB; one job half), the chunks past it
are refused with RESOURCE_EXHAUSTED naming the option, and the failure
records those refusals leave are bounded in bytes too.
"""

from __future__ import annotations

import time

import pytest
from probes import (
    LONG,
    MiB,
    RawStream,
    assert_alive,
    get_status,
    good_job,
    rss_bytes,
    shard,
    token_daemon,
)
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.records import CHUNK_RECORD_BYTES
from reducerd.service.access import job_token

pytestmark = pytest.mark.timeout(240 if LONG else 90)

DAEMON_TOKEN = "bookkeeping-token"
CHUNKS = 65_536 if LONG else 16_384


def _names(wide: bool) -> tuple[str, str]:
    char = "\U0001F600" if wide else "n"
    return char * 1000, char * 980


def _open_chunks(address: str, job: str, key_stem: str, count: int) -> tuple[int, str]:
    """`count` chunks of one float16 each, rank 0 of 2: how many were refused,
    and the first refusal's message."""
    stream = RawStream(address, job_token(DAEMON_TOKEN, job), inband=True)
    try:
        for i in range(count):
            message = shard(job, 0, 2, [], key=f"{key_stem}{i:020d}")
            message.dtype, message.data = pb.DTYPE_FLOAT16, b"\x00\x3c"
            stream.send(message)
        refused, first = 0, ""
        deadline = time.monotonic() + 60
        # Refusals are answered at once; the open ones wait (for the round timeout).
        while time.monotonic() < deadline:
            try:
                reply = stream.next_reply(timeout=3)
            except Exception:  # queue.Empty: nothing more is coming now
                break
            if getattr(reply, "error_code", 0):
                refused += 1
                first = first or reply.error_message
        return refused, first
    finally:
        stream.close()


@pytest.mark.parametrize("wide", [False, True], ids=["ascii", "4-byte"])
def test_open_chunks_with_long_names_keep_within_the_record_limit(tmp_path, wide):
    daemon = token_daemon(DAEMON_TOKEN, "--max-inflight-bytes", str(64 * MiB),
                          "--round-timeout", "60", log_dir=tmp_path)
    job, key = _names(wide)
    try:
        good_job([daemon.address], token=DAEMON_TOKEN, rounds=1)  # warm
        before = rss_bytes(daemon)
        refused, first = _open_chunks(daemon.address, job, key, CHUNKS)
        status = get_status(daemon.address, DAEMON_TOKEN)
        grown = rss_bytes(daemon) - before
        share = status.max_record_bytes // 2
        opened = CHUNKS - refused
        record = status.record_bytes // opened  # what the daemon counts for one
        # The job's share of the record limit, not the open chunk limit, stopped it.
        assert status.max_record_bytes == 8 * MiB
        assert opened == share // record, (opened, share, record)
        assert "--max-record-bytes" in first and len(first) < 1200, first
        assert status.record_bytes == opened * record
        assert record > CHUNK_RECORD_BYTES + len(job) + len(key)  # the names counted
        # RSS: the records' share, the failure records' 16 MiB, slack (sockets, gRPC).
        assert grown < share + 16 * MiB + 32 * MiB, (grown >> 20, opened, refused)
        print(f"{'4-byte' if wide else 'ascii'}: {opened} open, {refused} refused, "
              f"VmRSS +{grown / MiB:.1f} MiB")
        good_job([daemon.address], job="beside", token=DAEMON_TOKEN)  # others still served
        assert_alive(daemon)
    finally:
        daemon.stop()


@pytest.mark.parametrize("wide", [False, True], ids=["ascii", "4-byte"])
def test_the_record_estimate_covers_what_a_chunk_costs_in_vmrss(tmp_path, wide):
    """With the record limit out of the way, the daemon's VmRSS per open chunk
    (measured) is at most what chunk_record_bytes counts for it."""
    count = 16_384 if LONG else 8_192
    daemon = token_daemon(DAEMON_TOKEN, "--max-inflight-bytes", str(64 * MiB),
                          "--max-record-bytes", str(1 << 30), "--round-timeout", "60",
                          log_dir=tmp_path)
    job, key = _names(wide)
    try:
        good_job([daemon.address], token=DAEMON_TOKEN, rounds=1)
        before = rss_bytes(daemon)
        refused, first = _open_chunks(daemon.address, job, key, count)
        assert refused == 0, first
        per_chunk = (rss_bytes(daemon) - before) / count
        counted = get_status(daemon.address, DAEMON_TOKEN).record_bytes / count
        print(f"{'4-byte' if wide else 'ascii'}: VmRSS +{per_chunk:.0f} B per open chunk, "
              f"counted {counted:.0f} (CHUNK_RECORD_BYTES {CHUNK_RECORD_BYTES} + names)")
        assert per_chunk <= counted, (per_chunk, counted)
        assert_alive(daemon)
    finally:
        daemon.stop()
