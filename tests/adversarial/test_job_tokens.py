"""Probe: a worker with a token, using another job's name (issue 16, row 2).

Before: any token holder replaced rank 0 of job A (all of A's ranks got 1003
instead of 3, no error), read A's round-1 sum by resending a contribution,
failed all of A's open chunks with one shard of another layout, and listed
every job with GetStatus. Bounds now: job B's token (reducerd token) is
PERMISSION_DENIED for every shard of job A, on gRPC and on the data plane,
before anything of it is counted; A's sums stay exact, A counts no failure;
B reads its own status and the brief one, nothing else; a forged job token is
UNAUTHENTICATED.
"""

import base64
import hashlib
import hmac

import grpc
import numpy as np
import pytest
from probes import (
    RawStream,
    assert_alive,
    data_socket,
    get_status,
    good_job,
    read_status_frame,
    shard,
    token_daemon,
)
from reducer_wire.framing import HELLO, MAGIC, SHARD, frame_header

from reducerd.service.access import job_token

DAEMON_TOKEN = "daemon-secret-for-the-adversarial-suite"


@pytest.fixture
def daemon(tmp_path):
    d = token_daemon(DAEMON_TOKEN, "--round-timeout", "10", log_dir=tmp_path)
    yield d
    d.stop()


def _value(reply) -> list[float]:
    assert not isinstance(reply, grpc.RpcError), reply
    assert not reply.error_code, reply.error_message
    return np.frombuffer(reply.data, "<f4").tolist()


def _denied(reply) -> str:
    assert isinstance(reply, grpc.RpcError), reply
    assert reply.code() == grpc.StatusCode.PERMISSION_DENIED, reply
    return reply.details()


def test_another_jobs_token_neither_replaces_nor_reads_nor_fails_a_rank(daemon):
    token_a, token_b = job_token(DAEMON_TOKEN, "job-a"), job_token(DAEMON_TOKEN, "job-b")
    rank0, rank1 = RawStream(daemon.address, token_a), RawStream(daemon.address, token_a)
    try:
        rank1.send(shard("job-a", 1, 2, [2.0], round_=0))
        # Rank 0 replaced by job B's token: over gRPC and over the data plane.
        attacker = RawStream(daemon.address, token_b)
        attacker.send(shard("job-a", 0, 2, [1000.0], round_=0))
        assert "job 'job-b'" in _denied(attacker.next_reply())
        attacker.close()
        sock = data_socket(daemon.address, token_b)
        message = shard("job-a", 0, 2, [1000.0], round_=0).SerializeToString()
        sock.sendall(frame_header(SHARD, len(message)) + message)
        code, text = read_status_frame(sock)
        assert code == grpc.StatusCode.PERMISSION_DENIED.value[0] and "job-a" in text
        sock.close()
        # One shard of another layout would have failed A's open chunks.
        layout = shard("job-a", 0, 2, [5.0], round_=0)
        layout.layout = 0xBAD
        attacker = RawStream(daemon.address, token_b)
        attacker.send(layout)
        _denied(attacker.next_reply())
        attacker.close()
        rank0.send(shard("job-a", 0, 2, [1.0], round_=0))
        assert _value(rank0.next_reply()) == [3.0] and _value(rank1.next_reply()) == [3.0]
        # Round 1 completes; a resend under B's token would have read its cached sum.
        rank0.send(shard("job-a", 0, 2, [10.0], round_=1))
        rank1.send(shard("job-a", 1, 2, [20.0], round_=1))
        assert _value(rank0.next_reply()) == [30.0] and _value(rank1.next_reply()) == [30.0]
        attacker = RawStream(daemon.address, token_b)
        attacker.send(shard("job-a", 0, 2, [10.0], round_=1))
        _denied(attacker.next_reply())
        attacker.close()
    finally:
        rank0.close()
        rank1.close()
    (job_a,) = get_status(daemon.address, DAEMON_TOKEN).jobs
    assert (job_a.job, job_a.chunks_completed, job_a.chunks_failed) == ("job-a", 2, 0)
    assert job_a.bytes_in == 4 * 4  # A's own four shards: nothing of B's was counted
    good_job([daemon.address], token=job_token(DAEMON_TOKEN, "good"))
    assert_alive(daemon)


def test_a_job_token_reads_its_own_status_and_the_brief_one_alone(daemon):
    token_b = job_token(DAEMON_TOKEN, "job-b")
    good_job([daemon.address], job="job-a", token=job_token(DAEMON_TOKEN, "job-a"))
    for request in ({}, {"job": "job-a"}):
        with pytest.raises(grpc.RpcError) as info:
            get_status(daemon.address, token_b, **request)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    brief = get_status(daemon.address, token_b, brief=True)
    assert brief.data_port and not brief.jobs
    assert not get_status(daemon.address, token_b, job="job-b").jobs
    assert [j.job for j in get_status(daemon.address, DAEMON_TOKEN).jobs] == ["job-a"]


def test_forged_and_foreign_tokens_are_unauthenticated(daemon):
    name = base64.urlsafe_b64encode(b"job-a").rstrip(b"=").decode()
    wrong_key = hmac.new(b"another daemon", b"job-a", hashlib.sha256).hexdigest()
    for token in (f"rj1.{name}.{wrong_key}", f"rj1.{name}.", "rj1.!!.00", DAEMON_TOKEN + "x",
                  job_token(DAEMON_TOKEN, "job-a")[:-1]):
        stream = RawStream(daemon.address, token)
        stream.send(shard("job-a", 0, 1, [1.0]))
        reply = stream.next_reply()
        assert isinstance(reply, grpc.RpcError) and reply.code() == (
            grpc.StatusCode.UNAUTHENTICATED), (token, reply)
        stream.close()
        with pytest.raises(grpc.RpcError) as info:
            get_status(daemon.address, token, brief=True)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        sock = data_socket(daemon.address, DAEMON_TOKEN, hello=False)
        sock.sendall(MAGIC + frame_header(HELLO, len(token)) + token.encode())
        code, _ = read_status_frame(sock)
        assert code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        sock.close()
    assert not get_status(daemon.address, DAEMON_TOKEN).jobs
