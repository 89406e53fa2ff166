"""Many contributors: what a stream's end costs, and when its status goes out.

Scenarios: a whole job's W = 256 streams end while K = 1,024 of its chunks
are open (a job that dies mid-round): forgetting them costs one step per
(stream, chunk it waits for), not a scan of every open chunk's sinks per
stream (which was W x K x W / 2 comparisons, 2.9 s of event-loop time); the
session hands the table what each stream waits for. With summing threads, a
stream that ends with an error while a chunk it completed is still being
summed gets that chunk's result first, then its status, as the inline path
puts them.
"""

from __future__ import annotations

import queue
import threading

import grpc
import numpy as np
import pytest
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import decode_shard

from reducerd.core import chunk_sums
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.core.replies import Reply
from reducerd.core.summing import SummingPool
from reducerd.service.session import END, Session, Stream, decode_request

pytestmark = pytest.mark.timeout(120)

ONE = np.ones(1, np.float16).tobytes()


class CountingSink:
    """A stream stand-in that counts every hash and comparison made of it."""

    calls = 0

    def __hash__(self) -> int:
        CountingSink.calls += 1
        return id(self) >> 4

    def __eq__(self, other: object) -> bool:
        CountingSink.calls += 1
        return self is other


def test_a_whole_job_ending_mid_round_costs_what_its_streams_wait_for():
    world, chunks = 256, 1024
    table = ReductionTable(600.0, 1 << 34)
    sinks = [CountingSink() for _ in range(world)]
    waiting: list[set[ChunkId]] = [set() for _ in range(world)]
    for offset in range(chunks):
        cid = ChunkId("job", "key", 0, offset)
        for rank in range(world - 1):  # the last rank never comes: every chunk stays open
            table.contribute(cid, Contribution(rank, world, pb.DTYPE_FLOAT16,
                                               pb.REDUCE_OP_SUM, ONE), sinks[rank])
            waiting[rank].add(cid)  # as Session._contribute keeps Stream.waiting
    pairs = sum(len(w) for w in waiting)
    CountingSink.calls = 0
    for sink, chunks_waited in zip(sinks, waiting, strict=True):
        table.drop_sink(sink, chunks_waited)
    # One dict removal per (stream, chunk) pair: a hash, at most a comparison (the
    # work counted, not timed: a wall-clock bound failed under the parallel suite).
    assert CountingSink.calls <= 2 * pairs, (CountingSink.calls, pairs)
    assert table.open_chunk_count == chunks  # their counted contributions stay counted
    for offset in range(chunks):  # the last rank's stream is the only one told now
        last = sinks[world - 1]
        (done,) = table.contribute(ChunkId("job", "key", 0, offset), Contribution(
            world - 1, world, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, ONE), last)
        assert done.sinks == (last,)


class Outbox(list):
    def put_nowait(self, item):
        self.append(item)


def shard(rank: int, world_size: int, key: str = "k", value: float = 1.0):
    message = pb.Shard(job="j", key=key, rank=rank, world_size=world_size, round=0, offset=0,
                       dtype=pb.DTYPE_FLOAT16, op=pb.REDUCE_OP_SUM,
                       data=np.full(4, value, np.float16).tobytes())
    return decode_request(message.SerializeToString())


def test_close_stream_hands_the_table_what_the_stream_waits_for(monkeypatch):
    session = Session(ReductionTable(60, 1 << 30))
    stream = Stream("s", True, outbox=Outbox(), frames=True)
    session.open_stream(stream)
    for key in ("a", "b"):
        assert session.accept(shard(0, 2, key), stream)
    calls = []
    monkeypatch.setattr(session.table, "drop_sink", lambda *args: calls.append(args))
    session.close_stream(stream)
    assert calls == [(stream, {ChunkId("j", "a", 0, 0), ChunkId("j", "b", 0, 0)})]


@pytest.fixture
def pooled_session():
    posted: queue.SimpleQueue = queue.SimpleQueue()
    pool = SummingPool(2)
    pool.start(lambda fn, *args: posted.put((fn, args)))
    session = Session(ReductionTable(60, 1 << 30, summing=pool))

    def run_posts() -> None:
        assert pool.wait_idle(10)
        while not posted.empty():
            fn, args = posted.get()
            fn(*args)

    yield session, run_posts
    assert pool.close(10)


