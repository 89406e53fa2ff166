"""Failure behaviour of the daemon and client, with real processes.

Scenarios: ranks that disagree on a length, a rank that never sends, a retried
contribution, shards invalid on their own, a daemon that is down, a token,
and SIGTERM draining with open rounds.
"""

import signal
import time

import grpc
import numpy as np
import pytest
from core_cases import disagreeing_list_worker, mismatch_worker, silent_rank_worker
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from raw_stream import RawStream
from reducer_client import ReducerClient, ReducerError
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from support import run_workers, start_daemon


def shard(rank, values, world_size=2, key="k", round_=0):
    data = np.asarray(values, dtype=np.float32).astype("<f2").tobytes()
    return pb.Shard(job="raw", rank=rank, world_size=world_size, round=round_, key=key,
                    offset=0, dtype=pb.DTYPE_FLOAT16, op=pb.REDUCE_OP_SUM, data=data)


def values_of(reply):
    return np.frombuffer(reply.data, dtype="<f2").astype(np.float32).tolist()


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon("--round-timeout", "2", log_dir=tmp_path)
    yield d
    d.stop()


def test_length_mismatch_fails_every_rank_then_a_good_job_runs(daemons):
    with daemons(2, round_timeout=3) as d:
        results = run_workers(mismatch_worker, 3, (d.addresses,))
        assert "chunk failed (INVALID_ARGUMENT)" in d.logs()
    for result in results:
        code, message = result["error"]
        assert code == "INVALID_ARGUMENT"
        assert "length" in message and "rank 1" in message and "'bad'" in message
        assert result["good"] == [6.0] * 10


def test_silent_rank_gives_deadline_exceeded_naming_it(daemons):
    """Rank 2 never sends: ranks 0 and 1 learn it within the round timeout + 1 s."""
    with daemons(2, round_timeout=2) as d:
        results = run_workers(silent_rank_worker, 3, (d.addresses, 2))
    for result in results[:2]:
        code, message = result["error"]
        assert code == "DEADLINE_EXCEEDED"
        assert "rank(s) 2 of 3" in message and "'silent'" in message and "round 0" in message
        assert result["elapsed"] < 2 + 1.0


@pytest.mark.parametrize("rank1_settings", [
    None,  # the daemon list in the other order
    {"link_gbit": 0.2},  # a 2 MiB key in 64 KiB chunks, rank 0's in 256 KiB (a fast network)
    {"chunk_bytes": 1 << 20},  # fixed 1 MiB chunks: the default's ceiling, but not its rule
], ids=["daemon-order", "link-rate", "fixed-chunks"])
def test_workers_that_disagree_on_the_layout_fail_fast(daemons, rank1_settings):
    """Rank 1 lists the two daemons in the other order, or cuts its keys for
    another link rate, or at a fixed chunk size: both ranks get
    INVALID_ARGUMENT saying so, long before the 6 s round timeout (which
    the daemons' drain at the end then waits for, for the chunks left open)."""
    with daemons(2, round_timeout=6) as d:
        results = run_workers(disagreeing_list_worker, 2, (d.addresses, rank1_settings))
    for result in results:
        code, message = result["error"]
        assert code == "INVALID_ARGUMENT" and "disagree on the chunk layout" in message
        assert result["elapsed"] < 3


def test_retried_contribution_is_not_counted_twice(daemon):
    first, retry, other = (RawStream(daemon.address) for _ in range(3))
    try:
        first.send(shard(0, [1.0, 2.0]))
        retry.send(shard(0, [1.0, 2.0]))  # e.g. resent after a reconnect
        time.sleep(0.2)
        other.send(shard(1, [10.0, 20.0]))
        for stream in (first, retry, other):
            reply = stream.next_reply()
            assert isinstance(reply, pb.Shard), reply
            assert values_of(reply) == [11.0, 22.0]
            assert (reply.key, reply.round, reply.offset) == ("k", 0, 0)
    finally:
        for stream in (first, retry, other):
            stream.close()


@pytest.mark.parametrize("fields,problem", [
    (dict(job=""), "job is empty"),
    (dict(key=""), "key is empty"),
    (dict(dtype=pb.DTYPE_UNSPECIFIED), "dtype 0 is unspecified"),
    (dict(world_size=0), "world_size is 0"),
    (dict(rank=2), "rank 2 is not below world_size 2"),
    (dict(data=b""), "data is empty"),
    (dict(data=b"123"), "not a whole number"),
    (dict(offset=(1 << 63) - 1), "passes 2^63"),
])
def test_invalid_shard_ends_the_stream_with_invalid_argument(daemon, fields, problem):
    good = dict(job="raw", rank=0, world_size=2, round=0, key="k", offset=0,
                dtype=pb.DTYPE_FLOAT16, op=pb.REDUCE_OP_SUM, data=b"\0\0\0\0")
    stream = RawStream(daemon.address)
    try:
        stream.send(pb.Shard(**(good | fields)))
        error = stream.next_reply()
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert problem in error.details()
    finally:
        stream.close()


def test_mismatch_without_inband_errors_ends_the_streams(daemon):
    a, b = RawStream(daemon.address), RawStream(daemon.address)
    try:
        a.send(shard(0, [1.0]))
        time.sleep(0.1)
        b.send(shard(1, [1.0, 2.0]))
        for stream in (a, b):
            error = stream.next_reply()
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "rank 1 sent length 2 but rank 0 sent length 1" in error.details()
    finally:
        a.close()
        b.close()


