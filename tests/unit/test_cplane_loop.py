"""The C data loop (reducerd.dataplane._cplane) on loopback: frames in, replies out, ends."""

from __future__ import annotations

import os
import select
import socket
import struct
import time

import pytest

_cplane = pytest.importorskip("reducerd.dataplane._cplane")
_budget = pytest.importorskip("reducerd.core._budget")

SHARD, HELLO, STATUS = 2, 1, 3


def frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<BI", kind, len(payload)) + payload


class Rig:
    def __init__(self, limit=64 << 20, max_message=1 << 20, frame_timeout_s=5.0,
                 send_timeout_s=5.0, linger_s=0.5, reserve_wait_s=0.3, slots=16,
                 unsent_frames=64, unsent_bytes=16 << 20, rcvbuf=None):
        self.budget = _budget.Budget(limit)
        self.loop = _cplane.Loop(self.budget, max_message, frame_timeout_s, send_timeout_s,
                                 linger_s, reserve_wait_s, slots, unsent_frames, unsent_bytes)
        self.loop.start()
        listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(listener.getsockname())
        self.server, _ = listener.accept()
        listener.close()
        self.server.setblocking(False)
        if rcvbuf is not None:  # fixed before the loop sees it, as receive_buffers does
            self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.fd = self.server.fileno()
        self.loop.add(7, self.fd, None)

    def events(self, want: int, timeout_s: float = 5.0) -> list:
        got: list = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            select.select([self.loop], [], [], 0.1)
            got.extend(self.loop.take())
        return got

    def close(self):
        self.loop.stop()
        self.client.close()
        self.server.close()


