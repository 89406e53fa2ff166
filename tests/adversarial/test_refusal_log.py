"""Refusals are logged at the rate of their kinds, not of the attacker.

Scenario: one job token's client keeps 4 chunks open (--max-open-chunks-per-job
4) and sends thousands more, each with a new 1,000-character key: every one
is refused (RESOURCE_EXHAUSTED, in-band). Before, each refusal wrote a
WARNING line with the full job and key (20,000 refusals: 21.3 MB; the
de-duplication remembered 256 keys). Now the first is logged with the names
cut short, the rest are counted ("N more like this in the last T s"), and
the log grows by a few KiB whatever the count.
"""

from __future__ import annotations

import re
import time

from probes import (
    LONG,
    RawStream,
    assert_alive,
    good_job,
    rss_bytes,
    shard,
    token_daemon,
    wait_until,
)

from reducerd.ops.logs import NAME_LOG_CHARS
from reducerd.service.access import job_token

DAEMON_TOKEN = "refusal-log-token"
REFUSALS = 20_000 if LONG else 2_000
NAME = "n" * 1000


def test_refusals_with_long_names_write_a_bounded_log(tmp_path):
    daemon = token_daemon(DAEMON_TOKEN, "--max-open-chunks-per-job", "4",
                          "--round-timeout", "30", log_dir=tmp_path)
    token = job_token(DAEMON_TOKEN, NAME)
    stream = RawStream(daemon.address, token, inband=True)
    try:
        for i in range(4):  # rank 0 of 2: these stay open
            stream.send(shard(NAME, 0, 2, [1.0], key=f"{NAME[:990]}{i:010d}"))
        deadline = time.monotonic() + 5
        while "first seen" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        log_bytes_before, rss_before = len(daemon.log().encode()), rss_bytes(daemon)
        for i in range(REFUSALS):
            stream.send(shard(NAME, 0, 2, [1.0], key=f"{NAME[:980]}x{i:019d}"))
        refused = 0
        for _ in range(REFUSALS):
            reply = stream.next_reply(timeout=30)
            assert reply.error_code == 8, reply  # RESOURCE_EXHAUSTED, each one answered
            refused += 1
        assert refused == REFUSALS
        # The count is written when the period (10 s) ends.
        assert wait_until(lambda: "more like this in the last" in daemon.log(), 15), \
            daemon.log()[-3000:]
        added = daemon.log().encode()[log_bytes_before:].decode()
        assert len(added) < 8 * 1024, f"{len(added)} bytes of log for {REFUSALS} refusals"
        repeats = [int(n) for n in re.findall(r"(\d+) more like this", added)]
        assert sum(repeats) == REFUSALS - 1, added  # every refusal is in the log or counted
        for line in added.splitlines():
            assert len(line) < 2 * NAME_LOG_CHARS + 600, line
            assert NAME[:NAME_LOG_CHARS + 1] not in line, line  # names cut short
        assert rss_bytes(daemon) - rss_before < 32 << 20
        good_job([daemon.address], token=DAEMON_TOKEN)
        assert_alive(daemon)
    finally:
        stream.close()
        daemon.stop()
