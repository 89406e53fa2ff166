"""The data plane's selector state machine (reducerd.dataio, dataconn, dataframes)
against raw clients on loopback, with a stand-in session on a real asyncio loop
thread: large replies to a client that reads late arrive intact (partial
sends resume, under TLS too); a frame that finds no memory waits without
reading, then is read when room comes back, or is refused after
RESERVE_WAIT_S; connections that stopped reading for room (their credit, the
plane's backlog) read on when the loop takes their frames; stop() ends every
connection and leaves no thread behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import socket
import struct
import threading
import time
import types

import grpc
import numpy as np
import pytest
from reducer_wire.codec import encode_shard
from reducer_wire.framing import HELLO, MAGIC, SHARD, STATUS, frame_header

from reducerd import dataframes
from reducerd.access import Access
from reducerd.dataframes import ROOM
from reducerd.dataplane import DataPlane
from reducerd.dataroom import Room
from reducerd.limits import MemoryBudget
from reducerd.replies import Reply

pytestmark = pytest.mark.timeout(60)

HELLO_OK = MAGIC + frame_header(HELLO, 0)
MiB = 1 << 20


class EchoSession:
    """Stands in for reducerd.session.Session (loop thread): shard "k<i>" is
    answered with a reply of `reply_bytes` bytes, all equal to i % 251; while
    `gate` is clear the loop thread waits in accept (the loop falls behind)."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.table = types.SimpleNamespace(budget=budget)
        self.draining = False
        self.streams: set = set()
        self.keys: list[str] = []
        self.reply_bytes = 16
        self.gate = threading.Event()
        self.gate.set()

    def open_stream(self, stream) -> None:
        self.streams.add(stream)

    def close_stream(self, stream) -> None:
        self.streams.discard(stream)

    def accept(self, shard, stream) -> bool:
        assert self.gate.wait(20)
        self.keys.append(shard.key)
        frame = np.empty(5 + self.reply_bytes, np.uint8)
        frame[:5] = np.frombuffer(frame_header(SHARD, self.reply_bytes), np.uint8)
        frame[5:] = int(shard.key[1:]) % 251
        stream.outbox.put_nowait(Reply(frame.data, frame[5:].data, frame.nbytes))
        return True


@contextlib.contextmanager
def serving(budget: MemoryBudget | None = None, tls_context=None, io_threads: int = 2):
    """A DataPlane on 127.0.0.1 over an EchoSession; stopped, and its loop closed, after."""
    budget = budget or MemoryBudget(1 << 30)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    session = EchoSession(budget)
    plane = DataPlane(session, loop, Access(None), max_message_bytes=64 * MiB,  # type: ignore
                      send_timeout_s=10, tls_context=tls_context, budget=budget,
                      io_threads=io_threads)
    port = plane.start("127.0.0.1", 0)
    try:
        yield plane, session, port
    finally:
        session.gate.set()
        loop.call_soon_threadsafe(plane.stop)
        time.sleep(0.1)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
        loop.close()


def shard_frame(i: int, nbytes: int = 64) -> bytes:
    message = encode_shard(job="j", key=f"k{i}", world_size=1, dtype=3, data=bytes(nbytes))
    return frame_header(SHARD, len(message)) + message


def read_all(sock) -> bytes:
    received = bytearray()
    while chunk := sock.recv(1 << 20):
        received += chunk
    return bytes(received)


def split(received: bytes) -> list[tuple[int, bytes]]:
    frames, view = [], memoryview(received)
    while view:
        kind, length = struct.unpack_from("<BI", view)
        frames.append((kind, bytes(view[5:5 + length])))
        view = view[5 + length:]
    return frames


