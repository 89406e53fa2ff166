"""DaemonLink over the in-process fake daemon: reconnect, resend, backoff,
fallback, forget, a bounded history and recycled send buffers; no sockets.

Every wait is bounded (queue timeouts of a few seconds); each scenario's
docstring says what happens to the daemon and what the link must do.
"""

import logging
import queue
import threading
import time

import grpc
import numpy as np
import pytest
from reducer_client.errors import ReducerError
from reducer_client.transport.base import Transport, TransportError
from reducer_client.transport.fake import FakeDaemon
from reducer_client.transport.link import DaemonLink
from reducer_client.transport.tcp import TcpTransport
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardEncoder

pytestmark = pytest.mark.timeout(60)
F32 = pb.DTYPE_FLOAT32
WAIT_S = 5.0


class Replies:
    """A reply handler that queues (values, error); values copied at once (a
    reply's data is valid only while the handler runs)."""

    def __init__(self):
        self.queue = queue.Queue()
        self.calls = 0

    def __call__(self, reply, error):
        self.calls += 1
        values = None if reply is None else np.frombuffer(bytes(reply.data), "<f4").copy()
        self.queue.put((values, error))

    def get(self, timeout=WAIT_S):
        return self.queue.get(timeout=timeout)


def link_to(daemon, *names, **kwargs):
    transports = [daemon.transport(n) for n in names or ("grpc",)]
    return DaemonLink("fake:1", control=daemon, transports=transports, **kwargs)


def send(link, key, round_, values, rank, world_size, offset=0, deadline_s=float("inf"),
         handler=None):
    """Encode a float32 shard into a buffer from the link (as the client does) and send it."""
    values = np.asarray(values, dtype=np.float32)
    encoder = ShardEncoder(job="j", key=key, rank=rank, world_size=world_size, round=round_,
                           offset=offset, dtype=F32, op=pb.REDUCE_OP_SUM,
                           data_nbytes=values.nbytes)
    message = link.message((key, offset), encoder.nbytes)
    convert.to_wire(values, F32, out=encoder.write_into(message.shard))
    handler = handler or Replies()
    link.send((key, round_, offset), message, handler, deadline_s)
    return handler, message


@pytest.fixture
def daemon():
    return FakeDaemon()


def test_two_ranks_get_the_sum(daemon):
    a, b = link_to(daemon), link_to(daemon)
    try:
        ra, _ = send(a, "k", 0, [1, 2], rank=0, world_size=2)
        rb, _ = send(b, "k", 0, [10, 20], rank=1, world_size=2)
        for replies in (ra, rb):
            values, error = replies.get()
            assert error is None and values.tolist() == [11, 22]
        assert a.transport == "grpc" and a.reconnects == 0
    finally:
        a.close()
        b.close()


def test_broken_stream_reconnects_and_resends_what_is_open(daemon):
    """The stream breaks while rank 0's chunk waits for rank 1: the link opens
    a new stream and resends it; the daemon counts rank 0 once."""
    a, b = link_to(daemon), link_to(daemon)
    try:
        ra, _ = send(a, "k", 0, [1, 2], rank=0, world_size=2)
        deadline = time.monotonic() + WAIT_S
        while not daemon.contributions("k", rank=0):
            assert time.monotonic() < deadline
            time.sleep(0.03)  # 1.5 s of sending: most drops land mid-stream
        assert daemon.drop_streams() == 1
        rb, _ = send(b, "k", 0, [10, 20], rank=1, world_size=2)
        assert ra.get()[0].tolist() == [11, 22] and rb.get()[0].tolist() == [11, 22]
        assert a.reconnects == 1 and len(daemon.contributions("k", rank=0)) == 2
    finally:
        a.close()
        b.close()


def test_restart_resends_the_last_completed_round(daemon):
    """Round 0 completes; rank 0 has its result, rank 1's is still on the way
    when the daemon restarts and forgets everything. Rank 1 resends round 0;
    rank 0, at its next stream (round 1), resends its round-0 contribution
    first, so round 0 completes again for rank 1, then round 1 for both."""
    a = link_to(daemon)
    b = DaemonLink("fake:1", control=daemon, transports=[daemon.transport("slow", delay_s=0.5)])
    try:
        ra, _ = send(a, "k", 0, [1, 2], rank=0, world_size=2)
        rb, _ = send(b, "k", 0, [10, 20], rank=1, world_size=2)
        assert ra.get()[0].tolist() == [11, 22]
        daemon.restart()  # rank 1's reply, still delayed, is lost with its stream
        ra1, _ = send(a, "k", 1, [2, 3], rank=0, world_size=2)
        assert rb.get()[0].tolist() == [11, 22]  # round 0 again, from both resends
        rb1, _ = send(b, "k", 1, [20, 30], rank=1, world_size=2)
        assert ra1.get()[0].tolist() == [22, 33] and rb1.get(timeout=WAIT_S)[0].tolist() == [
            22, 33]
        resent = [(r.round, r.stream) for r in daemon.contributions("k", rank=0)]
        assert [r for r, _ in resent] == [0, 0, 1]  # round 0 went out again before round 1
    finally:
        a.close()
        b.close()


