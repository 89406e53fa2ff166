"""The descriptor plan (reducerd.ops.descriptors) and the receive buffers'
total (reducerd.ops.receive_buffers), without a daemon: a fake RLIMIT_NOFILE,
and real loopback sockets whose SO_RCVBUF is read back."""

from __future__ import annotations

import resource
import socket

import pytest

from reducerd.ops.descriptors import (
    MIN_DESCRIPTORS,
    REFUSING_AT_MOST,
    RESERVE_DESCRIPTORS,
    DescriptorError,
    plan_descriptors,
)
from reducerd.ops.receive_buffers import FLOOR_BYTES, ReceiveBuffers, set_receive_buffer

DATA, GRPC, HANDSHAKING = 4096, 8192, 64
FULL = DATA + GRPC + HANDSHAKING + REFUSING_AT_MOST + RESERVE_DESCRIPTORS  # 12,448


class FakeLimit:
    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.soft, self.hard, self.refuse = soft, hard, refuse

    def get(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.soft, self.hard

    def set(self, which: int, limits: tuple[int, int]) -> None:
        if self.refuse:  # the unit's seccomp filter (~@resources): EPERM
            raise PermissionError(1, "Operation not permitted")
        self.soft, self.hard = limits


def _plan(limit: FakeLimit):
    return plan_descriptors(DATA, GRPC, HANDSHAKING, getrlimit=limit.get, setrlimit=limit.set)


def test_under_ulimit_1024_the_caps_fit_below_the_limit_with_the_reserve():
    plan = _plan(FakeLimit(1024, 1024))
    assert (plan.soft, plan.raised_from) == (1024, None)
    assert (plan.data_connections, plan.grpc_connections) == (288, 576)
    assert plan.sized_down and "sized down" in plan.describe()
    assert "RLIMIT_NOFILE" in plan.cap_note() and "1024" in plan.cap_note()


@pytest.mark.parametrize("hard", [65536, resource.RLIM_INFINITY])
def test_the_soft_limit_is_raised_as_far_as_the_full_caps_need(hard):
    limit = FakeLimit(1024, hard)
    plan = _plan(limit)
    assert limit.soft == FULL and plan.raised_from == 1024
    assert (plan.data_connections, plan.grpc_connections) == (DATA, GRPC)
    assert not plan.sized_down


def test_a_hard_limit_between_is_raised_to_and_sized_below():
    limit = FakeLimit(1024, 4096)
    plan = _plan(limit)
    assert limit.soft == 4096 and plan.raised_from == 1024
    assert plan.data_connections == (4096 - RESERVE_DESCRIPTORS - HANDSHAKING
                                     - REFUSING_AT_MOST) // 3


def test_a_refused_raise_keeps_the_limit_it_has():
    plan = _plan(FakeLimit(1024, 65536, refuse=True))
    assert (plan.soft, plan.raised_from, plan.data_connections) == (1024, None, 288)


@pytest.mark.parametrize("soft", [MIN_DESCRIPTORS, 300, 1024, 2048, 5000, FULL, 10 * FULL])
def test_every_descriptor_the_caps_can_take_is_within_the_limit(soft):
    plan = _plan(FakeLimit(soft, soft))
    used = (plan.data_connections + plan.handshaking + REFUSING_AT_MOST
            + plan.grpc_connections + RESERVE_DESCRIPTORS)
    assert used <= soft and plan.data_connections >= 1 and plan.grpc_connections >= 1


def test_too_few_descriptors_are_an_error_naming_the_limit():
    with pytest.raises(DescriptorError, match=r"RLIMIT_NOFILE is 128 .*at least 256"):
        _plan(FakeLimit(128, 128))


def _connected_pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return client, server


def test_receive_buffers_are_granted_while_their_total_allows():
    """Total 20 MiB: two connections get 4 MiB (8 MiB in the kernel), the
    third what is left (2 MiB, 4 in the kernel), the fourth the floor; one
    that ends gives its grant back. Linux doubles SO_RCVBUF: read back."""
    open_bytes = 4 << 20
    rmem_max = int(open("/proc/sys/net/core/rmem_max").read())
    if rmem_max < open_bytes:
        pytest.skip(f"net.core.rmem_max {rmem_max} caps SO_RCVBUF below 4 MiB")
    buffers = ReceiveBuffers(20 << 20, open_bytes=open_bytes)
    pairs = [_connected_pair() for _ in range(4)]
    try:
        for _, server in pairs:
            buffers.at_accept(server)
            assert server.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * FLOOR_BYTES
        got = [buffers.admit(i, server, None) for i, (_, server) in enumerate(pairs)]
        assert got == [8 << 20, 8 << 20, 4 << 20, 2 * FLOOR_BYTES]
        assert [s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for _, s in pairs] == got
        assert buffers.held_bytes == 20 << 20
        buffers.release(0)
        buffers.release(0)  # once only
        assert buffers.held_bytes == 12 << 20
        client, server = _connected_pair()
        pairs.append((client, server))
        assert buffers.admit(9, server, None) == 8 << 20
    finally:
        for client, server in pairs:
            client.close()
            server.close()


def test_one_job_takes_half_of_the_total_at_most():
    buffers = ReceiveBuffers(32 << 20, open_bytes=1 << 20)
    pairs = [_connected_pair() for _ in range(10)]
    try:
        greedy = [buffers.admit(i, s, "greedy") for i, (_, s) in enumerate(pairs[:9])]
        assert sum(b for b in greedy if b > 2 * FLOOR_BYTES) <= 16 << 20
        assert greedy[-1] == 2 * FLOOR_BYTES  # its share is gone
        assert buffers.admit(9, pairs[9][1], "good") == 2 << 20
    finally:
        for client, server in pairs:
            client.close()
            server.close()


def test_set_receive_buffer_takes_a_descriptor_and_leaves_it_open():
    client, server = _connected_pair()
    try:
        assert set_receive_buffer(server.fileno(), 1 << 17) == 1 << 18
        server.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)  # still open
    finally:
        client.close()
        server.close()


def test_under_a_stock_rmem_max_admitted_buffers_are_left_to_autotuning_and_counted_at_its_most():
    """net.core.rmem_max 208 KiB (stock) would fix a window too small for a
    fast link: admitted connections keep the kernel's autotuning, each
    counted at tcp_rmem's largest (6 MiB here); past the total, the floor."""
    floor = 16 << 10
    buffers = ReceiveBuffers(12 << 20, floor_bytes=floor, limits=(212992, 6 << 20))
    assert not buffers.fixes_open and "autotuning" in buffers.describe()
    pairs = [_connected_pair() for _ in range(3)]
    try:
        before = [s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for _, s in pairs]
        for _, server in pairs:
            buffers.at_accept(server)
        got = [buffers.admit(i, server, None) for i, (_, server) in enumerate(pairs)]
        assert got == [6 << 20, 6 << 20, 2 * floor]
        after = [s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for _, s in pairs]
        assert after[:2] == before[:2] and after[2] == 2 * floor  # only the third is fixed
        assert buffers.held_bytes == 12 << 20
    finally:
        for client, server in pairs:
            client.close()
            server.close()
