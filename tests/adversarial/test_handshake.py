"""Probes: data-plane handshakes trickled, and a daemon full of connections (issue 16, row 5).

Before: the 10 s limit applied per read, so a handshake trickled at 1 byte /
5 s stayed open (3,342 connections with 13 bytes each at 100 s, 3,355
threads), and with the connection cap reached new workers failed at once
with RESOURCE_EXHAUSTED, neither retried nor sent through gRPC. Bounds now:
the whole handshake ends within 10 s of the accept; at most 64 connections
are in their handshake (one more drops the oldest), apart from the
authenticated ones, so a real worker gets through at once and the daemon's
threads stay bounded; a worker refused for capacity sends through gRPC.

The daemons here run with a 3 s handshake limit (HANDSHAKE_S, patched in
before they start) so the probes do not wait out the real 10 s: the deadline
is the same code at either value.
"""

import socket
import threading
import time

from probes import (
    LONG,
    assert_alive,
    data_port,
    data_socket,
    good_job,
    limited_daemon,
    threads,
)
from reducer_wire.framing import MAGIC

from reducerd.dataplane.plane import MAX_HANDSHAKING

HANDSHAKE_S = 3.0
_SHORT_HANDSHAKE = f"import reducerd.dataplane.plane as d; d.HANDSHAKE_TIMEOUT_S = {HANDSHAKE_S}"


def _closed_by_daemon(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_trickled_handshake_ends_within_its_limit_of_the_accept(tmp_path):
    daemon = limited_daemon(log_dir=tmp_path, prelude=_SHORT_HANDSHAKE)
    try:
        sock = data_socket(daemon.address, hello=False)
        start = time.monotonic()
        closed = threading.Event()

        def trickle():  # a byte every 0.6 s: each read well within the limit
            for byte in MAGIC:
                if closed.is_set():
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.6)

        threading.Thread(target=trickle, daemon=True).start()
        assert _closed_by_daemon(sock, timeout_s=HANDSHAKE_S + 10)
        closed.set()
        assert HANDSHAKE_S - 0.5 < time.monotonic() - start < HANDSHAKE_S + 2.5
        sock.close()
        assert_alive(daemon)
    finally:
        daemon.stop()


def test_trickled_handshakes_cannot_lock_workers_out(tmp_path):
    tricklers = 3000 if LONG else 300
    daemon = limited_daemon(log_dir=tmp_path, prelude=_SHORT_HANDSHAKE)
    socks = []
    try:
        base_threads = threads(daemon)
        host, port = daemon.address.rpartition(":")[0], data_port(daemon.address)
        for _ in range(tricklers):
            sock = socket.create_connection((host, port), timeout=10)
            sock.send(MAGIC[:1])  # and nothing more
            socks.append(sock)
        time.sleep(0.5)
        # The daemon's threads follow its caps, not the number of tricklers.
        assert threads(daemon) <= base_threads + MAX_HANDSHAKING + 8
        # A real job gets its data-plane connections through at once, over TCP.
        assert good_job([daemon.address], data_plane="tcp", timeout=10) < 5
        # Every trickler is gone within the limit of its accept (most much sooner).
        deadline = time.monotonic() + HANDSHAKE_S + 2
        for sock in socks:
            assert _closed_by_daemon(sock, max(0.1, deadline - time.monotonic()))
        assert_alive(daemon)
    finally:
        for sock in socks:
            sock.close()
        daemon.stop()


def test_a_worker_refused_for_capacity_sends_through_grpc(tmp_path):
    # Two authenticated data connections at most (the real cap is 4096).
    daemon = limited_daemon(log_dir=tmp_path, prelude="import reducerd.dataplane.plane as d; "
                                                      "d.MAX_CONNECTIONS = 2")
    holders = []
    try:
        holders = [data_socket(daemon.address) for _ in range(2)]
        time.sleep(0.3)
        seconds = good_job([daemon.address], job="refused", timeout=10)  # data_plane auto
        assert seconds < 5
        assert "too many data connections (2)" in daemon.log()
        for sock in holders:
            sock.close()
        time.sleep(0.5)
        assert good_job([daemon.address], job="after", data_plane="tcp", timeout=10) < 5
        assert_alive(daemon)
    finally:
        for sock in holders:
            sock.close()
        daemon.stop()
