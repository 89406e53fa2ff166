"""Probe: connections to the gRPC port are capped, with or without a call.

Health and reflection need no token, so anyone who reaches the port can open
gRPC connections, and nothing bounded them but the descriptor limit: each
held about 17 KiB of the daemon's memory once its HTTP/2 handshake was done
(11 KiB before), so 65,536 descriptors (the systemd units' LimitNOFILE) were
about 1 GiB. Now gRPC takes at most reducerd.daemon.server.MAX_GRPC_CONNECTIONS at
once (8,192; patched to 16 here, the same option counts at either) and closes
the ones beyond as they come. A flood at the cap keeps workers out while it
lasts (what a connection cap means; the data plane's handshake slots are the
same), and they are served as soon as it goes.
"""

import resource
import socket
import time

import pytest
from probes import assert_alive, good_job, limited_daemon, rss_bytes, wait_until

pytestmark = pytest.mark.timeout(90)

CAP = 16
# The unauthenticated share (reducerd.daemon.grpc_peers, test_grpc_idle_flood.py)
# set to the whole cap: these probes are about the cap itself.
_SMALL_CAP = (f"import reducerd.daemon.server as s; s.MAX_GRPC_CONNECTIONS = {CAP}; "
              "import reducerd.daemon.grpc_peers as g; "
              "g.UNAUTHENTICATED_SHARE = g.PEER_SHARE = 1")


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon closed `sock` (what it sent before, its HTTP/2
    settings, is read and dropped); False while it stays open."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.fixture
def daemon(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"needs 2,048 descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))  # the daemon too
    d = limited_daemon(log_dir=tmp_path, prelude=_SMALL_CAP)
    yield d
    d.stop()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_beyond_the_cap_are_closed_and_workers_are_served_once_they_go(daemon):
    host, port = daemon.address.rsplit(":", 1)
    flood: list[socket.socket] = []
    try:
        for _ in range(4 * CAP):  # raw TCP: no HTTP/2, no call, no token
            flood.append(socket.create_connection((host, int(port)), timeout=5))
        assert wait_until(lambda: sum(map(_closed_by_peer, flood)) >= 3 * CAP, 10)
        time.sleep(0.5)  # and no more than that
        still_open = [s for s in flood if not _closed_by_peer(s)]
        assert len(still_open) == CAP, len(still_open)
        assert_alive(daemon)
    finally:
        for sock in flood:
            sock.close()
    # Once the flood has gone, workers (gRPC for control, the data plane) are served.
    assert wait_until(lambda: good_job([daemon.address], rounds=2) > 0, 30)
    assert_alive(daemon)


def test_a_flood_of_connections_holds_no_more_memory_than_the_cap_allows(daemon):
    """1,024 connections against a cap of 16: the daemon's VmRSS grows by what
    16 cost (a few hundred KiB), not by 1,024 x 11 KiB = 11 MiB."""
    host, port = daemon.address.rsplit(":", 1)
    good_job([daemon.address], rounds=1)  # warm: threads and buffers that stay
    before = rss_bytes(daemon)
    flood: list[socket.socket] = []
    try:
        for _ in range(64):
            batch = [socket.create_connection((host, int(port)), timeout=5) for _ in range(16)]
            flood.extend(batch)
            for sock in batch:  # the daemon has closed these or keeps them: either way
                _closed_by_peer(sock)
        time.sleep(1.0)
        grown = rss_bytes(daemon) - before
        assert sum(not _closed_by_peer(s) for s in flood) == CAP
        assert grown < 4 << 20, grown
        assert_alive(daemon)
    finally:
        for sock in flood:
            sock.close()
