"""The client's C loop (transport/_tcploop.c) against the Python codec, bit for bit.

Frames: encode() must give, per chunk, the frame header and the bytes of
reducer_wire.codec.ShardEncoder with the payload of convert.to_wire, for
every wire dtype and float32 / float16 input. Replies: the loop, attached to
one end of a socketpair whose other end plays the daemon here, must widen
each reply into the output exactly as convert.from_wire does, and report
in-band errors, wrong replies, a broken connection (with the chunks it
leaves) and keep SendOrder's credits. Every wait is bounded.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

import numpy as np
import pytest
from reducer_client import fastpath
from reducer_wire import convert, dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardEncoder, decode_shard, encode_shard
from reducer_wire.framing import SHARD, STATUS, frame_header, recv_exactly
from reducer_wire.layout import Chunk

pytestmark = pytest.mark.skipif(not fastpath.available(), reason="the C loop was not built")

if fastpath.available():
    from reducer_client.transport import _tcploop

WIRES = sorted(dtypes.WIRE_DTYPES)
CODECS = fastpath._codecs()
FIELDS = dict(job="job-é", rank=3, world_size=8, round=7, op=pb.REDUCE_OP_MEAN,
              priority=5, incarnation=(1 << 63) + 12345)
LAYOUTS = (0x1234_5678_9ABC_DEF0, 42)


def values_for(numel: int, dtype: np.dtype, seed: int = 0) -> np.ndarray:
    """Gradient-like values with the edge cases each wire must carry: zeros of
    both signs, infinities, float16 subnormals and overflow, ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(numel) * 10.0 ** rng.integers(-8, 5, numel)).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 6e-8, 1e-5, 65520.0, 1.0 + 2 ** -11,
                         3.4e38], dtype=np.float32)
    n = min(numel, specials.size)
    x[:n] = specials[:n]
    with np.errstate(over="ignore"):  # float16 input: the large ones become inf
        return x.astype(dtype)


def plan(numel: int, chunk_numel: int) -> list[Chunk]:
    chunks, offset = [], 0
    while offset < numel:
        size = min(chunk_numel, numel - offset)
        chunks.append(Chunk(offset, size, len(chunks) % 2))
        offset += size
    return chunks


def encode(values, wire: int, chunks, base: int = 0, spare=None):
    codec, param = CODECS[wire]
    return _tcploop.encode(key="the key", dtype=wire, layouts=LAYOUTS, chunks=chunks,
                           codec=codec, param=param, values=values,
                           f16_in=values is not None and values.dtype == np.float16,
                           base=base, spare=spare, **FIELDS)


