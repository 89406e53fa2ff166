"""Probe: one tenant's connections cannot take the daemon's file descriptors.

Scenario: the daemon runs under `ulimit -n 1024` (RLIMIT_NOFILE 1024, hard
1024, set in its own process) and the address-space cap. Job "greedy"
(its job token) opens 1,100 data-plane connections, each with its HELLO,
and keeps them open. Before, the caps (4,096 data, 8,192 gRPC) ignored the
process limit: the connections took every descriptor, accept() failed with
EMFILE on both planes and every other job timed out. Now the daemon sizes
its caps below what it has (reducerd.ops.descriptors: 288 data, 576 gRPC
under 1,024), keeps a job to half of the data cap (the rest refused with
RESOURCE_EXHAUSTED naming its share), and the daemon token's connections
past the whole cap are refused naming the descriptor limit. Each time,
another job is served exactly: over the data plane beside the greedy job,
through gRPC once the data plane is full. The daemon's descriptors,
counted from /proc/PID/fd, stay below its limit throughout.
"""

from __future__ import annotations

import os
import resource
import selectors
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from probes import (
    assert_alive,
    data_port,
    data_socket,
    good_job,
    read_status_frame,
    token_daemon,
    wait_until,
)
from reducer_client import ReducerClient

from reducerd.ops.descriptors import REFUSING_AT_MOST, RESERVE_DESCRIPTORS
from reducerd.service.access import job_token

pytestmark = pytest.mark.timeout(180)

TOKEN = "descriptor-probe-token"
NOFILE = 1024
GREEDY_CONNECTIONS = 1100
DATA_CAP = (NOFILE - RESERVE_DESCRIPTORS - 64 - REFUSING_AT_MOST) // 3  # 288
RESOURCE_EXHAUSTED = 8