def test_without_the_history_a_restart_leaves_the_other_rank_waiting(daemon):
    """The control for the test above: with nothing kept, rank 1 never gets
    round 0 (the client's watchdog would fail it at its deadline)."""
    a = link_to(daemon)
    b = DaemonLink("fake:1", control=daemon, transports=[daemon.transport("slow", delay_s=0.5)])
    a.history.max_slots = 0
    try:
        ra, _ = send(a, "k", 0, [1, 2], rank=0, world_size=2)
        rb, _ = send(b, "k", 0, [10, 20], rank=1, world_size=2)
        assert ra.get()[0].tolist() == [11, 22]
        daemon.restart()
        send(a, "k", 1, [2, 3], rank=0, world_size=2)
        with pytest.raises(queue.Empty):
            rb.get(timeout=1.5)
        assert [r.round for r in daemon.contributions("k", rank=0)] == [0, 1]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("code,details", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many data connections (4096)"),
    (grpc.StatusCode.UNAVAILABLE, "connection refused"),
])
def test_refused_streams_are_retried_with_backoff_until_the_deadline(daemon, code, details):
    """A daemon that refuses every connection (for capacity, or down): the
    link retries with a growing backoff, fails the chunk with that reason at
    its deadline, not later, and then stops trying."""
    daemon.refuse(code, details, times=None)
    link = link_to(daemon)
    try:
        start = time.monotonic()
        replies, _ = send(link, "k", 0, [1], rank=0, world_size=2, deadline_s=start + 0.8)
        values, error = replies.get()
        elapsed = time.monotonic() - start
        assert values is None and error.code == code and details in str(error)
        assert error.retryable and "deadline" in str(error)
        assert 0.8 <= elapsed < 0.8 + 0.3
        attempts = len(daemon.opens)
        assert 4 <= attempts <= 8  # 0, 50, 100, 200, 400 ms: backoff, not a busy loop
        time.sleep(0.5)
        assert len(daemon.opens) == attempts and replies.calls == 1
    finally:
        link.close()


def test_a_refusal_that_ends_is_ridden_out(daemon):
    daemon.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many data connections", times=3)
    link = link_to(daemon)
    try:
        replies, _ = send(link, "k", 0, [4, 5], rank=0, world_size=1)
        values, error = replies.get()
        assert error is None and values.tolist() == [4, 5]
        assert len(daemon.opens) == 4 and link.last_error is None
    finally:
        link.close()


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.FAILED_PRECONDITION])
def test_a_refusal_no_retry_can_fix_fails_at_once(daemon, code):
    daemon.refuse(code, "no", times=None)
    link = link_to(daemon)
    try:
        start = time.monotonic()
        replies, _ = send(link, "k", 0, [1], rank=0, world_size=1, deadline_s=start + 30)
        values, error = replies.get()
        assert error.code == code and not error.retryable
        assert time.monotonic() - start < 0.5 and len(daemon.opens) == 1
    finally:
        link.close()


def test_in_band_resource_exhausted_fails_the_chunk_without_a_retry(daemon):
    """A chunk over the daemon's memory limit is answered in band: that fails
    its operation at once, it is not resent."""
    daemon.fail_key("big", grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "chunk needs 4096 more bytes, over the limit (--max-inflight-bytes)")
    link = link_to(daemon)
    try:
        replies, _ = send(link, "big", 0, [1], rank=0, world_size=2)
        values, error = replies.get()
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not error.retryable
        assert "--max-inflight-bytes" in str(error)
        time.sleep(0.2)
        assert len(daemon.contributions("big")) == 1 and len(daemon.opens) == 1
        ok, _ = send(link, "fine", 0, [1], rank=0, world_size=1)  # the stream goes on
        assert ok.get()[0].tolist() == [1]
    finally:
        link.close()


