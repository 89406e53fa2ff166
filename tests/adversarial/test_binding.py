"""Probe: what a daemon listens on (issue 16, row 8).

Before: `--listen 0.0.0.0:P` made gRPC bind the IPv6 wildcard too ([::]:P,
dual-stack), wider than asked. Bound now: exactly the address given, read
from the kernel's own tables (/proc/net/tcp and tcp6): 0.0.0.0:P listens on
IPv4 alone, and so does the data plane beside it.
"""

import socket
from pathlib import Path

import pytest
from probes import assert_alive, data_port, good_job, limited_daemon

LISTEN = "0A"


def _listening(port: int) -> dict[str, list[str]]:
    """The local addresses listening on `port`, per table (tcp, tcp6), in hex."""
    found: dict[str, list[str]] = {"tcp": [], "tcp6": []}
    for table in found:
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port and fields[3] == LISTEN:
                found[table].append(address)
    return found


def _ipv6_loopback_works() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net")
def test_listen_on_0_0_0_0_binds_ipv4_alone(tmp_path):
    daemon = limited_daemon("--listen", "0.0.0.0:0", log_dir=tmp_path)
    try:
        port = int(daemon.address.rpartition(":")[2])
        for bound in (port, data_port(daemon.address)):
            assert _listening(bound) == {"tcp": ["00000000"], "tcp6": []}, bound
        if _ipv6_loopback_works():
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("::1", port), timeout=5).close()
        good_job([daemon.address])  # and it serves on 127.0.0.1
        assert_alive(daemon)
    finally:
        daemon.stop()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net")
def test_listen_on_loopback_binds_loopback_alone(tmp_path):
    daemon = limited_daemon(log_dir=tmp_path)  # 127.0.0.1:0
    try:
        port = int(daemon.address.rpartition(":")[2])
        found = _listening(port)
        # gRPC may hold 127.0.0.1 as an IPv4-mapped IPv6 socket: the same address.
        assert found["tcp"] + found["tcp6"] in (
            ["0100007F"], ["0000000000000000FFFF00000100007F"]), found
    finally:
        daemon.stop()