def status(payload: bytes) -> tuple[int, str]:
    return struct.unpack_from("<I", payload)[0], payload[4:].decode()


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def connections(plane: DataPlane) -> list:
    with plane._lock:
        return list(plane._connections)


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory):
    x509 = pytest.importorskip("cryptography.x509")
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    from reducer_wire.tls import client_context, server_context

    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .sign(key, hashes.SHA256()))
    (d / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    (d / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return server_context(str(d / "c.pem"), str(d / "k.pem")), client_context(str(d / "c.pem"))


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_large_replies_to_a_client_that_reads_late_arrive_intact(tls, tls_contexts):
    """Replies far larger than the socket buffers, to a client that reads
    nothing for a while: each send stops part way (the socket is selected for
    writing) and resumes where it stopped; every byte arrives once, in order."""
    server, client = tls_contexts if tls else (None, None)
    with serving(tls_context=server) as (plane, session, port):
        session.reply_bytes = 6 * MiB
        raw = socket.create_connection(("127.0.0.1", port), timeout=20)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock = client.wrap_socket(raw, server_hostname="localhost") if tls else raw
        with sock:
            sock.sendall(HELLO_OK + b"".join(shard_frame(i) for i in range(3)))
            assert wait_for(lambda: len(session.keys) == 3)
            conn = connections(plane)[0]
            assert wait_for(lambda: conn._mask & selectors.EVENT_WRITE)  # a send stopped
            time.sleep(0.3)
            # Half-close (under TLS too, as the client does: the socket's sending
            # side; SSLSocket.shutdown would also drop its TLS state).
            socket.socket.shutdown(sock, socket.SHUT_WR)
            frames = split(read_all(sock))
    assert [kind for kind, _ in frames] == [SHARD, SHARD, SHARD, STATUS]
    for i, (_, payload) in enumerate(frames[:3]):
        assert len(payload) == 6 * MiB
        assert np.all(np.frombuffer(payload, np.uint8) == i), i
    assert status(frames[3][1]) == (0, "")
    assert plane.budget.transport_bytes == 0


def test_a_frame_without_memory_waits_unread_then_is_read_when_room_comes_back():
    budget = MemoryBudget(1 * MiB)
    budget.take_transport(900 << 10)  # someone else holds most of it
    with serving(budget) as (plane, session, port):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            sock.sendall(HELLO_OK + shard_frame(0, 200 << 10))
            time.sleep(0.4)
            assert session.keys == []
            conn = connections(plane)[0]
            assert conn.state == dataframes.RESERVE and not conn._mask  # nothing is read
            budget.give_transport(900 << 10)  # given back without telling the plane
            assert wait_for(lambda: session.keys == ["k0"], 2)
            sock.shutdown(socket.SHUT_WR)
            frames = split(read_all(sock))
    assert [kind for kind, _ in frames] == [SHARD, STATUS]
    assert status(frames[1][1]) == (0, "")
    assert budget.transport_bytes == 0


def test_a_frame_that_finds_no_memory_within_the_wait_is_refused(monkeypatch):
    monkeypatch.setattr(dataframes, "RESERVE_WAIT_S", 0.5)
    budget = MemoryBudget(1 * MiB)
    budget.take_transport(900 << 10)
    with serving(budget) as (plane, session, port):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            start = time.monotonic()
            sock.sendall(HELLO_OK + shard_frame(0, 200 << 10))
            frames = split(read_all(sock))  # the daemon ends the connection
            elapsed = time.monotonic() - start
    assert 0.45 < elapsed < 3, elapsed
    assert [kind for kind, _ in frames] == [STATUS]
    code, message = status(frames[0][1])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "does not fit" in message and "--max-inflight-bytes" in message
    assert session.keys == [] and budget.transport_bytes == 900 << 10


def test_connections_waiting_for_room_read_on_when_the_loop_takes_their_frames():
    """The loop falls behind: each connection stops reading at its credit, and
    all together at the plane's backlog (the bytes stay in the kernel); once
    the loop takes frames again every one of them is read and answered."""
    with serving() as (plane, session, port):
        plane.room = Room(per_connection=4, backlog=6)
        session.gate.clear()
        socks = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(2)]
        try:
            for n, sock in enumerate(socks):
                sock.sendall(HELLO_OK + b"".join(shard_frame(100 * n + i) for i in range(10)))
            assert wait_for(lambda: sum(c.queued for c in connections(plane)) == 6)
            time.sleep(0.3)  # and no more: each waits, not reading
            conns = connections(plane)
            assert sum(c.queued for c in conns) == 6
            assert all(c.queued <= 4 for c in conns)
            assert all(c.state == ROOM and not c._mask & selectors.EVENT_READ for c in conns)
            session.gate.set()
            for sock in socks:
                sock.shutdown(socket.SHUT_WR)
            replies = [split(read_all(sock)) for sock in socks]
        finally:
            for sock in socks:
                sock.close()
    for n, frames in enumerate(replies):
        assert [kind for kind, _ in frames] == [SHARD] * 10 + [STATUS]
        assert [p[0] for _, p in frames[:10]] == [(100 * n + i) % 251 for i in range(10)]
    assert sorted(session.keys) == sorted(f"k{100 * n + i}" for n in range(2) for i in range(10))
    assert plane.room.free == 6


def test_stop_ends_every_connection_and_leaves_no_thread():
    with serving(io_threads=2) as (plane, session, port):
        ready = socket.create_connection(("127.0.0.1", port), timeout=20)
        ready.sendall(HELLO_OK)
        shaking = socket.create_connection(("127.0.0.1", port), timeout=20)
        shaking.sendall(MAGIC[:3])
        assert wait_for(lambda: plane.connections == 1 and plane.handshaking == 1)
        plane.loop.call_soon_threadsafe(plane.stop)
        frames = split(read_all(ready))
        assert len(frames) == 1 and frames[0][0] == STATUS
        assert status(frames[0][1]) == (grpc.StatusCode.UNAVAILABLE.value[0],
                                        "reducerd is shutting down")
        try:
            assert shaking.recv(1 << 16) == b""  # closed without a word
        except ConnectionResetError:
            pass
        ready.close()
        shaking.close()
        assert wait_for(lambda: not any(t.alive for t in plane.pool.threads), 5)
        assert wait_for(lambda: not any(t.name == "reducerd-data-accept"
                                        for t in threading.enumerate()), 2)
        assert plane.connections == 0 and plane.handshaking == 0
        assert plane._listener is not None and plane._listener.fileno() == -1


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_connections_that_come_and_go_leave_no_fd_behind():
    """Served, refused and cut connections, then stop(): every socket, the
    selectors and the wake-up sockets are closed once the threads end."""
    before = open_fds()
    with serving(io_threads=2) as (plane, session, port):
        for i in range(30):  # served: a shard, the half-close, OK
            with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                sock.sendall(HELLO_OK + shard_frame(i))
                sock.shutdown(socket.SHUT_WR)
                assert [kind for kind, _ in split(read_all(sock))] == [SHARD, STATUS]
        for _ in range(10):  # refused: not this protocol
            with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                sock.shutdown(socket.SHUT_WR)
                assert split(read_all(sock))[0][0] == STATUS
        for i in range(10):  # cut in the middle of a frame
            with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                sock.sendall(HELLO_OK + shard_frame(i)[:-3])
        assert wait_for(lambda: plane.connections == 0 and plane.handshaking == 0)
        plane.loop.call_soon_threadsafe(plane.stop)
        assert wait_for(lambda: not any(t.alive for t in plane.pool.threads), 5)
        assert wait_for(lambda: plane._listener is not None
                        and plane._listener.fileno() == -1, 2)
    assert open_fds() == before