def _under_nofile(soft: int, hard: int) -> str:
    return f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))"


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def descriptors():
    """This process needs room for the flood's sockets (the daemon sets its own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = GREEDY_CONNECTIONS + 2 * DATA_CAP + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open(address: str, token: str, port: int, count: int, pid: int,
          peak: list[int]) -> list[socket.socket]:
    """`count` data connections with their HELLO, the daemon's descriptors
    sampled as they come."""
    socks = []
    for i in range(count):
        try:
            socks.append(data_socket(address, token, port=port, timeout=10))
        except OSError:  # refused at accept (backlog full): the daemon is busy, not dead
            time.sleep(0.05)
        if i % 50 == 0:
            peak[0] = max(peak[0], _descriptors(pid))
    return socks


def _closed(socks: list[socket.socket]) -> list[str]:
    """Of `socks`, read and close (removing them) the ones the daemon closed;
    their last STATUS messages ("" for none: evicted in the handshake)."""
    with selectors.DefaultSelector() as selector:  # epoll: past FD_SETSIZE
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        ready = {key.fileobj for key, _ in selector.select(timeout=0.5)}
    messages = []
    for sock in ready:
        status = read_status_frame(sock, timeout=5)
        messages.append(status[1] if status is not None and status[0] == RESOURCE_EXHAUSTED
                        else "")
        sock.close()
    socks[:] = [s for s in socks if s not in ready]
    return messages


def _one_rank_over_tcp(address: str, token: str, job: str) -> list[str | None]:
    """A one-rank allreduce, exact; the transport it used."""
    values = np.arange(1024, dtype=np.float32)
    with ReducerClient([address], job=job, rank=0, world_size=1, wire_dtype="float32",
                       timeout=20, token=token, node_local=False) as client:
        np.testing.assert_array_equal(client.allreduce(values, key="w"), values)
        return client.transports


def test_one_tenants_connections_leave_descriptors_for_the_others(tmp_path, descriptors):
    daemon = token_daemon(TOKEN, "--round-timeout", "30", log_dir=tmp_path,
                          prelude=_under_nofile(NOFILE, NOFILE))
    pid, peak = daemon.process.pid, [0]
    greedy, flood = [], []
    try:
        log = daemon.log()
        assert f"RLIMIT_NOFILE {NOFILE}, hard {NOFILE}: up to {DATA_CAP} data connections" \
            in log, log
        port = data_port(daemon.address, TOKEN)
        greedy = _open(daemon.address, job_token(TOKEN, "greedy"), port,
                       GREEDY_CONNECTIONS, pid, peak)
        # The greedy job holds its share, half the data cap; the rest were refused.
        refused: list[str] = []
        assert wait_until(lambda: (refused.extend(_closed(greedy)),
                                   len(greedy) <= DATA_CAP // 2)[1], 30), len(greedy)
        assert len(greedy) == DATA_CAP // 2, len(greedy)
        assert any(f"holds {DATA_CAP // 2} data connections, its share of the {DATA_CAP}"
                   in m for m in refused), refused[:3]
        peak[0] = max(peak[0], _descriptors(pid))
        assert peak[0] < NOFILE - RESERVE_DESCRIPTORS // 2, peak[0]
        # Another job, served beside it over the data plane, exactly.
        good = job_token(TOKEN, "good")
        assert _one_rank_over_tcp(daemon.address, good, "good") == ["tcp"]
        assert good_job([daemon.address], job="good", token=good, timeout=20) < 15

        # The daemon token fills the whole cap: past it, refused naming the limit.
        flood = _open(daemon.address, TOKEN, port, DATA_CAP, pid, peak)
        refused = []
        assert wait_until(lambda: (refused.extend(_closed(flood)),
                                   len(flood) <= DATA_CAP // 2)[1], 30), len(flood)
        assert any(f"too many data connections ({DATA_CAP})" in m and "RLIMIT_NOFILE" in m
                   for m in refused), refused[:3]
        peak[0] = max(peak[0], _descriptors(pid))
        assert peak[0] < NOFILE - RESERVE_DESCRIPTORS // 2, peak[0]
        # Another job still served in time, through gRPC while the data plane is full.
        print(f"the daemon's descriptors peaked at {peak[0]} of {NOFILE}")
        other = job_token(TOKEN, "other")
        assert good_job([daemon.address], job="other", token=other, timeout=20) < 15
        assert "accept failed" not in daemon.log()
        assert_alive(daemon)
    finally:
        for sock in greedy + flood:
            sock.close()
        daemon.stop()


def test_the_soft_limit_is_raised_toward_the_hard_one(tmp_path):
    """Soft 1,024 under a hard 16,384: raised to what the full caps need
    (12,448), so the caps stay whole; /proc/PID/limits says so."""
    daemon = token_daemon(TOKEN, log_dir=tmp_path, prelude=_under_nofile(1024, 16384))
    try:
        limits = open(f"/proc/{daemon.process.pid}/limits").read()
        line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
        assert line.split()[3:5] == ["12448", "16384"], line
        assert "RLIMIT_NOFILE 12448 (raised from 1024), hard 16384: up to 4096 data " \
            "connections" in daemon.log()
        good_job([daemon.address], token=TOKEN)
    finally:
        daemon.stop()


def test_too_few_descriptors_stop_the_start_with_code_2(tmp_path):
    """Under 256 descriptors the caps would leave a handful of workers: the
    daemon exits 2 (which the systemd unit does not restart), naming the limit."""
    daemon_log = tmp_path / "out.log"
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    code = (f"{_under_nofile(128, 128)}; import sys; from reducerd.__main__ import main; "
            "sys.exit(main(sys.argv[1:]))")
    with open(daemon_log, "w") as out:
        result = subprocess.run([sys.executable, "-c", code, "--listen", "127.0.0.1:0",
                                 "--auth-token-file", str(token)], stdout=out,
                                stderr=subprocess.STDOUT, timeout=30)
    text = daemon_log.read_text()
    assert result.returncode == 2, text
    assert "RLIMIT_NOFILE is 128" in text and "at least 256" in text, text
    assert "Traceback" not in text, text