@pytest.fixture
def rig():
    made = []

    def make(**kw):
        made.append(Rig(**kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_frames_arrive_whole_and_their_memory_comes_back(rig):
    r = rig()
    payloads = [os.urandom(n) for n in (0, 1, 300_000, 5)]
    r.client.sendall(b"".join(frame(SHARD, p) for p in payloads))
    events = r.events(4)
    assert [e[0] for e in events] == [_cplane.EV_FRAME] * 4
    assert [bytes(memoryview(e[2])) for e in events] == payloads
    assert r.budget.transport_bytes == sum(map(len, payloads))
    assert r.loop.payloads == 4
    del events
    assert r.budget.transport_bytes == 0 and r.loop.payloads == 0


def test_replies_go_out_in_priority_order_then_the_status_and_the_close(rig):
    r = rig()
    r.client.sendall(frame(SHARD, b"x"))
    assert r.events(1)[0][0] == _cplane.EV_FRAME
    # Paused sends: fill the queue before the loop runs it is racy, so check
    # order among what queues behind a part-sent reply.
    # Larger than the kernel can buffer on both ends (tcp_wmem + tcp_rmem
    # maxima), so the small replies queue behind it whatever the timing.
    big = frame(SHARD, b"B" * (_kernel_buffering_bytes() + (8 << 20)))
    r.budget.take_transport(len(big))
    r.loop.send(7, r.fd, big, 0, None, len(big))
    for name, prio in ((b"a", 0), (b"b", 5), (b"c", 9), (b"d", 5), (b"e", 0)):
        r.budget.take_transport(6)
        r.loop.send(7, r.fd, frame(SHARD, name), prio, None, 6)
    r.loop.end(7, r.fd, frame(STATUS, struct.pack("<I", 0)))
    r.client.shutdown(socket.SHUT_WR)
    received = b""
    r.client.settimeout(5)
    while chunk := r.client.recv(1 << 20):
        received += chunk
    assert received[:len(big)] == big
    rest = received[len(big):]
    kinds = [rest[i * 6 + 5:i * 6 + 6] for i in range(5)]
    assert kinds == [b"c", b"b", b"d", b"a", b"e"]
    assert rest[30:] == frame(STATUS, struct.pack("<I", 0))
    events = r.events(2)
    assert [e[0] for e in events] == [_cplane.EV_HALF_CLOSE, _cplane.EV_CLOSED]
    r.loop.take()
    assert r.budget.transport_bytes == 0


@pytest.mark.parametrize("data, message", [
    (frame(HELLO, b"hi") + frame(SHARD, b"z"), "unexpected frame kind 1 after HELLO"),
    (struct.pack("<BI", 9, 1), "unknown frame kind 9"),
    (struct.pack("<BI", SHARD, 2 << 20),
     "frame of 2097152 bytes is larger than the limit of 1048576 bytes"),
])
def test_a_bad_frame_ends_the_stream_with_framings_message(rig, data, message):
    r = rig()
    r.client.sendall(data)
    events = r.events(1)
    assert events[0][:4] == (_cplane.EV_END, 7, 3, message)
    assert r.budget.transport_bytes == 0


def test_a_payload_late_past_the_frame_timeout_is_deadline_exceeded(rig):
    r = rig(frame_timeout_s=0.3)
    r.client.sendall(struct.pack("<BI", SHARD, 1000) + b"x" * 10)
    start = time.monotonic()
    events = r.events(1)
    assert 0.25 < time.monotonic() - start < 3
    assert events[0][:3] == (_cplane.EV_END, 7, 4)
    assert events[0][3] == ("a frame of 1000 bytes did not arrive within 0.3 s of its header "
                            "(10 of 1000 bytes arrived by the deadline)")
    assert r.budget.transport_bytes == 0 and r.loop.payloads == 0


def test_a_frame_without_room_is_refused_after_the_wait(rig):
    r = rig(limit=1000)
    assert r.budget.take_accumulator(900)
    r.client.sendall(frame(SHARD, b"y" * 200))
    start = time.monotonic()
    events = r.events(1)
    assert 0.25 < time.monotonic() - start < 3
    assert events[0] == (_cplane.EV_NO_ROOM, 7, 200, None)
    assert r.budget.pressure >= 1 and r.budget.transport_bytes == 0


def test_a_client_that_reads_no_replies_is_read_no_further(rig):
    r = rig(unsent_frames=4, send_timeout_s=30)
    reply = frame(SHARD, b"r" * (4 << 20))
    for _ in range(8):  # more than the socket buffers hold: 4 or more wait unsent
        r.loop.send(7, r.fd, reply, 0, None, 0)
    time.sleep(0.2)
    r.client.sendall(frame(SHARD, b"q"))
    assert r.events(1, timeout_s=0.5) == []  # 4 unsent: no frame is read
    r.client.setblocking(True)
    r.client.settimeout(5)
    drained = 0
    while drained < 8 * len(reply) - (1 << 20):
        drained += len(r.client.recv(1 << 20))
    assert [e[0] for e in r.events(1)] == [_cplane.EV_FRAME]


def test_a_reset_connection_is_closed_once(rig):
    r = rig()
    r.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    r.client.sendall(struct.pack("<BI", SHARD, 100))
    time.sleep(0.1)
    r.client.close()
    events = r.events(1)
    assert [e[0] for e in events] == [_cplane.EV_CLOSED]
    assert r.events(1, timeout_s=0.3) == []
    assert r.budget.transport_bytes == 0


def test_a_sent_replys_bytes_come_back_without_python_taking_events(rig):
    """A reply's bytes leave its job's share once sent, on the loop thread: a
    job whose clients read must not wait for Python's next wake-up for room."""
    r = rig()
    reply = frame(SHARD, b"r" * 1000)
    r.budget.take_transport(len(reply), "j")
    r.loop.send(7, r.fd, reply, 0, "j", len(reply))
    r.client.settimeout(5)
    got = b""
    while len(got) < len(reply):
        got += r.client.recv(1 << 16)
    assert got == reply
    deadline = time.monotonic() + 5
    while r.budget.job_transport_bytes("j") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.budget.job_transport_bytes("j") == 0 and r.budget.transport_bytes == 0


def test_a_payload_waits_in_the_kernel_until_whole(rig):
    """Below WHOLE_MAX a payload is not received (no buffer, no slot) until all
    of it is there; then it arrives whole."""
    r = rig()
    payload = os.urandom(200_000)
    data = frame(SHARD, payload)
    r.client.sendall(data[:-1000])
    assert r.events(1, timeout_s=0.3) == []
    assert r.loop.payloads == 0  # no slot, no buffer for the stalled payload
    r.client.sendall(data[-1000:])
    (event,) = r.events(1)
    assert event[0] == _cplane.EV_FRAME and bytes(memoryview(event[2])) == payload


def test_a_payload_larger_than_a_fixed_receive_buffer_is_read_in_pieces(rig):
    """Under a fixed SO_RCVBUF (reducerd.ops.receive_buffers' floor) the kernel
    cannot hold the payload whole: it is read in pieces, and a last piece
    smaller than the earlier low-water marks still wakes the loop."""
    import threading

    r = rig(rcvbuf=64 << 10)
    payload = os.urandom(1 << 20)
    data = frame(SHARD, payload)
    sender = threading.Thread(target=r.client.sendall, args=(data[:-1000],), daemon=True)
    sender.start()
    sender.join(5)
    assert not sender.is_alive()  # all but the last 1000 bytes were taken in pieces
    time.sleep(0.2)
    r.client.sendall(data[-1000:])
    (event,) = r.events(1, timeout_s=2)
    assert event[0] == _cplane.EV_FRAME and bytes(memoryview(event[2])) == payload


def _kernel_buffering_bytes():
    """The most a loopback connection's send and receive buffers can hold together."""
    total = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            with open(f"/proc/sys/net/ipv4/{name}") as f:
                total += int(f.read().split()[2])
        except (OSError, ValueError, IndexError):
            total += 32 << 20
    return total
