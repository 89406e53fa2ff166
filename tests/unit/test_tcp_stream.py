"""TcpStream against a scripted peer on loopback: one send per frame (header
in the message's headroom), replies from one reused receive buffer, and how
the stream ends."""

import socket
import struct
import threading

import grpc
import numpy as np
import pytest
from reducer_client.transport.base import HEADROOM, TransportError
from reducer_client.transport.tcp import TcpStream
from reducer_wire.codec import ShardEncoder, decode_shard, encode_shard
from reducer_wire.framing import HELLO, MAGIC, SHARD, recv_exactly, status_frame

pytestmark = pytest.mark.timeout(30)


def frame(kind, payload):
    return struct.pack("<BI", kind, len(payload)) + payload


def framed_request(key, values):
    """What the link hands a transport: headroom, then one Shard."""
    data = np.asarray(values, "<f4").tobytes()
    encoder = ShardEncoder(job="j", key=key, dtype=3, data_nbytes=len(data))
    buffer = np.empty(HEADROOM + encoder.nbytes, np.uint8)
    encoder.write_into(buffer[HEADROOM:])[:] = data
    return buffer.data


class Peer:
    """A one-connection daemon stand-in: reads what the client sends, writes
    what the test scripts."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conn = None
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(5)
        self.accepted.set()

    def read(self, nbytes):
        view = memoryview(bytearray(nbytes))
        assert recv_exactly(self.conn, view)
        return bytes(view)

    def read_frame(self):
        kind, length = struct.unpack("<BI", self.read(5))
        return kind, self.read(length)

    def close(self):
        for sock in (self.conn, self.listener):
            if sock is not None:
                sock.close()


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


def test_requests_go_out_framed_then_the_half_close(peer):
    requests = [framed_request("a", [1, 2]), framed_request("b", [3])]
    stream = TcpStream("127.0.0.1", peer.port, "tok", iter(requests), 1 << 20)
    stream.connect()
    assert peer.accepted.wait(5)
    assert peer.read(len(MAGIC)) == MAGIC and peer.read_frame() == (HELLO, b"tok")
    for request, key in zip(requests, "ab", strict=True):
        kind, payload = peer.read_frame()
        assert kind == SHARD and payload == bytes(request[HEADROOM:])
        assert decode_shard(payload).key == key
    assert peer.conn.recv(1) == b""  # the end of the requests half-closes
    peer.conn.sendall(status_frame(grpc.StatusCode.OK, ""))
    assert list(stream) == []


def test_replies_share_one_receive_buffer_and_status_ok_ends(peer):
    replies = [encode_shard(job="j", key=k, dtype=3, data=np.full(n, v, "<f4").tobytes())
               for k, n, v in (("a", 4, 1.0), ("b", 2, 2.0), ("c", 4, 3.0))]
    stream = TcpStream("127.0.0.1", peer.port, "", iter(()), 1 << 20)
    stream.connect()
    assert peer.accepted.wait(5)
    peer.conn.sendall(b"".join(frame(SHARD, r) for r in replies)
                      + status_frame(grpc.StatusCode.OK, ""))
    seen, buffers = [], []
    for reply in stream:  # each reply is consumed before the next is asked for
        seen.append((reply.key, np.frombuffer(reply.data, "<f4").tolist()))
        buffers.append(np.frombuffer(reply.data, np.uint8))
    assert seen == [("a", [1.0] * 4), ("b", [2.0] * 2), ("c", [3.0] * 4)]
    assert np.shares_memory(buffers[0], buffers[2])  # no allocation per reply


@pytest.mark.parametrize("script,code,words", [
    (b"", grpc.StatusCode.UNAVAILABLE, "closed the connection"),
    (frame(SHARD, b"\x0a\x01j")[:-1], grpc.StatusCode.UNAVAILABLE, "connection broke"),
    (struct.pack("<BI", SHARD, 2 << 20), grpc.StatusCode.INTERNAL, "larger than the limit"),
    (frame(9, b""), grpc.StatusCode.INTERNAL, "unexpected frame kind 9"),
    (status_frame(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many data connections"),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "too many data connections"),
])
def test_how_a_stream_breaks(peer, script, code, words):
    stream = TcpStream("127.0.0.1", peer.port, "", iter(()), 1 << 20)
    stream.connect()
    assert peer.accepted.wait(5)
    peer.conn.sendall(script)
    peer.conn.shutdown(socket.SHUT_WR)
    with pytest.raises(TransportError) as info:
        list(stream)
    assert info.value.code == code and words in info.value.details
