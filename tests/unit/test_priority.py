"""Priority (Shard.priority) ordered on both ends: the client's link queue
sends the most urgent queued chunk first, the daemon's outboxes send a
stream's most urgent reply first; equals keep their order, 0 comes last,
and a stream's last item (END) stays after its replies. Nothing waits
beyond a few seconds.
"""

import asyncio
import threading
import time

import numpy as np
import pytest
from reducer_client.testing import LocalGroup
from reducer_client.transport.fake import FakeDaemon
from reducer_client.transport.link import DaemonLink
from reducer_client.transport.order import LinkQueue, SendOrder
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from test_send_order import _HeldTransport, _send  # the held transport, shared

from reducerd.core.reduction import ReductionTable
from reducerd.dataplane.outbox import AsyncOutbox, ThreadOutbox
from reducerd.service.session import END, Session, Stream, decode_request

pytestmark = pytest.mark.timeout(60)
F16 = pb.DTYPE_FLOAT16


def test_link_queue_takes_the_highest_priority_first_in_order_among_equals():
    q = LinkQueue()
    for item, priority in (("a0", 0), ("b3", 3), ("c0", 0), ("d7", 7), ("e3", 3), ("f7", 7)):
        q.put(item, priority)
    assert len(q) == 6
    assert [q.get() for _ in range(6)] == ["d7", "f7", "b3", "e3", "a0", "c0"]


def test_link_queue_get_waits_for_a_put():
    q = LinkQueue()
    got = []
    thread = threading.Thread(target=lambda: got.append(q.get()))
    thread.start()
    time.sleep(0.05)
    assert not got
    q.put("x", 2)
    thread.join(timeout=2)
    assert got == ["x"]


def test_a_link_sends_a_later_urgent_chunk_before_the_queued_ones():
    """While the transport holds chunk 0 of a priority-0 key, chunks 1-3 queue
    behind it; a priority-5 chunk queued after them goes next."""
    held = _HeldTransport(flowing=False)
    link = DaemonLink("a:1", control=FakeDaemon(), transports=[held])
    try:
        order = SendOrder(4, window=4)
        for index in range(4):
            _send(link, order, index)
        deadline = time.monotonic() + 2
        while not held.taken and time.monotonic() < deadline:
            time.sleep(0.01)
        _send(link, SendOrder(1, window=1), 99, priority=5)
        held.flowing.set()
        deadline = time.monotonic() + 5
        while len(held.taken) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.taken == [0, 99, 1, 2, 3]
    finally:
        link.close()


def test_thread_outbox_sends_urgent_replies_first_and_end_last():
    outbox = ThreadOutbox()
    for item, priority in ((b"low-1", 0), (b"high", 9), (b"mid", 4), (b"low-2", 0)):
        outbox.put_nowait(item, priority)
    outbox.put_nowait(END)
    assert [outbox.take()[0] for _ in range(5)] == [b"high", b"mid", b"low-1", b"low-2", END]
    assert outbox.wait_below(1, 1 << 20, 0.1)


def test_async_outbox_sends_urgent_replies_first_and_waits_for_one():
    async def scenario():
        outbox = AsyncOutbox()
        getter = asyncio.ensure_future(outbox.get())
        await asyncio.sleep(0.01)
        assert not getter.done()
        outbox.put_nowait(b"first", 0)
        assert await asyncio.wait_for(getter, 2) == b"first"
        for item, priority in ((b"low", 0), (b"high", 2), (b"higher", 3)):
            outbox.put_nowait(item, priority)
        outbox.put_nowait(END)
        return [await asyncio.wait_for(outbox.get(), 2) for _ in range(4)]

    assert asyncio.run(scenario()) == [b"higher", b"high", b"low", END]


def _shard(key, priority, rank=0, world_size=1):
    data = convert.to_wire(np.ones(4, np.float32), F16).tobytes()
    return decode_request(pb.Shard(job="j", key=key, rank=rank, world_size=world_size,
                                   dtype=F16, op=pb.REDUCE_OP_SUM, data=data,
                                   priority=priority).SerializeToString())


