"""Probe: one job's streams cannot take every data connection and Reduce call.

The data plane took 4096 authenticated connections and gRPC any number of
Reduce calls, whoever opened them: one tenant with a job token could hold
every connection and thousands of calls (a thread, buffers and a Stream
each) and leave the other jobs none. Now each plane counts its streams
(reducerd.core.limits.StreamCount): at most MAX_CONNECTIONS data connections and
MAX_REDUCE_CALLS Reduce calls in all, half of each per job of a job token,
the rest refused with RESOURCE_EXHAUSTED naming the share. The caps are
patched to 4 here (the real ones are 4096); the same code counts at either.
"""

import time

import grpc
import pytest
from probes import (
    RawStream,
    assert_alive,
    data_port,
    data_socket,
    get_status,
    good_job,
    read_status_frame,
    shard,
    token_daemon,
    wait_until,
)

from reducerd.service.access import job_token

CAP = 4
DAEMON_TOKEN = "stream-share-daemon-token"
_SMALL_CAPS = (f"import reducerd.dataplane.plane as d, reducerd.daemon.grpc_service as g; "
               f"d.MAX_CONNECTIONS = {CAP}; g.MAX_REDUCE_CALLS = {CAP}")
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture
def daemon(tmp_path):
    d = token_daemon(DAEMON_TOKEN, log_dir=tmp_path, prelude=_SMALL_CAPS)
    yield d
    d.stop()


def test_a_job_holds_half_of_the_reduce_calls_at_most(daemon):
    greedy = job_token(DAEMON_TOKEN, "greedy")
    streams = []
    try:
        for i in range(CAP // 2):  # its share, each call open and answered
            stream = RawStream(daemon.address, greedy, inband=True)
            stream.send(shard("greedy", 0, 1, [1.0], key=f"k{i}"))
            assert stream.next_reply(timeout=5).data
            streams.append(stream)
        refused = RawStream(daemon.address, greedy)
        refused.send(shard("greedy", 0, 1, [1.0], key="late"))
        error = refused.next_reply(timeout=5)
        refused.close()
        assert isinstance(error, grpc.RpcError) and error.code() == RESOURCE_EXHAUSTED, error
        assert f"job 'greedy' holds {CAP // 2} Reduce calls, its share" in error.details()
        # Another job's calls still open: 2 ranks over gRPC, served exactly.
        good = job_token(DAEMON_TOKEN, "good")
        assert good_job([daemon.address], job="good", token=good, data_plane="grpc",
                        timeout=10) < 10
        # A call that ends gives its place back.
        streams.pop().close()
        assert wait_until(lambda: get_status(daemon.address, DAEMON_TOKEN).open_streams
                          == CAP // 2 - 1, 5)
        again = RawStream(daemon.address, greedy, inband=True)
        streams.append(again)
        again.send(shard("greedy", 0, 1, [1.0], key="again"))
        assert again.next_reply(timeout=5).data
        assert_alive(daemon)
    finally:
        for stream in streams:
            stream.close()


def test_a_job_holds_half_of_the_data_connections_at_most(daemon):
    greedy = job_token(DAEMON_TOKEN, "greedy")
    port = data_port(daemon.address, DAEMON_TOKEN)
    socks = []
    try:
        socks = [data_socket(daemon.address, greedy, port=port) for _ in range(CAP // 2)]
        time.sleep(0.3)  # their handshakes are in: both registered
        late = data_socket(daemon.address, greedy, port=port)
        code, message = read_status_frame(late)
        late.close()
        assert code == RESOURCE_EXHAUSTED.value[0], message
        assert f"job 'greedy' holds {CAP // 2} data connections, its share" in message
        # Another job gets the rest of the plane.
        good = job_token(DAEMON_TOKEN, "good")
        assert good_job([daemon.address], job="good", token=good, data_plane="tcp",
                        timeout=10) < 10
        assert_alive(daemon)
    finally:
        for sock in socks:
            sock.close()


def test_reduce_calls_are_capped_in_all(daemon):
    streams = []
    try:
        for i in range(CAP):  # the daemon's own token: every job, no share
            stream = RawStream(daemon.address, DAEMON_TOKEN, inband=True)
            stream.send(shard(f"job{i}", 0, 1, [1.0]))
            assert stream.next_reply(timeout=5).data
            streams.append(stream)
        refused = RawStream(daemon.address, DAEMON_TOKEN)
        refused.send(shard("more", 0, 1, [1.0]))
        error = refused.next_reply(timeout=5)
        refused.close()
        assert isinstance(error, grpc.RpcError) and error.code() == RESOURCE_EXHAUSTED, error
        assert f"too many Reduce calls ({CAP})" in error.details()
        assert_alive(daemon)
    finally:
        for stream in streams:
            stream.close()

