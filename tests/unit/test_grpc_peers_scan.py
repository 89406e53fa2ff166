"""The gRPC guard reads the kernel's socket tables only as often as a rule can bite.

Reading /proc/net/tcp walks the kernel's whole connection hash table, so the
guard reads it every SCAN_PERIOD_S only while the process holds at least a
peer's share of descriptors; otherwise every QUIET_SCAN_PERIOD_S, which still
keeps the unauthenticated deadline (to within that period).
"""

from __future__ import annotations

import os
import socket

import pytest

from reducerd.daemon import grpc_peers
from reducerd.daemon.grpc_peers import (
    QUIET_SCAN_PERIOD_S,
    SCAN_PERIOD_S,
    UNAUTHENTICATED_DEADLINE_S,
    UnauthenticatedGuard,
)

pytestmark = pytest.mark.timeout(30)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _guard(monkeypatch, descriptors: int, cap: int = 64):
    clock = _Clock()
    guard = UnauthenticatedGuard(port=1, cap=cap, clock=clock)
    reads = []
    inode, peer = 4242, (grpc_peers.ipaddress.ip_address("127.0.0.1"), 5555)
    monkeypatch.setattr(guard, "_connections", lambda: reads.append(clock.now) or
                        iter([(inode, peer)]))
    shut = []
    monkeypatch.setattr(guard, "_shut_down", lambda inodes, conns: shut.extend(inodes) or
                        len(inodes))
    monkeypatch.setattr(grpc_peers, "_descriptors", lambda: descriptors)
    return guard, clock, reads, shut


def test_few_descriptors_read_the_tables_every_quiet_period_and_keep_the_deadline(monkeypatch):
    guard, clock, reads, shut = _guard(monkeypatch, descriptors=3)
    ticks = int((UNAUTHENTICATED_DEADLINE_S + 2 * QUIET_SCAN_PERIOD_S) / SCAN_PERIOD_S)
    for _ in range(ticks):
        guard.scan()
        clock.now += SCAN_PERIOD_S
        if shut:
            break
    assert shut == [4242]
    assert len(reads) <= UNAUTHENTICATED_DEADLINE_S / QUIET_SCAN_PERIOD_S + 2
    gaps = [b - a for a, b in zip(reads, reads[1:], strict=False)]
    assert all(gap >= QUIET_SCAN_PERIOD_S - 1e-9 for gap in gaps), gaps
    # shut down within the deadline plus one quiet period of its first sight
    assert reads[-1] - reads[0] <= UNAUTHENTICATED_DEADLINE_S + QUIET_SCAN_PERIOD_S


def test_a_peers_share_of_descriptors_reads_the_tables_every_tick(monkeypatch):
    guard, clock, reads, _ = _guard(monkeypatch, descriptors=16, cap=64)  # 64 // 4
    for _ in range(10):
        guard.scan()
        clock.now += SCAN_PERIOD_S
    assert len(reads) == 10


def test_the_tables_are_matched_as_the_kernel_writes_them():
    """Real sockets: the connections to a port, both families, with their inodes."""
    servers, clients, accepted = [], [], []
    try:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                server = socket.socket(family)
                server.bind((host, 0))
            except OSError:
                continue
            server.listen(8)
            servers.append(server)
            port = server.getsockname()[1]
            for _ in range(3):
                clients.append(socket.create_connection((host, port)))
                accepted.append(server.accept()[0])
            found = dict(UnauthenticatedGuard(port=port, cap=64)._connections())
            mine = {os.fstat(s.fileno()).st_ino: s.getpeername()[1]
                    for s in accepted[-3:]}
            assert {inode: peer[1] for inode, peer in found.items()} == mine
    finally:
        for s in servers + clients + accepted:
            s.close()