def test_tcp_falls_back_to_grpc_and_back(daemon, caplog):
    """auto: the data plane first; unreachable, the stream goes through gRPC
    (warned once); reachable again, the next stream takes it again."""
    daemon.reachable("tcp", False)
    link = link_to(daemon, "tcp", "grpc")
    try:
        with caplog.at_level(logging.WARNING, "reducer_client"):
            assert send(link, "k", 0, [1], rank=0, world_size=1)[0].get()[0].tolist() == [1]
        assert link.transport == "grpc"
        assert "fake tcp unreachable" in caplog.text and "through fake grpc" in caplog.text
        daemon.reachable("tcp", True)
        daemon.drop_streams()
        assert send(link, "k", 1, [2], rank=0, world_size=1)[0].get()[0].tolist() == [2]
        assert link.transport == "tcp" and daemon.opens == ["tcp", "grpc", "tcp"]
    finally:
        link.close()


def test_no_data_port_means_grpc_quietly_and_a_clear_error_for_tcp_only(caplog):
    """The real TcpTransport: a daemon whose brief status names no data port
    is NotOffered before any socket; auto goes through the next transport
    without a warning, tcp alone fails at once with FAILED_PRECONDITION."""
    daemon = FakeDaemon(data_port=0)
    tcp = TcpTransport("127.0.0.1", "", 1 << 20)
    auto = DaemonLink("fake:1", control=daemon, transports=[tcp, daemon.transport("grpc")])
    only_tcp = DaemonLink("fake:1", control=daemon, transports=[tcp])
    try:
        with caplog.at_level(logging.WARNING, "reducer_client"):
            assert send(auto, "k", 0, [3], rank=0, world_size=1)[0].get()[0].tolist() == [3]
        assert auto.transport == "grpc" and "unreachable" not in caplog.text
        values, error = send(only_tcp, "k", 0, [3], rank=0, world_size=1)[0].get()
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--data-listen" in str(error)
    finally:
        auto.close()
        only_tcp.close()


def test_forget_drops_the_chunk_and_its_retries(daemon):
    """An operation that gave up forgets its chunks: the late reply calls no
    handler, and a break afterwards opens no new stream for them."""
    a, b = link_to(daemon), link_to(daemon)
    try:
        ra, _ = send(a, "k", 0, [1], rank=0, world_size=2)
        a.forget([("k", 0, 0)])
        rb, _ = send(b, "k", 0, [2], rank=1, world_size=2)
        assert rb.get()[0].tolist() == [3]
        time.sleep(0.2)
        assert ra.calls == 0
        opens = len(daemon.opens)
        daemon.drop_streams()
        time.sleep(0.3)
        assert len(daemon.opens) == opens and ra.calls == 0
    finally:
        a.close()
        b.close()


def test_history_is_pruned_by_the_round_timeout_and_bounded_in_count():
    """What the daemon can no longer use is dropped: a contribution completed
    more than a round timeout ago, and the oldest past max_slots; a reconnect
    resends only the rest."""
    daemon = FakeDaemon(round_timeout_s=0.3)
    link = link_to(daemon)
    try:
        send(link, "old", 0, [1], rank=0, world_size=1)[0].get()
        time.sleep(0.4)
        send(link, "new", 0, [1], rank=0, world_size=1)[0].get()
        assert link.history.round_timeout_s == 0.3
        assert list(link.history.rounds()) == [("new", 0)]
        daemon.drop_streams()
        send(link, "next", 0, [1], rank=0, world_size=1)[0].get()
        resent = [r.key for r in daemon.received if r.stream > 1]
        assert resent == ["new", "next"]
        link.history.max_slots = 3
        for i in range(5):
            send(link, f"key{i}", 0, [1], rank=0, world_size=1)[0].get()
        assert list(link.history.rounds()) == [("key2", 0), ("key3", 0), ("key4", 0)]
    finally:
        link.close()


def test_send_buffers_alternate_per_slot(daemon):
    """Steady state allocates nothing per chunk: round r + 2 is encoded into
    round r's buffer, two buffers per slot alternate. (From round 1: round 0
    is a field protobuf omits, so its message is two bytes shorter.)"""
    link = link_to(daemon)
    try:
        ids = []
        for round_ in range(1, 7):
            replies, message = send(link, "k", round_, [round_, 1], rank=0, world_size=1)
            assert replies.get()[0].tolist() == [round_, 1]
            ids.append(id(message.buffer))
        assert ids[2:] == ids[:2] * 2 and ids[0] != ids[1]
    finally:
        link.close()


class FirstStreamStuck(Transport):
    """Its first stream takes one request and never asks for the next (as a
    sender thread that died in sendall), then breaks; later streams go to
    the fake daemon."""

    name = label = "stuck-then-fake"

    def __init__(self, daemon):
        self.inner, self.opened = daemon.transport("grpc"), 0

    def open(self, requests, info):
        self.opened += 1
        if self.opened > 1:
            return self.inner.open(requests, info)
        next(requests)
        return self._break_soon()

    @staticmethod
    def _break_soon():
        time.sleep(0.1)
        raise TransportError(grpc.StatusCode.UNAVAILABLE, "sender died")
        yield

    def close(self):
        self.inner.close()