def test_daemon_down_is_a_clear_error_not_a_hang(tmp_path):
    d = start_daemon(log_dir=tmp_path)
    address = d.address
    d.stop()
    with ReducerClient([address], job="j", rank=0, world_size=2, timeout=2) as client:
        start = time.monotonic()
        with pytest.raises(ReducerError) as info:
            client.allreduce(np.ones(4, dtype=np.float32), key="k")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert address in str(info.value)
    assert time.monotonic() - start < 2 + 1.0


def test_token_is_required_when_configured(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    d = start_daemon("--auth-token-file", str(token_file), log_dir=tmp_path)
    try:
        with ReducerClient([d.address], job="j", rank=0, world_size=1,
                           token="wrong") as client:
            with pytest.raises(ReducerError) as info:
                client.allreduce(np.ones(4, dtype=np.float32), key="k")
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "token" in str(info.value)
        with ReducerClient([d.address], job="j", rank=0, world_size=1,
                           token="s3cret") as client:
            assert client.allreduce(np.ones(4, dtype=np.float32), key="k").tolist() == [1] * 4
        assert "s3cret" not in d.log()
    finally:
        d.stop()


def test_health_and_reflection(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "reducer.v1.Reducer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"reducer.v1.Reducer", "grpc.health.v1.Health"} <= names


def test_sigterm_lets_open_rounds_finish_and_exits_zero(tmp_path):
    """An open round completes during the drain; new streams are refused."""
    d = start_daemon("--drain-grace", "10", log_dir=tmp_path)
    early, late = RawStream(d.address), RawStream(d.address)
    try:
        early.send(shard(0, [1.0]))
        late.send(shard(0, [5.0], world_size=1, key="warmup"))  # opens the stream
        assert values_of(late.next_reply()) == [5.0]
        time.sleep(0.2)
        d.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = RawStream(d.address)
        refused.send(shard(1, [1.0], key="new"))
        error = refused.next_reply()
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        refused.close()
        late.send(shard(1, [2.0]))  # completes the open round
        assert values_of(early.next_reply()) == [3.0]
        assert values_of(late.next_reply()) == [3.0]
        early.close()
        late.close()
        assert d.process.wait(15) == 0
        assert "draining" in d.log()
    finally:
        d.stop(signal.SIGKILL)


def test_sigterm_fails_rounds_still_open_after_the_grace(tmp_path):
    d = start_daemon("--drain-grace", "1", log_dir=tmp_path)
    stream = RawStream(d.address)
    try:
        stream.send(shard(0, [1.0]))
        time.sleep(0.3)
        start = time.monotonic()
        d.process.send_signal(signal.SIGTERM)
        error = stream.next_reply()
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shut down" in error.details()
        assert d.process.wait(10) == 0
        assert time.monotonic() - start < 5
    finally:
        stream.close()
        d.stop(signal.SIGKILL)


def test_idle_streams_are_ended_and_clients_carry_on(tmp_path):
    """A stream that sends nothing is ended after --stream-idle-timeout, so it
    holds nothing for ever; a client whose idle stream was ended reconnects
    on its next allreduce."""
    d = start_daemon("--stream-idle-timeout", "0.5", log_dir=tmp_path)
    silent = RawStream(d.address)
    try:
        assert silent.next_reply(timeout=10) is None  # ended with OK
        with ReducerClient([d.address], job="idle", rank=0, world_size=1) as client:
            x = np.arange(8, dtype=np.float32)
            assert np.array_equal(client.allreduce(x, key="k"), x)
            time.sleep(1.5)
            assert np.array_equal(client.allreduce(x, key="k"), x)
        # The client's close reaches the daemon's loop a moment later; its
        # stream must be gone within a bounded wait, not at once.
        deadline = time.monotonic() + 5
        with grpc.insecure_channel(d.address) as channel:
            status = pb_grpc.ReducerStub(channel)
            while status.GetStatus(pb.StatusRequest(), timeout=5).open_streams:
                assert time.monotonic() < deadline, "the closed client's stream stayed open"
                time.sleep(0.05)
    finally:
        silent.close()
        d.stop()


def test_sigterm_right_after_listening_drains_not_kills(tmp_path):
    """The signal handlers are installed before the daemon says "listening": a
    supervisor (or a test) that stops it at once gets a clean exit 0. Before,
    a SIGTERM in the gap after the line killed it (-15, seen under load); the
    prelude widens whatever gap follows start() to 0.5 s."""
    from support import start_daemon

    prelude = ("import asyncio, sys; from reducerd.daemon import server\n"
               "start = server.Daemon.start\n"
               "async def slow(self):\n    await start(self)\n    await asyncio.sleep(0.5)\n"
               "server.Daemon.start = slow\n"
               "from reducerd.__main__ import main; sys.exit(main(sys.argv[1:]))")
    for _ in range(3):
        d = start_daemon(log_dir=tmp_path, entry=("-c", prelude))  # back once "listening"
        d.process.send_signal(signal.SIGTERM)
        assert d.process.wait(15) == 0, d.log()[-2000:]
