"""The session alone, with fake streams: accept, deliver, stream ends, the daemon's own faults.

Scenarios: a result goes to every stream as one reply, byte-identical to the
generated protobuf's serialization (gRPC streams get its bytes, data-plane
streams its frame, a resend the very same message); a stream half-closed
while it waits ends after its answers; an invalid shard ends its stream and
nothing more is taken from it; failures go in band or end the stream; an
exception in the daemon's own code (metrics, table, decoder) ends the streams
concerned with INTERNAL saying it is the daemon's fault, logged at ERROR with
the traceback, and the session keeps serving.
"""

import logging

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reducer_wire import convert, dtypes
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import decode_shard
from reducer_wire.framing import SHARD, frame_header

from reducerd.core.reduction import ReductionTable
from reducerd.core.replies import result_reply
from reducerd.service import session as session_module
from reducerd.service.session import END, Session, Stream, decode_request

F16, BF16, F32 = pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32


class Outbox(list):
    def put_nowait(self, item):
        self.append(item)


def stream(name="s", inband=False, frames=False):
    return Stream(name, inband, outbox=Outbox(), frames=frames)


def message(rank, values, world_size=2, dtype=F16, key="k", round_=0, op=pb.REDUCE_OP_SUM):
    data = convert.to_wire(np.asarray(values, np.float32), dtype).tobytes()
    shard = pb.Shard(job="j", key=key, rank=rank, world_size=world_size, round=round_,
                     offset=0, dtype=dtype, op=op, data=data)
    return decode_request(shard.SerializeToString())


def expected_reply(values, world_size=2, dtype=F16, key="k", round_=0, op=pb.REDUCE_OP_SUM,
                   **fields):
    data = convert.to_wire(np.asarray(values, np.float32), dtype).tobytes() if values else b""
    return pb.Shard(job="j", key=key, world_size=world_size, round=round_, dtype=dtype, op=op,
                    data=data, **fields).SerializeToString()


def new_session(**table_options):
    return Session(ReductionTable(60, 1 << 30, **table_options))


@settings(max_examples=200, deadline=None)
@given(job=st.text(min_size=1, max_size=20), key=st.text(min_size=1, max_size=300),
       round_=st.integers(0, (1 << 64) - 1), offset=st.integers(0, (1 << 63) - 1),
       dtype=st.sampled_from([F16, BF16, F32]), op=st.sampled_from([0, 1, 2]),
       world_size=st.integers(1, (1 << 32) - 1), numel=st.integers(1, 300))
def test_a_result_reply_is_the_generated_serialization(job, key, round_, offset, dtype, op,
                                                       world_size, numel):
    acc = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    reply = result_reply(job=job, key=key, round=round_, offset=offset, dtype=dtype, op=op,
                         world_size=world_size, acc=acc)
    expected = pb.Shard(job=job, key=key, round=round_, offset=offset, dtype=dtype, op=op,
                        world_size=world_size, data=convert.to_wire(acc, dtype).tobytes())
    assert bytes(reply.message) == expected.SerializeToString()
    assert bytes(reply.frame[:5]) == frame_header(SHARD, len(expected.SerializeToString()))
    payload = np.frombuffer(reply.payload, np.uint8)
    assert payload.ctypes.data % 64 == 0  # the narrowing writes whole cache lines


def test_every_stream_gets_the_one_reply_and_a_resend_the_same_message():
    session = new_session()
    grpc_stream, tcp_stream, resend = stream("grpc"), stream("tcp", frames=True), stream("r")
    assert session.accept(message(0, [1.0, 2.0]), grpc_stream)
    assert grpc_stream.outbox == [] and tcp_stream.outbox == []
    assert session.accept(message(1, [3.0, 0.5]), tcp_stream)
    expected = expected_reply([4.0, 2.5])
    (sent_bytes,) = grpc_stream.outbox
    (sent_reply,) = tcp_stream.outbox
    assert sent_bytes == expected  # bytes: what gRPC's API takes
    assert bytes(sent_reply.frame) == frame_header(SHARD, len(expected)) + expected
    assert session.accept(message(1, [3.0, 0.5]), resend)  # after a reconnect
    assert resend.outbox == [expected]
    resend_tcp = stream("r2", frames=True)
    assert session.accept(message(0, [1.0, 2.0]), resend_tcp)
    assert resend_tcp.outbox == [sent_reply]
    assert resend_tcp.outbox[0] is sent_reply  # the cached message itself, no copy
    assert grpc_stream.waiting == set() and not grpc_stream.ended


