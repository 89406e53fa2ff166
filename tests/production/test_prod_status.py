"""`reducerd status` and `reducerd top` against a real daemon with a token.

Scenario: job "stuck" opens round 4 of key "w" with rank 0 of 3 and never
gets ranks 1 and 2; job "fine" completes a round. status shows both jobs and
the stalled round with its missing ranks, as a table and as JSON; a missing
token is a clear error; top refreshes the same view for --iterations.
"""

import json
import subprocess
import sys
import time

import pytest
from conftest import RawStream, shard
from support import start_daemon

from reducerd.daemon import status

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("status")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    daemon = start_daemon("--auth-token-file", str(token_file), "--stalled-after", "0.3",
                          "--drain-grace", "0.5", log_dir=tmp)
    streams = [RawStream(daemon.address, TOKEN) for _ in range(3)]
    try:
        streams[0].send(shard("stuck", 0, 3, key="w", round_=4))
        for rank in (0, 1):
            streams[1 + rank].send(shard("fine", rank, 2))
        assert streams[1].next_reply().data
        time.sleep(0.4)  # past --stalled-after
        daemon.token_file = token_file
        yield daemon
    finally:
        for stream in streams:
            stream.close()
        daemon.stop()


def test_status_json(daemon, capsys):
    rc = status.main(["--address", daemon.address, "--token", TOKEN, "--json",
                      "--sample", "0.1"])
    assert rc == 0
    reply = json.loads(capsys.readouterr().out)
    jobs = {job["job"]: job for job in reply["jobs"]}
    assert jobs["stuck"]["open_chunks"] == 1 and jobs["stuck"]["world_sizes"] == [3]
    assert jobs["stuck"]["open_chunk_bytes"] == 256 * 4 and jobs["fine"]["open_chunk_bytes"] == 0
    assert jobs["fine"]["chunks_completed"] == 1 and jobs["fine"]["bytes_in"] == 2 * 512
    assert isinstance(jobs["fine"]["bytes_in_per_s"], float)
    [stalled] = reply["stalled"]
    assert stalled["job"] == "stuck" and stalled["key"] == "w" and stalled["round"] == 4
    assert stalled["missing_ranks"] == [1, 2] and stalled["age_s"] >= 0.3
    assert reply["stalled_after_s"] == 0.3 and reply["address"] == daemon.address
    assert reply["data_port"] > 0  # the data plane is on by default


def test_status_table(daemon, capsys):
    rc = status.main(["--address", daemon.address, "--token-file", str(daemon.token_file),
                      "--sample", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Jobs" in out and "Stalled rounds (open longer than 0.3 s)" in out
    assert "stuck" in out and "fine" in out and "1-2 of 3" in out
    assert f"at {daemon.address}" in out and "data port " in out


def test_status_without_token_says_so(daemon, capsys):
    rc = status.main(["--address", daemon.address, "--sample", "0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "--token-file" in err


def test_status_of_nothing_says_so(capsys):
    rc = status.main(["--address", "127.0.0.1:1", "--sample", "0", "--timeout", "2"])
    assert rc == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_top_refreshes_for_iterations(daemon, capsys):
    rc = status.top_main(["--address", daemon.address, "--token", TOKEN, "--iterations", "2",
                          "--interval", "0.05"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "stuck" in out and "1-2 of 3" in out


@pytest.mark.parametrize("command", [["status", "--json", "--sample", "0"],
                                     ["top", "--iterations", "1"]])
def test_commands_through_the_cli(daemon, command):
    result = subprocess.run([sys.executable, "-m", "reducerd", command[0], "--address",
                             daemon.address, "--token", TOKEN, *command[1:]],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "stuck" in result.stdout


def test_ranges():
    assert status._ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert status._ranges([]) == ""