def test_an_end_waits_for_the_results_still_being_summed(pooled_session, monkeypatch):
    session, run_posts = pooled_session
    gate = threading.Event()
    real_copy = chunk_sums.accumulate.copy_wire_into
    monkeypatch.setattr(chunk_sums.accumulate, "copy_wire_into",
                        lambda *a: (gate.wait(10), real_copy(*a)))
    stream = Stream("s", True, outbox=Outbox(), frames=True)
    session.open_stream(stream)
    assert session.accept(shard(0, 1, "done", 3.0), stream)  # complete, being summed
    assert session.accept(shard(0, 2, "open"), stream)  # waits for rank 1
    stream.end(grpc.StatusCode.INVALID_ARGUMENT, "unexpected frame kind 1 after HELLO")
    assert stream.ended and stream.outbox == []  # held for the result
    assert not session.accept(shard(1, 2, "other"), stream)  # no shard taken any more
    gate.set()
    run_posts()
    (reply, status) = stream.outbox
    assert isinstance(reply, Reply)
    result = decode_shard(reply.message)
    assert result.key == "done" and np.frombuffer(result.data, np.float16).tolist() == [3.0] * 4
    assert status == (grpc.StatusCode.INVALID_ARGUMENT, "unexpected frame kind 1 after HELLO")


def test_an_end_with_nothing_being_summed_goes_out_at_once(pooled_session):
    session, run_posts = pooled_session
    stream = Stream("s", False, outbox=Outbox())
    session.open_stream(stream)
    assert session.accept(shard(0, 2, "open"), stream)  # waits for rank 1: not completing
    stream.end(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    assert stream.outbox == [(grpc.StatusCode.INVALID_ARGUMENT, "bad")]
    run_posts()
    assert len(stream.outbox) == 1


def gate_copies(monkeypatch) -> threading.Event:
    gate = threading.Event()
    real_copy = chunk_sums.accumulate.copy_wire_into
    monkeypatch.setattr(chunk_sums.accumulate, "copy_wire_into",
                        lambda *a: (gate.wait(10), real_copy(*a)))
    return gate


def test_a_resend_while_summed_is_answered_again_as_after_completion(pooled_session,
                                                                    monkeypatch):
    """As inline: the first shard completes the chunk, the resend hears the
    cached result; the half-closed stream ends only after both."""
    session, run_posts = pooled_session
    gate = gate_copies(monkeypatch)
    stream, other = (Stream(name, True, outbox=Outbox(), frames=True) for name in "ab")
    for s in (stream, other):
        session.open_stream(s)
    assert session.accept(shard(0, 1, "done", 3.0), stream)
    assert session.accept(shard(0, 1, "done", 3.0), stream)  # the same stream resends
    assert session.accept(shard(0, 1, "done", 3.0), other)  # and another one
    stream.half_close()
    assert stream.outbox == [] and other.outbox == []
    gate.set()
    run_posts()
    first, again, end = stream.outbox
    assert first is again and isinstance(first, Reply) and end is END
    assert other.outbox == [first]


def test_a_disagreeing_resend_while_summed_fails_after_the_result(pooled_session,
                                                                 monkeypatch):
    session, run_posts = pooled_session
    gate = gate_copies(monkeypatch)
    stream = Stream("s", False, outbox=Outbox())  # no in-band errors: the error ends it
    session.open_stream(stream)
    assert session.accept(shard(0, 1, "done"), stream)
    assert session.accept(shard(0, 2, "done"), stream)  # world_size 2: told after the result
    gate.set()
    run_posts()
    result, (code, message) = stream.outbox
    assert decode_shard(result).key == "done"
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "resent a contribution" in message


def test_a_chunk_failed_while_summed_tells_who_resent(pooled_session, monkeypatch):
    session, run_posts = pooled_session
    gate = gate_copies(monkeypatch)  # held: the chunk stays complete, being summed
    stream, other = (Stream(name, True, outbox=Outbox(), frames=True) for name in "ab")
    for s in (stream, other):
        session.open_stream(s)
    assert session.accept(shard(0, 1, "done"), stream)
    assert session.accept(shard(0, 1, "done"), other)
    session.fail_all("UNAVAILABLE", "daemon shut down")
    for s in (stream, other):
        (failed,) = s.outbox
        assert decode_shard(failed.message).error_code == grpc.StatusCode.UNAVAILABLE.value[0]
    gate.set()
    run_posts()  # the landing of a failed chunk is dropped
    assert [len(s.outbox) for s in (stream, other)] == [1, 1]
    assert session.table.bytes_held == 0