def test_a_buffer_a_dead_stream_may_hold_is_never_reused(daemon):
    link = DaemonLink("fake:1", control=daemon, transports=[FirstStreamStuck(daemon)])
    try:
        messages = []
        for round_ in range(4):
            replies, message = send(link, "k", round_, [round_], rank=0, world_size=1)
            assert replies.get()[0].tolist() == [round_]
            messages.append(message)
        assert link.reconnects == 1
        assert messages[0].queued == 1  # still held by the dead stream's sender
        assert messages[2] is not messages[0]  # so round 2 got a fresh buffer
        assert messages[3] is messages[1]  # while round 1's was recycled as usual
    finally:
        link.close()


def test_a_handler_that_raises_does_not_stop_the_others(daemon):
    link = link_to(daemon)
    try:
        def broken(reply, error):
            raise RuntimeError("handler bug")
        send(link, "a", 0, [1], rank=0, world_size=1, handler=broken)
        ok, _ = send(link, "b", 0, [2], rank=0, world_size=1)
        assert ok.get()[0].tolist() == [2] and link.reconnects == 0
    finally:
        link.close()


def test_close_fails_sends_and_stops_a_backoff_at_once(daemon):
    daemon.down = True
    link = link_to(daemon)
    send(link, "k", 0, [1], rank=0, world_size=1, deadline_s=time.monotonic() + 30)
    time.sleep(0.3)  # backing off by now
    start = time.monotonic()
    link.close()
    with pytest.raises(ReducerError) as info:
        send(link, "k", 1, [1], rank=0, world_size=1)
    assert info.value.code == grpc.StatusCode.CANCELLED
    time.sleep(0.1)
    opens = len(daemon.opens)
    time.sleep(1.2)
    assert len(daemon.opens) == opens and time.monotonic() - start < 5


def test_an_old_round_completed_again_does_not_hide_a_newer_result(daemon):
    """After breaks, two ranks' histories may both resend round r - 1 and so
    complete it again, after round r completed; a resend of round r (its reply
    was lost) must still get round r's result. (The fake kept one round per
    slot and hung here, about 1 in 20 runs of the test below under load.)"""
    a, b = link_to(daemon), link_to(daemon)
    try:
        for round_ in (0, 1):
            pair = [send(link, "k", round_, [round_ + rank], rank=rank, world_size=2)[0]
                    for rank, link in enumerate((a, b))]
            assert [r.get()[0].tolist() for r in pair] == [[2 * round_ + 1]] * 2
        stale = [send(link, "k", 0, [rank], rank=rank, world_size=2)[0]
                 for rank, link in enumerate((a, b))]
        assert [r.get()[0].tolist() for r in stale] == [[1]] * 2
        again, _ = send(a, "k", 1, [1], rank=0, world_size=2)
        values, error = again.get()
        assert error is None and values.tolist() == [3]
    finally:
        a.close()
        b.close()


def test_training_through_repeated_breaks_loses_nothing(daemon):
    """Two ranks, each on its own thread, run 40 steps of 8 chunks (a step
    waits for its results, as training does) while the daemon drops every
    stream ten times, every 0.15 s: every chunk is answered once, right.

    (Steps, not rounds fired ahead: the daemon keeps only a chunk's last
    result, so a rank that resends round r after the others completed r + 1
    would wait in vain; contract section 2.)"""
    links = [link_to(daemon) for _ in range(2)]
    stop = threading.Event()
    failures = []

    def chaos():
        for _ in range(10):
            if stop.wait(0.15):
                return
            daemon.drop_streams()

    def train(rank):
        try:
            for step in range(40):
                handlers = [send(links[rank], "k", step, [step + rank], rank=rank,
                                 world_size=2, offset=offset)[0] for offset in range(8)]
                for replies in handlers:
                    values, error = replies.get(timeout=20)
                    assert error is None and values.tolist() == [2 * step + 1]
                    assert replies.calls == 1
                time.sleep(0.03)  # 40 steps take over a second: most drops land mid-step
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=chaos)] + [
        threading.Thread(target=train, args=(rank,)) for rank in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads[1:]:
            thread.join(60)
        assert failures == []
        assert all(len(link.history) == 8 for link in links)  # one slot per offset
        assert sum(link.reconnects for link in links) >= 5
    finally:
        stop.set()
        threads[0].join()
        for link in links:
            link.close()