def test_daemon_answers_a_stream_by_the_priority_of_its_shards():
    """Three chunks complete in the order a, b, c (world size 2, rank 1 last);
    the stream that gave b priority 5 and c priority 2 hears b, c, a; the
    stream that gave none hears a, b, c."""
    session = Session(ReductionTable(60, 1 << 30))
    urgent = Stream("urgent", False, outbox=ThreadOutbox(), frames=True)
    plain = Stream("plain", False, outbox=ThreadOutbox(), frames=True)
    for key, priority in (("a", 0), ("b", 5), ("c", 2)):
        assert session.accept(_shard(key, priority, rank=0, world_size=2), urgent)
    for key in ("a", "b", "c"):
        assert session.accept(_shard(key, 0, rank=1, world_size=2), plain)
    heard = {name: [] for name in ("urgent", "plain")}
    for stream in (urgent, plain):
        while stream.outbox.wait_below(1, 1 << 30, 0) is False:
            heard[stream.peer].append(_key_of(stream.outbox.take()[0]))
    assert heard == {"urgent": ["b", "c", "a"], "plain": ["a", "b", "c"]}
    assert not urgent.priorities and not plain.priorities  # nothing left behind


def _key_of(reply):
    from reducer_wire.codec import decode_shard

    return decode_shard(bytes(reply.message)).key


def test_priority_is_checked_and_local_group_takes_it():
    group = LocalGroup(1, timeout=5)
    reducer = group.client(0)
    assert reducer.allreduce(np.ones(3, np.float32), "k", priority=7).tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="priority"):
        reducer.allreduce(np.ones(3, np.float32), "k", priority=-1)


def test_client_refuses_a_bad_priority_before_sending():
    from reducer_client import ReducerClient

    with ReducerClient(["127.0.0.1:1"], job="j", rank=0, world_size=1, timeout=1) as client:
        for bad in (-1, 1 << 32, 1.5):
            with pytest.raises(ValueError, match="priority"):
                client.allreduce_async(np.ones(2, np.float32), "k", priority=bad)


def test_link_queue_puts_back_at_the_head_of_a_priority():
    q = LinkQueue()
    for item, priority in (("a", 0), ("b", 0), ("x", 3), ("y", 3)):
        q.put(item, priority)
    assert q.urgent_beyond(0) and q.urgent_beyond(2) and not q.urgent_beyond(3)
    assert q.get() == "x"
    q.put("x", 3, front=True)  # a sender puts back what it took
    q.put("z", 3)
    q.put("c", 0, front=True)
    assert [q.get() for _ in range(6)] == ["x", "y", "z", "c", "a", "b"]
    assert not q.urgent_beyond(0)


class _CountingOrder(SendOrder):
    """A SendOrder that counts how often a waiter looks at its condition."""

    looks = 0

    def _may_go(self, index: int) -> bool:
        self.looks += 1
        return super()._may_go(index)


def test_a_sender_waiting_its_turn_sleeps_until_an_urgent_chunk_comes():
    """Chunk 1 waits for chunk 0 (never handed over, on no link) without polling
    (the sender used to look every 2 ms, 500 wake-ups a second per link); an
    urgent chunk queued meanwhile wakes it, goes first, and chunk 1 follows
    once its turn comes."""
    held = _HeldTransport(flowing=True)
    link = DaemonLink("a:1", control=FakeDaemon(), transports=[held])
    try:
        order = _CountingOrder(2, window=1, max_wait_s=10.0)
        _send(link, order, 1)
        time.sleep(0.3)
        assert held.taken == [] and order.looks <= 4, order.looks
        start = time.monotonic()
        _send(link, SendOrder(1, window=1), 99, priority=5)
        deadline = start + 5
        while not held.taken and time.monotonic() < deadline:
            time.sleep(0.005)
        assert held.taken == [99] and time.monotonic() - start < 1.0
        order.handed(0)
        deadline = time.monotonic() + 5
        while len(held.taken) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert held.taken == [99, 1] and not order.released
    finally:
        link.close()


def test_a_link_queue_is_idle_only_while_its_taker_waits_with_nothing_queued():
    outbox = LinkQueue()
    assert not outbox.idle()  # no taker yet
    taken = []
    taker = threading.Thread(target=lambda: taken.append(outbox.get()))
    taker.start()
    deadline = time.monotonic() + 5
    while not outbox.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outbox.idle()
    outbox.put("item")
    assert not outbox.idle()  # queued, or taken: the taker has work
    taker.join(5)
    assert taken == ["item"] and not outbox.idle()