def test_a_retry_on_the_same_stream_is_answered_once():
    session = new_session()
    a, b = stream("a"), stream("b")
    session.accept(message(0, [1.0]), a)
    session.accept(message(0, [1.0]), a)  # resent on the same stream: counted once
    session.accept(message(1, [1.0]), b)
    assert a.outbox == [expected_reply([2.0])] and b.outbox == [expected_reply([2.0])]


def test_a_half_closed_stream_ends_after_its_answers():
    session = new_session()
    a, b = stream("a"), stream("b")
    session.accept(message(0, [1.0]), a)
    a.half_close()
    assert a.outbox == [] and not a.ended  # still waits for its chunk
    session.accept(message(1, [1.0]), b)
    assert a.outbox == [expected_reply([2.0]), END] and a.ended
    b.half_close()
    assert b.outbox[-1] is END


def test_an_invalid_shard_ends_its_stream_and_nothing_more_is_taken():
    session = new_session()
    s = stream()
    bad = decode_shard(pb.Shard(job="j", key="k", world_size=2, rank=5, dtype=F16,
                                data=b"\0\0").SerializeToString())
    assert not session.accept(bad, s)
    ((code, text),) = s.outbox
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 5 is not below" in text
    assert not session.accept(message(0, [1.0]), s)
    assert session.table.open_chunk_count == 0 and len(s.outbox) == 1
    t = stream()
    assert not session.accept(decode_request(b"\xff"), t)
    assert t.outbox[0][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed Shard message" in t.outbox[0][1]


def test_failures_go_in_band_or_end_the_stream():
    session = new_session()
    plain, inband = stream("plain"), stream("inband", inband=True)
    session.accept(message(0, [1.0]), plain)
    session.accept(message(1, [1.0, 2.0]), inband)  # length mismatch: fails the chunk
    ((code, text),) = plain.outbox
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank 1 sent length 2" in text
    assert plain.ended
    (reply,) = inband.outbox
    assert reply == expected_reply(None, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                   error_message=text)
    assert not inband.ended and inband.waiting == set()


class FaultyObserver:
    def __init__(self, fail_in):
        self.fail_in = fail_in

    def shard_in(self, job, dtype, nbytes):
        if self.fail_in == "shard_in":
            raise RuntimeError("injected fault in shard_in")

    def delivered(self, d):
        if self.fail_in == "delivered":
            raise RuntimeError("injected fault in delivered")


def assert_daemon_fault(item, caplog, where):
    code, text = item
    assert code == grpc.StatusCode.INTERNAL
    assert "fault of the daemon, not of this client" in text and where in text
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and errors[-1].exc_info is not None, "logged with its traceback"
    assert "reducerd fault while" in errors[-1].getMessage()


@pytest.mark.parametrize("inband", [False, True])
def test_a_metrics_fault_on_a_shard_is_internal_not_the_clients(caplog, inband):
    session = new_session()
    session.observer = FaultyObserver("shard_in")
    s = stream(inband=inband)
    with caplog.at_level(logging.DEBUG, "reducerd"):
        assert not session.accept(message(0, [1.0]), s)
    (item,) = s.outbox
    assert_daemon_fault(item, caplog, "injected fault in shard_in")
    assert s.ended and not any(r.levelno == logging.DEBUG and "cannot read" in r.getMessage()
                               for r in caplog.records)


def test_a_metrics_fault_on_a_delivery_fails_every_sink_with_internal(caplog):
    session = new_session()
    session.observer = FaultyObserver("delivered")
    a, b = stream("a"), stream("b", inband=True, frames=True)
    with caplog.at_level(logging.ERROR, "reducerd"):
        session.accept(message(0, [1.0]), a)
        session.accept(message(1, [1.0]), b)
    for s in (a, b):
        (item,) = s.outbox
        assert_daemon_fault(item, caplog, "injected fault in delivered")
    session.observer = None
    c, d = stream("c"), stream("d")
    session.accept(message(0, [1.0], key="k2"), c)
    session.accept(message(1, [2.0], key="k2"), d)
    assert c.outbox == [expected_reply([3.0], key="k2")]  # the session still serves


def test_a_table_fault_is_internal(caplog, monkeypatch):
    session = new_session()

    def broken(*args):
        raise ZeroDivisionError("injected fault in the table")

    monkeypatch.setattr(session.table, "contribute", broken)
    s = stream(inband=True, frames=True)
    with caplog.at_level(logging.ERROR, "reducerd"):
        assert not session.accept(message(0, [1.0]), s)
    assert_daemon_fault(s.outbox[0], caplog, "injected fault in the table")


def test_a_decoder_fault_is_internal(caplog, monkeypatch):
    def broken(message):
        raise IndexError("injected fault in the decoder")

    monkeypatch.setattr(session_module, "decode_shard", broken)
    s = stream()
    with caplog.at_level(logging.ERROR, "reducerd"):
        decoded = decode_request(b"\x0a\x01j")
        assert not new_session().accept(decoded, s)
    assert_daemon_fault(s.outbox[0], caplog, "injected fault in the decoder")


def test_an_expiry_fault_is_logged_and_the_next_tick_works(caplog, monkeypatch):
    session = new_session()
    s = stream()
    session.accept(message(0, [1.0]), s)
    real_expire = session.table.expire
    monkeypatch.setattr(session.table, "expire", lambda: 1 / 0)
    with caplog.at_level(logging.ERROR, "reducerd"):
        session.expire(idle_timeout_s=600)
    assert any(r.exc_info and "expiring" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(session.table, "expire", real_expire)
    session.expire(idle_timeout_s=600)
    assert s.outbox == [] and session.table.open_chunk_count == 1


def test_idle_streams_end_once_and_busy_ones_stay():
    session = new_session()
    idle, busy = stream("idle"), stream("busy")
    session.open_stream(idle)
    session.open_stream(busy)
    session.accept(message(0, [1.0]), busy)
    session.end_idle_streams(idle_timeout_s=0.0)
    session.end_idle_streams(idle_timeout_s=0.0)
    assert idle.outbox == [END] and busy.outbox == []
    session.close_stream(busy)
    assert busy not in session.streams


def test_op_and_dtype_names_have_one_home():
    """The daemon's dtype and op names are reducer_wire.dtypes' (not copies)."""
    import importlib
    import pkgutil

    import reducerd

    for module in pkgutil.walk_packages(reducerd.__path__, "reducerd."):
        if module.name == "reducerd.__main__" or module.name.startswith("reducerd.bench"):
            continue
        imported = importlib.import_module(module.name)
        for name in ("DTYPE_NAMES", "OP_NAMES"):
            if hasattr(imported, name):  # a copy of its own would not be the same object
                assert getattr(imported, name) is getattr(dtypes, name), (module.name, name)


def test_the_grpc_reader_blames_itself_when_grpc_fails_it(caplog):
    """An exception from gRPC's request iterator (not a bad message: those
    decode to a DecodeError) ends the call with INTERNAL, logged with its traceback."""
    import asyncio

    from reducerd.daemon.grpc_service import ReducerServicer

    async def requests():
        yield message(0, [1.0], world_size=1)
        raise RuntimeError("injected fault in the request iterator")

    servicer = ReducerServicer(new_session(), stalled_after_s=5.0)
    s = stream()
    with caplog.at_level(logging.ERROR, "reducerd"):
        asyncio.run(servicer._read(requests(), s))
    reply, ending = s.outbox
    assert reply == expected_reply([1.0], world_size=1)
    assert_daemon_fault(ending, caplog, "injected fault in the request iterator")


def test_a_status_fault_is_internal(caplog, monkeypatch):
    import asyncio

    from reducerd.daemon.grpc_service import ReducerServicer

    class Aborted(Exception):
        pass

    class Context:
        def peer(self):
            return "ipv4:127.0.0.1:1"

        async def abort(self, code, details):
            self.code, self.details = code, details
            raise Aborted

    session = new_session()
    monkeypatch.setattr(session.table, "open_chunks", lambda *args, **kwargs: 1 / 0)
    context = Context()
    with caplog.at_level(logging.ERROR, "reducerd"), pytest.raises(Aborted):
        asyncio.run(ReducerServicer(session, 5.0).GetStatus(pb.StatusRequest(), context))
    assert_daemon_fault((context.code, context.details), caplog, "ZeroDivisionError")
