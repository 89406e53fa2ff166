"""GetStatus and `reducerd status` stay small with many jobs; idle jobs expire.

Scenario: a tenant with the daemon token (or many job tokens) names a new job
in every shard, each job id 1,000 four-byte characters. Before, GetStatus
listed every job: 16,000 such jobs made a 16.4 MB reply (2,000 of them 8 MB
here) and `reducerd status` (text and --json) failed on the client's 4 MiB
message limit; and a job's record stayed an hour after its last shard. Now
the reply lists the most recently active --status-max-jobs jobs and counts
them all, `--jobs N` asks for more within a fixed byte budget, and records
go after --job-idle-expiry.
"""

from __future__ import annotations

import json
import subprocess
import sys

from probes import (
    LONG,
    MiB,
    RawStream,
    assert_alive,
    get_status,
    good_job,
    shard,
    token_daemon,
    wait_until,
)

TOKEN = "status-many-jobs"
JOBS = 16_000 if LONG else 2_000
WIDE = "\U0001F600" * 999  # 999 four-byte characters: a job id of 3,996 bytes


def _name(i: int) -> str:
    return f"{WIDE[:995]}{i:05d}"


def _make_jobs(address: str, count: int) -> None:
    """`count` jobs of one rank each: every shard completes its chunk at once."""
    stream = RawStream(address, TOKEN, inband=True)
    try:
        for i in range(count):
            stream.send(shard(_name(i), 0, 1, [float(i)], key="k"))
        for _ in range(count):
            reply = stream.next_reply(timeout=30)
            assert not reply.error_code, reply.error_message
    finally:
        stream.close()


def _status_cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reducerd", "status", "--address", address, "--token", TOKEN,
         "--sample", "0", *args], capture_output=True, text=True, timeout=60)


def test_status_of_many_long_named_jobs_lists_the_most_active_and_counts_all(tmp_path):
    daemon = token_daemon(TOKEN, "--round-timeout", "5", log_dir=tmp_path)
    try:
        _make_jobs(daemon.address, JOBS)
        good_job([daemon.address], job="recent", token=TOKEN)  # the most recently active
        reply = get_status(daemon.address, TOKEN)
        assert reply.jobs_total == JOBS + 1 and reply.jobs_open == 0
        assert len(reply.jobs) == 100  # --status-max-jobs' default
        assert "recent" in {j.job for j in reply.jobs}
        assert reply.ByteSize() < 512 * 1024, reply.ByteSize()  # was 8 MB (16.4 MB long)
        # Asked for every job: as many as the byte budget holds, under 4 MiB.
        everything = get_status(daemon.address, TOKEN, max_jobs=1 << 30)
        assert 100 < len(everything.jobs) <= JOBS + 1
        assert everything.ByteSize() < 3 * MiB, everything.ByteSize()
        # The command line, text and JSON, with its 4 MiB client limit.
        as_json = _status_cli(daemon.address, "--json")
        assert as_json.returncode == 0, as_json.stderr
        parsed = json.loads(as_json.stdout)
        assert (parsed["jobs_total"], len(parsed["jobs"])) == (JOBS + 1, 100)
        more = _status_cli(daemon.address, "--json", "--jobs", str(10 * JOBS))
        assert more.returncode == 0, more.stderr
        assert len(json.loads(more.stdout)["jobs"]) == len(everything.jobs)
        text = _status_cli(daemon.address)
        assert text.returncode == 0, text.stderr
        assert f"the 100 most recently active of {JOBS + 1}" in text.stdout
        assert max(map(len, text.stdout.splitlines())) < 400  # names cut in the table
        assert_alive(daemon)
    finally:
        daemon.stop()


def test_idle_jobs_are_forgotten_after_the_job_idle_expiry(tmp_path):
    daemon = token_daemon(TOKEN, "--round-timeout", "1", "--job-idle-expiry", "2",
                          log_dir=tmp_path)
    try:
        _make_jobs(daemon.address, 50)
        assert get_status(daemon.address, TOKEN).jobs_total == 50
        assert wait_until(lambda: get_status(daemon.address, TOKEN).jobs_total == 0, 6), \
            "idle jobs were kept past --job-idle-expiry"
        good_job([daemon.address], token=TOKEN)  # a forgotten job's name starts afresh
        assert_alive(daemon)
    finally:
        daemon.stop()
