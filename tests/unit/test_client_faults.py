"""ReducerClient over in-process fake daemons (transport/fake.py): what an
operation leaves behind when it fails, and which error a timeout names."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from reducer_client import ReducerClient
from reducer_client.errors import ReducerError
from reducer_client.transport.base import TransportError
from reducer_client.transport.fake import FakeDaemon
from reducer_client.transport.link import DaemonLink

WAIT_S = 10.0


def fake_client(daemons: list[FakeDaemon], rank: int, world_size: int,
                **kwargs) -> ReducerClient:
    """A ReducerClient whose links reach `daemons` in process (gRPC-shaped)."""
    client = ReducerClient([f"127.0.0.1:{1 + i}" for i in range(len(daemons))], job="j",
                           rank=rank, world_size=world_size, node_local=False,
                           data_plane="grpc", **kwargs)
    for link in client._links:
        link.close()
    client._links = [DaemonLink(f"fake:{i}", control=d, transports=[d.transport("grpc")])
                     for i, d in enumerate(daemons)]
    return client


@pytest.fixture
def clients():
    made: list[ReducerClient] = []

    def make(*args, **kwargs) -> ReducerClient:
        made.append(fake_client(*args, **kwargs))
        return made[-1]

    yield make
    for client in made:
        client.close()


def test_an_operation_that_fails_while_still_queueing_leaves_no_chunk_behind(clients):
    """Daemon 0 fails the key in band while the client is still cutting a
    large array into small chunks: the chunks queued after the failure are
    not sent for ever, nor left waiting on the links until a deadline that
    nobody watches any more."""
    first, second = FakeDaemon(), FakeDaemon()
    first.fail_key("k", grpc.StatusCode.RESOURCE_EXHAUSTED, "over --max-inflight-bytes")
    client = clients([first, second], 0, 2, timeout=30.0, chunk_bytes=1024)
    started = time.monotonic()
    future = client.allreduce_async(np.ones(2_000_000, np.float32), "k")
    with pytest.raises(ReducerError) as failed:
        future.result(WAIT_S)
    assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - started < WAIT_S
    assert [len(link._pending) for link in client._links] == [0, 0]
    assert len(client._inflight) == 0
    sent = len(second.contributions("k"))
    assert sent < 2_000_000 * 4 // 1024 // 2  # it stopped sending the rest


def test_a_timeout_after_a_reconnect_that_worked_is_no_daemon_outage(clients):
    """The stream broke once and the daemon answered again on the new one;
    then a peer rank never sends: the timeout is DEADLINE_EXCEEDED naming the
    round, not UNAVAILABLE blaming the daemon with the old stream's error."""
    daemon = FakeDaemon()
    rank0 = clients([daemon], 0, 2, timeout=1.5)
    rank1 = clients([daemon], 1, 2, timeout=1.5)
    warm = [c.allreduce_async(np.ones(8, np.float32), "w") for c in (rank0, rank1)]
    assert [f.result(WAIT_S).tolist() for f in warm] == [[2.0] * 8] * 2
    future = rank0.allreduce_async(np.ones(8, np.float32), "k")  # rank 1 never sends it
    deadline = time.monotonic() + WAIT_S
    while not daemon.contributions("k"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    daemon.drop_streams()
    link = rank0._links[0]
    while not (link.reconnects and len(daemon.contributions("w", rank=0)) > 1):
        assert time.monotonic() < deadline, "no resend reached the daemon"
        time.sleep(0.01)
    with pytest.raises(ReducerError) as late:
        future.result(WAIT_S)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, late.value
    assert "key 'k' round 0" in str(late.value)


def test_collectives_from_two_threads_pair_their_rounds_alike_on_every_rank(clients,
                                                                            monkeypatch):
    """Each checked collective takes a control round and then a data round.
    Rank 1's thread A is pre-empted between the two while its thread B makes
    the next call: B must not take A's data round (every rank then summed A
    with B's data, and no check saw it)."""
    from reducer_client import collectives

    daemon = FakeDaemon()
    rank0, rank1 = clients([daemon], 0, 2), clients([daemon], 1, 2)
    on_wire = collectives.allreduce_async_on_wire
    b_sent = threading.Event()

    def preempted(reducer, array, key, op, wire, out=None):
        name = threading.current_thread().name
        if reducer is rank1 and key.startswith(collectives.DATA_KEY) and name == "A":
            b_sent.wait(1.0)  # B's data round would overtake A's here
        future = on_wire(reducer, array, key, op, wire, out)
        if reducer is rank1 and key.startswith(collectives.DATA_KEY) and name == "B":
            b_sent.set()
        return future

    monkeypatch.setattr(collectives, "allreduce_async_on_wire", preempted)
    results = {}

    def call(client, name, value):
        spec = collectives.Call(kind=collectives.ALLREDUCE, name=name, dtype="float32",
                                shape=(4,), data_numel=4, op="sum", wire="float32")
        results[(client.rank, name)] = collectives.allreduce_async(
            client, np.full(4, value, np.float32), spec)

    def in_thread(name, *args):
        thread = threading.Thread(target=call, args=args, name=name)
        thread.start()
        return thread

    for name, value in (("A", 1.0), ("B", 100.0)):  # rank 0: A, then B
        in_thread(name, rank0, name, value).join(WAIT_S)
    first = in_thread("A", rank1, "A", 1.0)
    time.sleep(0.2)  # A has taken its control round
    second = in_thread("B", rank1, "B", 100.0)
    first.join(WAIT_S), second.join(WAIT_S)
    got = {k: f.result(WAIT_S).tolist() for k, f in results.items()}
    assert got == {(r, "A"): [2.0] * 4 for r in (0, 1)} | {(r, "B"): [200.0] * 4
                                                           for r in (0, 1)}


def test_a_worker_that_joins_a_new_incarnation_pairs_its_checked_calls(clients):
    """Elastic membership: the survivors made checked calls under the last
    incarnation; a worker that joins starts counting control rounds from 0.
    So must the survivors under the new incarnation's keys, or the two sides
    send under different rotating keys and never meet."""
    from reducer_client import collectives
    from reducer_client.elastic.incarnation import IncarnationReducer

    daemon = FakeDaemon()
    spec = collectives.Call(kind=collectives.ALLREDUCE, name="g", dtype="float32",
                            shape=(3,), data_numel=3, op="sum", wire="float32")

    def checked(ranks, value):
        futures = [collectives.allreduce_async(r, np.full(3, value + r.rank, np.float32), spec)
                   for r in ranks]
        return [f.result(WAIT_S).tolist() for f in futures]

    old = [IncarnationReducer(clients([daemon], rank, 2, timeout=3.0), "a") for rank in (0, 1)]
    for step in range(3):
        assert checked(old, step) == [[2.0 * step + 1] * 3] * 2
    survivor = old[0]
    survivor.reset(clients([daemon], 0, 2, timeout=3.0), "b")
    joined = IncarnationReducer(clients([daemon], 1, 2, timeout=3.0), "b")
    assert checked([survivor, joined], 10) == [[21.0] * 3] * 2
    for reducer in (survivor, joined):  # the new incarnation's first round on both
        assert set(reducer.inner._rounds) == {"ib/hvd/control/1", "ib/hvd/data/1"}


def test_names_over_the_daemons_limit_are_refused_before_anything_is_sent(clients):
    from reducer_wire.codec import MAX_NAME_CHARS

    daemon = FakeDaemon()
    client = clients([daemon], 0, 1)
    with pytest.raises(ValueError, match=f"key must be a non-empty string of at most "
                                         f"{MAX_NAME_CHARS} characters"):
        client.allreduce(np.ones(4, np.float32), "k" * (MAX_NAME_CHARS + 1))
    with pytest.raises(ValueError, match="key must be a non-empty string"):
        client.allreduce(np.ones(4, np.float32), "")
    assert client.allreduce(np.ones(4, np.float32), "k" * MAX_NAME_CHARS).tolist() == [1.0] * 4
    assert len(daemon.received) == 1
    with pytest.raises(ValueError, match=f"job: must be a non-empty string of at most "
                                         f"{MAX_NAME_CHARS}"):
        ReducerClient(["127.0.0.1:1"], job="j" * (MAX_NAME_CHARS + 1), rank=0, world_size=1)


def test_a_status_probe_that_times_out_during_a_reconnect_is_retried():
    """The stream broke; the first reconnect's GetStatus is not answered in
    time (DEADLINE_EXCEEDED: a daemon whose loop stalled). The chunk, with
    its deadline far off, is resent once the daemon answers, instead of
    failing at once as not retryable."""
    daemon = FakeDaemon()
    probes = []

    class StallsOnce:
        def brief_status(self):
            probes.append(time.monotonic())
            if len(probes) == 2:  # the first reconnect meets the stall
                raise TransportError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return daemon.brief_status()

        def close(self):
            pass

    link = DaemonLink("fake:1", control=StallsOnce(), transports=[daemon.transport("grpc")])
    peer = DaemonLink("fake:1", control=daemon, transports=[daemon.transport("grpc")])
    answers: list = []
    try:
        send_one(link, 0, answers)
        deadline = time.monotonic() + WAIT_S
        while not daemon.contributions("k"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        daemon.drop_streams()
        while len(probes) < 3:  # the stalled probe, then one that is answered
            assert not answers, answers  # failed instead of retried
            assert time.monotonic() < deadline, probes
            time.sleep(0.01)
        assert answers == []  # still waiting, not failed
        send_one(peer, 1, [])
        while not answers:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        [(reply, error)] = answers
        assert error is None and np.frombuffer(reply.data, np.float32).tolist() == [2.0] * 4
    finally:
        link.close(), peer.close()


def send_one(link: DaemonLink, rank: int, answers: list) -> None:
    """Rank `rank`'s contribution of ones to key "k" (world of 2), answers appended."""
    from reducer_wire import convert
    from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
    from reducer_wire.codec import ShardEncoder

    encoder = ShardEncoder(job="j", key="k", rank=rank, world_size=2, dtype=pb.DTYPE_FLOAT32,
                           op=pb.REDUCE_OP_SUM, data_nbytes=16)
    message = link.message(("k", 0), encoder.nbytes)
    convert.to_wire(np.ones(4, np.float32), pb.DTYPE_FLOAT32,
                    out=encoder.write_into(message.shard))
    link.send(("k", 0, 0), message, lambda reply, error: answers.append((reply, error)),
              time.monotonic() + 30)


def test_a_call_that_fails_inside_the_client_keeps_its_rank_in_step(clients, monkeypatch):
    """A failure inside the client (here MemoryError cutting the array) before
    anything was sent takes no round of the key: the rank's next call pairs
    with the others' instead of running one round ahead of them for good."""
    from reducer_wire.layout import KeyLayout

    daemon = FakeDaemon()
    rank0, rank1 = clients([daemon], 0, 2), clients([daemon], 1, 2)
    real_plan = KeyLayout.plan

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for the layout")

    monkeypatch.setattr(KeyLayout, "plan", out_of_memory)
    with pytest.raises(MemoryError):
        rank0.allreduce(np.ones(4, np.float32), "k")
    monkeypatch.setattr(KeyLayout, "plan", real_plan)
    futures = [c.allreduce_async(np.full(4, c.rank + 1.0, np.float32), "k")
               for c in (rank0, rank1)]
    assert [f.result(WAIT_S).tolist() for f in futures] == [[3.0] * 4] * 2


def test_a_failure_while_sending_fails_the_operation_and_drops_what_went_out(clients,
                                                                           monkeypatch):
    """A non-ReducerError in the send loop (MemoryError for a message buffer)
    reaches the caller, and the operation it began is failed at once with
    INTERNAL and its chunks dropped, not left waiting for its deadline."""
    daemon = FakeDaemon()
    client = clients([daemon], 0, 2, timeout=30.0, chunk_bytes=64)
    link = client._links[0]
    real_message, calls = link.message, []

    def runs_out(slot, nbytes):
        calls.append(slot)
        if len(calls) == 3:
            raise MemoryError("no buffer")
        return real_message(slot, nbytes)

    monkeypatch.setattr(link, "message", runs_out)
    with pytest.raises(MemoryError):
        client.allreduce_async(np.ones(1024, np.float32), "k")  # 32 chunks
    assert len(link._pending) == 0 and len(client._inflight) == 0