@pytest.mark.parametrize("in_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("wire_name", WIRES)
def test_frames_are_the_python_encoders_bytes(wire_name, in_dtype):
    wire = dtypes.WIRE_DTYPES[wire_name]
    values = values_for(1000, np.dtype(in_dtype))
    chunks = plan(values.size, 384)  # 384: three int8 blocks, then a partial one
    batch = encode(values, wire, chunks)
    assert batch.chunks == len(chunks)
    for i, chunk in enumerate(chunks):
        part = values[chunk.offset:chunk.offset + chunk.numel]
        encoder = ShardEncoder(job=FIELDS["job"], key="the key", rank=3, world_size=8, round=7,
                               offset=chunk.offset, dtype=wire, op=pb.REDUCE_OP_MEAN,
                               layout=LAYOUTS[chunk.daemon],
                               data_nbytes=dtypes.wire_nbytes(wire, chunk.numel), priority=5,
                               incarnation=FIELDS["incarnation"])
        expected = encoder.join(convert.to_wire(part, wire).tobytes())
        frame = batch.frame(i)
        assert frame[:5] == frame_header(SHARD, len(expected))
        assert frame[5:] == expected, f"chunk {i}"


def test_broadcast_zeros_and_a_slice_base():
    """values=None sends -0.0 (float32 wire only); base offsets into a slice."""
    batch = encode(None, pb.DTYPE_FLOAT32, plan(10, 4))
    shard = decode_shard(batch.frame(1)[5:])
    assert np.frombuffer(shard.data, "<f4").tobytes() == np.full(4, -0.0, "<f4").tobytes()
    values = values_for(6, np.dtype(np.float32))
    sliced = encode(values, pb.DTYPE_FLOAT32, [Chunk(100, 6, 0)], base=100)
    assert decode_shard(sliced.frame(0)[5:]).offset == 100
    assert bytes(decode_shard(sliced.frame(0)[5:]).data) == values.tobytes()
    with pytest.raises(ValueError, match="outside the values"):
        encode(values, pb.DTYPE_FLOAT32, [Chunk(0, 7, 0)])
    with pytest.raises(ValueError, match="only float32"):
        encode(None, pb.DTYPE_FLOAT16, [Chunk(0, 4, 0)])


def test_a_spare_batch_is_laid_out_again_in_place():
    values = values_for(512, np.dtype(np.float32))
    first = encode(values, pb.DTYPE_FLOAT16, plan(512, 128))
    again = encode(values[::-1].copy(), pb.DTYPE_FLOAT16, plan(512, 128), spare=first)
    assert again is first
    assert again.frame(0)[5:] == encode(values[::-1].copy(), pb.DTYPE_FLOAT16,
                                        plan(512, 128)).frame(0)[5:]


class Peer:
    """The daemon's end of a socketpair per link: reads frames, answers them."""

    def __init__(self, links: int = 2):
        self.events: queue.Queue = queue.Queue()
        self.loop = _tcploop.Loop(links, lambda *e: self.events.put(e), 0.05, 0.5)
        self.socks = []
        self.gens = []
        for link in range(links):
            ours, theirs = socket.socketpair()
            self.gens.append(self.loop.attach(link, ours.detach(), 1 << 24))
            self.socks.append(theirs)
            theirs.settimeout(5)

    def read(self, link: int):
        header = bytearray(5)
        assert recv_exactly(self.socks[link], memoryview(header))
        length = int.from_bytes(header[1:], "little")
        body = bytearray(length)
        assert recv_exactly(self.socks[link], memoryview(body))
        return decode_shard(bytes(body))

    def reply(self, link: int, **fields):
        message = encode_shard(job="job-é", **fields)
        self.socks[link].sendall(frame_header(SHARD, len(message)) + message)

    def event(self, timeout_s: float = 5.0):
        return self.events.get(timeout=timeout_s)

    def close(self):
        self.loop.close()
        for sock in self.socks:
            sock.close()


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


def answer_all(peer: Peer, count: int, make_data) -> None:
    """Answer `count` frames, taking them from either link as they come."""
    done = 0
    while done < count:
        for link in range(2):
            peer.socks[link].settimeout(0.05)
            try:
                shard = peer.read(link)
            except (TimeoutError, AssertionError):
                continue
            finally:
                peer.socks[link].settimeout(5)
            peer.reply(link, key=shard.key, round=shard.round, offset=shard.offset,
                       dtype=shard.dtype, data=make_data(shard))
            done += 1


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("wire_name", WIRES)
def test_replies_are_widened_like_from_wire(peer, wire_name, out_dtype):
    """Each reply's payload (the daemon's values in the wire dtype) lands in the
    output with the bits convert.from_wire gives, NaN payloads aside."""
    wire = dtypes.WIRE_DTYPES[wire_name]
    chunks = plan(1000, 384)
    batch = encode(values_for(1000, np.dtype(np.float32)), wire, chunks)
    with np.errstate(over="ignore"):  # the largest overflow to inf: carried as such
        sums = values_for(1000, np.dtype(np.float32), seed=1) * 3
    sums[-3:] = np.nan
    wire_sums = {c.offset: convert.to_wire(sums[c.offset:c.offset + c.numel], wire).tobytes()
                 for c in chunks}
    out = np.full(1000, 7, dtype=out_dtype)
    peer.loop.submit(batch, 11, out, out_dtype == np.float16, 2, 4)
    answer_all(peer, len(chunks), lambda shard: wire_sums[shard.offset])
    assert peer.event() == ("done", 11, len(chunks))
    expected = np.empty(1000, dtype=out_dtype)
    with np.errstate(over="ignore"):
        for c in chunks:
            convert.from_wire(wire_sums[c.offset], wire, expected[c.offset:c.offset + c.numel])
    assert np.array_equal(np.isnan(out), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert out[finite].tobytes() == expected[finite].tobytes()


def test_an_error_reply_fails_the_key_once_and_the_rest_is_ignored(peer):
    chunks = plan(40, 10)
    batch = encode(values_for(40, np.dtype(np.float32)), pb.DTYPE_FLOAT32, chunks)
    out = np.zeros(40, np.float32)
    peer.loop.submit(batch, 5, out, False, 2, 4)
    first = peer.read(0)
    peer.reply(0, key=first.key, round=first.round, offset=first.offset, dtype=first.dtype,
               error_code=3, error_message="length 10 of rank 1 differs")
    assert peer.event() == ("error", 5, 0, 3, b"length 10 of rank 1 differs")
    second = peer.read(1)  # sent before the error came: its reply changes nothing here
    peer.reply(1, key=second.key, round=second.round, offset=second.offset,
               dtype=second.dtype, data=np.ones(10, "<f4").tobytes())
    kind, link, gen, body = peer.event()  # it is no live key's: the link's (Python) now
    assert (kind, link, gen, decode_shard(body).offset) == ("reply", 1, peer.gens[1], 10)
    with pytest.raises(queue.Empty):
        peer.event(0.2)
    assert not out.any()


@pytest.mark.parametrize("what, fields", [
    ("length", dict(dtype=pb.DTYPE_FLOAT32, data=np.ones(9, "<f4").tobytes())),
    ("dtype", dict(dtype=pb.DTYPE_FLOAT16, data=np.ones(20, "<f2").tobytes())),
])
def test_a_reply_of_the_wrong_size_or_dtype_fails_the_key(peer, what, fields):
    batch = encode(values_for(10, np.dtype(np.float32)), pb.DTYPE_FLOAT32, [Chunk(0, 10, 0)])
    peer.loop.submit(batch, 9, np.zeros(10, np.float32), False, 2, 4)
    shard = peer.read(0)
    peer.reply(0, key=shard.key, round=shard.round, offset=shard.offset, **fields)
    kind, token, index, problem, got, expected = peer.event()
    assert (kind, token, index, problem) == ("bad", 9, 0, what)
    assert (got, expected) == ((36, 40) if what == "length" else
                               (pb.DTYPE_FLOAT16, pb.DTYPE_FLOAT32))


def test_replies_to_other_keys_rounds_and_offsets_go_to_python_untouched(peer):
    """The link's own chunks share the connection: a reply that is no loop
    key's comes back whole, on the connection it came on, and writes nothing."""
    batch = encode(values_for(10, np.dtype(np.float32)), pb.DTYPE_FLOAT32, [Chunk(0, 10, 0)])
    out = np.zeros(10, np.float32)
    peer.loop.submit(batch, 1, out, False, 2, 4)
    shard = peer.read(0)
    data = np.ones(10, "<f4").tobytes()
    others = (dict(key="other", round=7, offset=0), dict(key="the key", round=8, offset=0),
              dict(key="the key", round=7, offset=3))
    for fields in others:
        peer.reply(0, dtype=shard.dtype, data=data, **fields)
    for fields in others:
        kind, link, gen, body = peer.event()
        reply = decode_shard(body)
        assert (kind, link, gen) == ("reply", 0, peer.gens[0])
        assert (reply.key, reply.round, reply.offset) == (fields["key"], fields["round"],
                                                          fields["offset"])
        assert bytes(reply.data) == data
    assert not out.any()
    peer.reply(0, key="the key", round=7, offset=0, dtype=shard.dtype, data=data)
    assert peer.event() == ("done", 1, 1)
    assert (out == 1).all()


def test_a_broken_connection_hands_back_its_unanswered_chunks(peer):
    """Link 1 dies after one reply: its other chunks come back as orphans,
    link 0's chunks still complete on the loop and the key is done with them."""
    chunks = plan(60, 10)  # chunks 0, 2, 4 on link 0; 1, 3, 5 on link 1
    batch = encode(values_for(60, np.dtype(np.float32)), pb.DTYPE_FLOAT32, chunks)
    peer.loop.submit(batch, 4, np.zeros(60, np.float32), False, 100, 0)
    shard = peer.read(1)
    peer.reply(1, key=shard.key, round=shard.round, offset=shard.offset, dtype=shard.dtype,
               data=np.ones(10, "<f4").tobytes())
    time.sleep(0.05)
    peer.socks[1].close()
    kind, link, gen, code, text, status_frame, malformed, replied, orphans = peer.event()
    assert (kind, link, gen, code, status_frame, malformed, replied) == \
        ("down", 1, peer.gens[1], 14, 0, 0, 1)
    assert text in (b"the daemon closed the connection",
                    b"connection broke ([Errno 104] Connection reset by peer)")
    assert sorted(orphans) == [(4, 3), (4, 5)]
    assert not peer.loop.link_up(1)
    for _ in range(3):
        s = peer.read(0)
        peer.reply(0, key=s.key, round=s.round, offset=s.offset, dtype=s.dtype,
                   data=np.ones(10, "<f4").tobytes())
    assert peer.event() == ("done", 4, 4)  # 3 on link 0 and the one link 1 answered
    with pytest.raises(ValueError, match="down"):
        peer.loop.submit(encode(values_for(60, np.dtype(np.float32)), pb.DTYPE_FLOAT32,
                                chunks), 5, np.zeros(60, np.float32), False, 100, 0)


def test_a_status_frame_ends_the_link_with_its_code(peer):
    batch = encode(values_for(10, np.dtype(np.float32)), pb.DTYPE_FLOAT32, [Chunk(0, 10, 0)])
    peer.loop.submit(batch, 2, np.zeros(10, np.float32), False, 2, 4)
    peer.read(0)
    payload = (8).to_bytes(4, "little") + b"too many connections"
    peer.socks[0].sendall(frame_header(STATUS, len(payload)) + payload)
    event = peer.event()
    assert event[:8] == ("down", 0, peer.gens[0], 8, b"too many connections", 1, 0, 0)
    assert event[8] == [(2, 0)]
    assert peer.event() == ("done", 2, 0)  # nothing left on the loop for it


def test_credits_hold_a_link_to_four_unanswered_chunks(peer):
    """SendOrder's credits: a paced key (more chunks than the window) has at
    most 4 chunks unanswered per link until answers come (or 0.5 s pass)."""
    chunks = [Chunk(10 * i, 10, 0) for i in range(10)]
    batch = encode(values_for(100, np.dtype(np.float32)), pb.DTYPE_FLOAT32, chunks)
    peer.loop.submit(batch, 3, np.zeros(100, np.float32), False, 2, 4)
    got = [peer.read(0) for _ in range(4)]
    peer.socks[0].settimeout(0.2)
    with pytest.raises(TimeoutError):
        peer.read(0)  # the fifth waits for a credit
    peer.socks[0].settimeout(5)
    data = np.ones(10, "<f4").tobytes()
    peer.reply(0, key=got[0].key, round=7, offset=got[0].offset, dtype=got[0].dtype, data=data)
    fifth = peer.read(0)
    assert fifth.offset == 40
    for s in got[1:] + [fifth]:
        peer.reply(0, key=s.key, round=7, offset=s.offset, dtype=s.dtype, data=data)
    for _ in range(5):
        s = peer.read(0)
        peer.reply(0, key=s.key, round=7, offset=s.offset, dtype=s.dtype, data=data)
    assert peer.event() == ("done", 3, 10)


def test_priorities_overtake_queued_chunks_and_cancel_stops_a_key(peer):
    """A key of higher priority goes before the queued chunks of a lower one;
    a cancelled key sends nothing more."""
    low = [Chunk(10 * i, 10, 0) for i in range(8)]
    low_batch = encode(values_for(80, np.dtype(np.float32)), pb.DTYPE_FLOAT32, low)
    peer.loop.submit(low_batch, 1, np.zeros(80, np.float32), False, 2, 4)
    first = [peer.read(0) for _ in range(4)]  # its credits taken: the rest waits
    codec, param = CODECS[pb.DTYPE_FLOAT32]
    urgent = _tcploop.encode(key="urgent", dtype=pb.DTYPE_FLOAT32, layouts=LAYOUTS,
                             chunks=[Chunk(0, 10, 0)], codec=codec, param=param,
                             values=np.ones(10, np.float32), f16_in=False, base=0, spare=None,
                             **{**FIELDS, "priority": 9})
    peer.loop.submit(urgent, 2, np.zeros(10, np.float32), False, 2, 4)
    assert peer.read(0).key == "urgent"
    peer.loop.cancel(low_batch)
    data = np.ones(10, "<f4").tobytes()
    for s in first:
        peer.reply(0, key=s.key, round=7, offset=s.offset, dtype=s.dtype, data=data)
    peer.socks[0].settimeout(0.2)
    with pytest.raises(TimeoutError):
        peer.read(0)
    assert not low_batch.active or peer.events.empty()


def test_the_loop_allocates_nothing_per_chunk(peer):
    """Memory after many keys of many chunks stays where the first ones left it."""
    import tracemalloc

    chunks = plan(4096, 64)
    values = values_for(4096, np.dtype(np.float32))
    out = np.zeros(4096, np.float32)
    batch = None

    def one_key(token):
        nonlocal batch
        batch = encode(values, pb.DTYPE_FLOAT16, chunks, spare=batch)
        peer.loop.submit(batch, token, out, False, 100, 0)
        answer_all(peer, len(chunks), lambda s: bytes(s.data))
        assert peer.event()[0] == "done"
        deadline = time.monotonic() + 5
        while batch.active and time.monotonic() < deadline:
            time.sleep(0.001)

    one_key(0)
    tracemalloc.start()
    try:
        one_key(1)
        before = tracemalloc.get_traced_memory()[0]
        for token in range(2, 6):
            one_key(token)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The test's own Python side (decode_shard, encode_shard per reply) frees
    # what it makes; a leak of a frame (130 bytes) per chunk would be 33 KB.
    assert grown < 16 << 10
    assert np.array_equal(out, convert.to_wire(values, pb.DTYPE_FLOAT16).astype(np.float32))


def test_close_is_bounded_with_keys_in_flight():
    peer = Peer()
    batch = encode(values_for(40, np.dtype(np.float32)), pb.DTYPE_FLOAT32, plan(40, 10))
    peer.loop.submit(batch, 1, np.zeros(40, np.float32), False, 2, 4)
    done = threading.Event()
    threading.Thread(target=lambda: (peer.close(), done.set()), daemon=True).start()
    assert done.wait(5)
    assert not batch.active


def test_python_frames_go_out_whole_between_the_loops_frames(peer):
    """write() sends the link's own frame on its connection, never inside one
    of the loop's, and returns once it is written; an older connection's
    generation, a connection that ended, or shutdown() make it return False."""
    chunks = [Chunk(1000 * i, 1000, 0) for i in range(8)]
    batch = encode(values_for(8000, np.dtype(np.float32)), pb.DTYPE_FLOAT32, chunks)
    own = encode_shard(job="job", key="python", round=3, offset=0, dtype=pb.DTYPE_FLOAT32,
                       data=np.full(4, 2.0, "<f4").tobytes())
    peer.loop.submit(batch, 6, np.zeros(8000, np.float32), False, 100, 0)
    assert peer.loop.write(0, peer.gens[0], frame_header(SHARD, len(own)) + own)
    seen = [peer.read(0) for _ in range(9)]  # whole frames: each decodes
    assert sorted(s.key for s in seen) == ["python"] + ["the key"] * 8
    assert not peer.loop.write(0, peer.gens[0] + 1, frame_header(SHARD, len(own)) + own)
    peer.loop.shutdown(0, peer.gens[0])
    assert not peer.loop.link_up(0)
    assert peer.event()[:3] == ("down", 0, peer.gens[0])
    assert not peer.loop.write(0, peer.gens[0], frame_header(SHARD, len(own)) + own)
    ours, theirs = socket.socketpair()
    gen = peer.loop.attach(0, ours.detach(), 1 << 24)  # the link's next connection
    assert gen == peer.gens[0] + 1
    assert peer.loop.write(0, gen, frame_header(SHARD, len(own)) + own)
    theirs.settimeout(5)
    peer.socks[0].close()
    peer.socks[0] = theirs
    assert peer.read(0).key == "python"


def test_a_write_waiting_on_a_full_socket_ends_with_the_connection(peer):
    """A frame the daemon never reads does not hold its writer: the
    connection's end answers it (False), within the time of the break."""
    big = encode_shard(job="job", key="big", round=0, offset=0, dtype=pb.DTYPE_FLOAT32,
                       data=np.zeros(4 << 20, "<f4").tobytes())  # more than the socket buffers
    result = queue.Queue()
    writer = threading.Thread(target=lambda: result.put(
        peer.loop.write(1, peer.gens[1], frame_header(SHARD, len(big)) + big)), daemon=True)
    writer.start()
    time.sleep(0.2)
    assert result.empty()  # waits for the daemon, without the GIL (we run)
    peer.socks[1].close()
    assert result.get(timeout=5) is False
    writer.join(5)
