"""Plain-TCP frames read on a loop, the event loop's (reducerd.dataplane.loop_reader) or
the C loop's (reducerd.dataplane.cloop), live.

Past its handshake a plain-TCP connection holds no thread of the daemon's; a
payload waits in the kernel until it is whole, so stalled payloads hold
neither memory nor a receive slot of the daemon's; payloads above WHOLE_MAX,
read in pieces, wait for one of the plane's BACKLOG_FRAMES slots and are
each served in turn; half-closing after partial frames is answered as
before. Raw connections speak reducer_wire.framing by hand.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from raw_frames import HELLO_OK, data_port, frame, split_frames, status_of
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import decode_shard, encode_shard
from reducer_wire.framing import SHARD
from support import limited_daemon, start_daemon

from reducerd.bench.procs import proc_status
from reducerd.dataplane.base import BACKLOG_FRAMES
from reducerd.dataplane.recvside import WHOLE_MAX

# Every test on each loop that reads plain-TCP frames (conftest.data_loop).
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("data_loop")]


def shard(key: str, values: np.ndarray, rank: int = 0, world_size: int = 1) -> bytes:
    return frame(SHARD, encode_shard(job="loop", key=key, rank=rank, world_size=world_size,
                                     dtype=pb.DTYPE_FLOAT16, op=pb.REDUCE_OP_SUM,
                                     data=values.astype("<f2").tobytes()))


def read_frames(sock: socket.socket, count: int, within_s: float) -> list[tuple[int, bytes]]:
    deadline = time.monotonic() + within_s
    received = b""
    while True:
        frames, _ = split_frames(received)
        if len(frames) >= count:
            return frames
        assert time.monotonic() < deadline, f"{len(frames)} of {count} frames"
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed after {len(frames)} of {count} frames"
        received += chunk


def finish_and_check(sock: socket.socket, rest: bytes, key: str, value: float) -> None:
    """Send the rest of a world-size-1 shard; its reply comes within 10 s, the sum right."""
    sock.sendall(rest)
    (kind, payload), = read_frames(sock, 1, 10)
    assert kind == SHARD, payload
    reply = decode_shard(payload)
    assert reply.key == key
    assert np.all(np.frombuffer(reply.data, "<f2") == value)


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon("--round-timeout", "30", log_dir=tmp_path)
    yield d
    d.stop()


def test_connections_past_their_handshake_hold_no_thread(daemon):
    """48 connections, each served a shard and left open: the daemon's threads
    do not grow with them (a reader thread per connection would add 48)."""
    host = daemon.address.rpartition(":")[0]
    port = data_port(daemon.address)
    socks = []
    try:
        for i in range(48):
            sock = socket.create_connection((host, port), timeout=10)
            socks.append(sock)
            values = np.arange(64.0) + i
            sock.sendall(HELLO_OK + shard(f"k{i}", values))
            (kind, payload), = read_frames(sock, 1, 10)
            assert kind == SHARD
            got = np.frombuffer(decode_shard(payload).data, "<f2")
            assert np.array_equal(got, values.astype(np.float16))
        # The handshakes' threads end once their connection is handed to the loop.
        deadline = time.monotonic() + 5
        pid = daemon.process.pid
        while (threads := proc_status(pid)["Threads"]) > 24 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threads <= 24, threads
    finally:
        for sock in socks:
            sock.close()


def test_stalled_payloads_wait_in_the_kernel_not_in_the_daemon(tmp_path):
    """40 connections (more than BACKLOG_FRAMES) each send a 2 MiB payload but
    its last 4 KiB, and stall: the daemon allocates nothing for them (RSS grows
    by far less than one slot's worth per BACKLOG_FRAMES: the reader used to
    hold 16 buffers of 2 MiB, 32 MiB) and holds no receive slot, so when the
    payloads are finished in reverse order, each is answered at once (a
    connection that waited for a slot used to wait for the stalled ones)."""
    daemon = limited_daemon("--round-timeout", "30", log_dir=tmp_path)  # under RLIMIT_AS
    host, port = daemon.address.rpartition(":")[0], data_port(daemon.address)
    count, elements = BACKLOG_FRAMES + 24, 1 << 20  # float16: 2 MiB each
    frames = [shard(f"stall{i}", np.full(elements, float(i % 50))) for i in range(count)]
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
    try:
        for sock in socks:  # handshakes and first frames' windows settle first
            sock.sendall(HELLO_OK)
        time.sleep(0.3)
        before = proc_status(daemon.process.pid)["VmRSS"]
        for sock, whole in zip(socks, frames, strict=True):
            sock.sendall(whole[:-4096])
        time.sleep(0.5)
        grown = proc_status(daemon.process.pid)["VmRSS"] - before
        assert grown < 8 << 20, f"RSS +{grown / 2**20:.1f} MiB for {count} stalled payloads"
        for i in reversed(range(count)):
            finish_and_check(socks[i], frames[i][-4096:], f"stall{i}", i % 50)
    finally:
        for sock in socks:
            sock.close()
        daemon.stop()


def test_payloads_read_in_pieces_beyond_the_receive_slots_are_each_served_in_turn(daemon):
    """Payloads above WHOLE_MAX are read in pieces, each holding one of the
    plane's receive slots. More connections than BACKLOG_FRAMES each start one
    and stall in it: the first BACKLOG_FRAMES hold the slots, the others wait
    with their headers read. As the stalled payloads are finished one by one,
    every waiting connection gets a slot in turn, and every sum is right."""
    host = daemon.address.rpartition(":")[0]
    port = data_port(daemon.address)
    count, elements = BACKLOG_FRAMES + 4, WHOLE_MAX // 2 + 4096
    frames = [shard(f"slot{i}", np.full(elements, float(i % 50))) for i in range(count)]
    socks: list[socket.socket] = []
    try:
        # The slot holders first, then the waiters: connections reach the
        # loop through handshake threads, in no fixed order, and a waiter
        # finished before the holders would wait for them (by design).
        for group in (frames[:BACKLOG_FRAMES], frames[BACKLOG_FRAMES:]):
            for whole in group:
                sock = socket.create_connection((host, port), timeout=10)
                socks.append(sock)
                sock.sendall(HELLO_OK + whole[:600])  # the header and part of the payload
            time.sleep(0.5)
        for i, (sock, whole) in enumerate(zip(socks, frames, strict=True)):
            finish_and_check(sock, whole[600:], f"slot{i}", i % 50)
    finally:
        for sock in socks:
            sock.close()


def test_a_half_close_after_shards_sent_in_pieces_ends_with_ok(daemon):
    """Two shards of world size 2 from two connections, each sent a few bytes at
    a time (so each frame takes several reads), then both half-close: both get
    the sums and then OK."""
    host = daemon.address.rpartition(":")[0]
    port = data_port(daemon.address)
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
    try:
        wholes = [HELLO_OK + shard(f"pieces{k}", np.full(1000, rank + 1.0), rank, 2)
                  for rank in range(2) for k in range(2)]
        streams = [wholes[0] + wholes[1][len(HELLO_OK):], wholes[2] + wholes[3][len(HELLO_OK):]]
        for offset in range(0, max(map(len, streams)), 777):
            for sock, data in zip(socks, streams, strict=True):
                if offset < len(data):
                    sock.sendall(data[offset:offset + 777])
            time.sleep(0.005)
        for sock in socks:
            sock.shutdown(socket.SHUT_WR)
        for sock in socks:
            frames = read_frames(sock, 3, 10)
            assert [kind for kind, _ in frames[:2]] == [SHARD, SHARD]
            for _, payload in frames[:2]:
                assert np.all(np.frombuffer(decode_shard(payload).data, "<f2") == 3.0)
            assert status_of(frames)[0] == 0, frames  # OK
    finally:
        for sock in socks:
            sock.close()


def test_the_daemon_says_which_loop_reads_its_frames(daemon, data_loop):
    """--data-loop / $REDUCERD_DATA_LOOP picks the loop; the log says which."""
    wanted = {"c": "C", "python": "Python"}[data_loop]
    assert f"plain-TCP frames read by the {wanted} loop" in daemon.log()
