"""Probe: idle unauthenticated HTTP/2 connections cannot lock workers out.

Scenario: a client without a token opens more gRPC connections than the cap
(MAX_GRPC_CONNECTIONS: 8,192; patched to 256 here unless
REDUCER_ADVERSARIAL=long), each sending the HTTP/2 preface and SETTINGS and
then nothing, and opens a new one for every one the daemon closes. Before,
the flood filled the cap and every later connection was closed, workers
with a valid token included, until the flood ended. Now unauthenticated
connections keep to half the cap in all and a quarter from one address
(the oldest beyond go), none outlives its 10 s deadline, and connections
without a call close after --grpc-idle-timeout: a worker with a valid token
is served during the flood.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import pytest
from probes import LONG, assert_alive, good_job, rss_bytes, token_daemon, wait_until

pytestmark = pytest.mark.timeout(120)

TOKEN = "idle-flood-token"
CAP = 8192 if LONG else 256
FLOOD = CAP + CAP // 64 if LONG else 2 * CAP
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame, stream 0
_SMALL_CAP = f"import reducerd.daemon.server as s; s.MAX_GRPC_CONNECTIONS = {CAP}"


def _http2_connection(port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(PREFACE + SETTINGS)
        return sock
    except OSError:
        return None


def _closed_by_peer(sock: socket.socket) -> bool:
    if sock.fileno() < 0:  # closed here, and not reopened
        return True
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(1 << 16):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


class _Flood:
    """FLOOD idle HTTP/2 connections, each one the daemon closes opened again
    (every 0.5 s) until stop()."""

    def __init__(self, port: int) -> None:
        self.port, self.socks = port, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        for _ in range(FLOOD):
            sock = _http2_connection(self.port)
            if sock is not None:
                self.socks.append(sock)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for i, sock in enumerate(list(self.socks)):
                if _closed_by_peer(sock):
                    sock.close()
                    self.socks[i] = _http2_connection(self.port) or sock

    def open_count(self) -> int:
        return sum(not _closed_by_peer(s) for s in list(self.socks))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self.socks:
            sock.close()


@pytest.fixture
def descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 3 * FLOOD + 1024
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))  # the daemon too
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_worker_with_a_token_is_served_during_a_flood_of_idle_http2_connections(
        tmp_path, descriptors):
    daemon = token_daemon(TOKEN, log_dir=tmp_path, prelude=_SMALL_CAP)
    port = int(daemon.address.rsplit(":", 1)[1])
    good_job([daemon.address], token=TOKEN, rounds=1)  # warm
    rss_before = rss_bytes(daemon)
    flood = _Flood(port)
    try:
        flood.start()
        # The unauthenticated share from one address: a quarter of the cap.
        assert wait_until(lambda: flood.open_count() <= CAP // 4 + CAP // 16, 10), \
            flood.open_count()
        fds = len(os.listdir(f"/proc/{daemon.process.pid}/fd"))
        assert fds < CAP // 2 + 128, fds  # was the whole cap and more
        for attempt in range(3):  # three jobs while the flood goes on, each in time
            assert good_job([daemon.address], job=f"during-{attempt}", token=TOKEN,
                            timeout=20) < 15
        assert flood.open_count() <= CAP // 4 + CAP // 16
        assert rss_bytes(daemon) - rss_before < 32 << 20
        assert "unauthenticated connection(s)" in daemon.log()
        assert_alive(daemon)
    finally:
        flood.stop()
        daemon.stop()


def test_an_idle_connection_is_closed_after_the_grpc_idle_timeout(tmp_path):
    """A connection with no call, a valid HTTP/2 handshake and nothing after:
    closed by gRPC after --grpc-idle-timeout (2 s here), not held."""
    daemon = token_daemon(TOKEN, "--grpc-idle-timeout", "2", log_dir=tmp_path)
    try:
        sock = _http2_connection(int(daemon.address.rsplit(":", 1)[1]))
        assert sock is not None
        opened = time.monotonic()
        assert wait_until(lambda: _closed_by_peer(sock), 8, step_s=0.05)
        assert 1.5 < time.monotonic() - opened < 5
        sock.close()
        good_job([daemon.address], token=TOKEN)
        assert_alive(daemon)
    finally:
        daemon.stop()
