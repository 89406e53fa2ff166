"""SendOrder (transport/order.py): one operation's chunks handed over in step
across the daemon links, at most `credits` of them unanswered on a link;
never a deadlock, never a wait beyond max_wait_s (the window) or stall_s
without progress (the credits).

Every wait is bounded (a few seconds at most).
"""

import queue
import random
import threading
import time

import numpy as np
import pytest
from reducer_client.transport.base import HEADROOM, Transport
from reducer_client.transport.fake import FakeDaemon
from reducer_client.transport.link import DaemonLink
from reducer_client.transport.order import SendOrder
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import ShardEncoder, ShardView, decode_shard

pytestmark = pytest.mark.timeout(60)


def test_a_chunk_goes_once_every_chunk_a_window_before_it_went():
    order = SendOrder(6, window=2, max_wait_s=0.05)
    assert order.wait(0) and order.wait(1)  # nothing before them to wait for
    start = time.monotonic()
    assert not order.wait(2)  # chunk 0 not handed: gives up after max_wait_s ...
    assert 0.04 < time.monotonic() - start < 1.0
    assert order.released and order.wait(5)  # ... and stops pacing the operation

    order = SendOrder(6, window=2, max_wait_s=5.0)
    order.handed(1)
    assert order.frontier == 0  # chunk 0 still out
    order.handed(0)
    assert order.frontier == 2 and order.wait(3) and not order.released


def test_handing_over_wakes_the_waiter_and_release_frees_everyone():
    order = SendOrder(4, window=1, max_wait_s=5.0)
    results: queue.Queue = queue.Queue()
    waiters = [threading.Thread(target=lambda i=i: results.put((i, order.wait(i))))
               for i in (1, 3)]
    for thread in waiters:
        thread.start()
    time.sleep(0.05)
    assert results.empty()
    order.handed(0)
    assert results.get(timeout=2) == (1, True)  # its turn, not a timeout
    assert results.empty()  # chunk 3 still waits for 1 and 2
    order.release()
    assert results.get(timeout=2) == (3, True)
    for thread in waiters:
        thread.join(timeout=2)


def test_links_in_step_never_deadlock_and_keep_the_order():
    """D threads, each sending its own queue in order (the links), chunks dealt
    round-robin: all are handed over, each only after every chunk more than a
    window before it, and with jittery senders no wait gives up."""
    links, count, window = 4, 400, 4
    order = SendOrder(count, window, max_wait_s=5.0)
    handed: list[int] = []
    lock = threading.Lock()
    rng = random.Random(7)
    delays = [[rng.random() * 2e-4 for _ in range(count)] for _ in range(links)]

    def sender(link: int) -> None:
        for index in range(link, count, links):
            assert order.wait(index)
            with lock:
                assert all(i in handed for i in range(index - window + 1)), index
            time.sleep(delays[link][index])
            with lock:
                handed.append(index)
            order.handed(index)

    threads = [threading.Thread(target=sender, args=(d,)) for d in range(links)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(handed) == list(range(count)) and not order.released


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="window"):
        SendOrder(3, window=0)
    with pytest.raises(IndexError, match="chunk 3 of an operation of 3"):
        SendOrder(3, window=1).turn(3)


class _HeldTransport(Transport):
    """Takes requests on a thread of its own, but only while `flowing` is set
    (each take is one request handed over); records the offsets it took and
    never replies (the link's reader waits until close)."""

    name = label = "held"

    def __init__(self, flowing: bool) -> None:
        self.flowing = threading.Event()
        if flowing:
            self.flowing.set()
        self.taken: list[int] = []
        self._closed = threading.Event()

    def open(self, requests, daemon):
        def take():
            for item in requests:
                self.taken.append(decode_shard(bytes(item[HEADROOM:])).offset)
                while not self.flowing.wait(0.01):
                    if self._closed.is_set():
                        return

        threading.Thread(target=take, daemon=True).start()
        return self._replies()

    def _replies(self):
        self._closed.wait(30)
        return
        yield

    def close(self) -> None:
        self._closed.set()


def _send(link: DaemonLink, order: SendOrder, index: int, priority: int = 0) -> None:
    """Chunk `index` of key "k" (its offset is the index), turn `index` of order."""
    values = np.ones(4, dtype=np.float32)
    encoder = ShardEncoder(job="j", key="k", rank=0, world_size=1, round=0, offset=index,
                           dtype=pb.DTYPE_FLOAT32, op=pb.REDUCE_OP_SUM,
                           data_nbytes=values.nbytes, priority=priority)
    message = link.message(("k", index), encoder.nbytes)
    np.frombuffer(encoder.write_into(message.shard), "<f4")[:] = values
    link.send(("k", 0, index), message, lambda reply, error: None,
              turn=order.turn(min(index, order.count - 1)), priority=priority)


def test_a_link_waits_for_the_slow_link_then_gives_up_on_it():
    """Chunks 0, 2, 4 on link A, whose transport holds chunk 0; 1, 3, 5 on B.
    B sends chunk 1 (nothing a window before it) and then waits: chunk 3 needs
    chunk 0 handed over. Once A moves on, B follows. With A held past
    max_wait_s, B goes on alone."""
    daemon = FakeDaemon()
    for hold_s, max_wait_s in ((0.3, 5.0), (None, 0.2)):
        held, free = _HeldTransport(flowing=False), _HeldTransport(flowing=True)
        links = [DaemonLink("a:1", control=daemon, transports=[held]),
                 DaemonLink("b:1", control=daemon, transports=[free])]
        try:
            order = SendOrder(6, window=2, max_wait_s=max_wait_s)
            for index in range(6):
                _send(links[index % 2], order, index)
            if hold_s is not None:
                time.sleep(hold_s)
                assert held.taken == [0] and free.taken == [1]
                held.flowing.set()
            deadline = time.monotonic() + 5
            while len(free.taken) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert free.taken == [1, 3, 5]
            assert order.released == (hold_s is None)
        finally:
            for link in links:
                link.close()


def test_a_turn_waits_in_slices_and_gives_up_past_max_wait():
    order = SendOrder(4, window=1, max_wait_s=0.1)
    turn = order.turn(2)
    assert not turn.wait(0.02) and not order.released  # not its turn yet, not given up
    assert 0.015 < turn.waited_s < 0.1
    while not turn.wait(0.02):
        pass
    assert order.released and turn.waited_s >= 0.1  # gave up after max_wait_s in all
    order = SendOrder(4, window=1, max_wait_s=5.0)
    turn = order.turn(1)
    order.handed(0)
    assert turn.wait(0.0)


def test_a_sender_held_by_a_turn_lets_a_more_urgent_chunk_go_first():
    """Link B has sent chunk 1 of a priority-0 operation and waits for chunk
    3's turn (chunk 0 is held on link A). A priority-5 chunk queued on B goes
    at once, then chunk 3 goes back to waiting; once A moves on, B follows."""
    daemon = FakeDaemon()
    held, free = _HeldTransport(flowing=False), _HeldTransport(flowing=True)
    links = [DaemonLink("a:1", control=daemon, transports=[held]),
             DaemonLink("b:1", control=daemon, transports=[free])]
    try:
        order = SendOrder(6, window=2, max_wait_s=10.0)
        for index in range(6):
            _send(links[index % 2], order, index)
        time.sleep(0.1)
        assert free.taken == [1]
        start = time.monotonic()
        _send(links[1], SendOrder(1, window=1), 99, priority=5)
        while len(free.taken) < 2 and time.monotonic() - start < 2:
            time.sleep(0.002)
        assert free.taken == [1, 99] and time.monotonic() - start < 0.5
        time.sleep(0.05)
        assert free.taken == [1, 99]  # chunk 3 still waits for its turn
        held.flowing.set()
        deadline = time.monotonic() + 5
        while len(free.taken) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert free.taken == [1, 99, 3, 5] and not order.released
    finally:
        for link in links:
            link.close()


def test_a_link_holds_at_most_credits_chunks_unanswered():
    order = SendOrder(8, window=8, max_wait_s=5.0, credits=2, stall_s=5.0)
    assert order.take_credit(0, link=0) and order.take_credit(1, link=0)
    assert order.take_credit(2, link=1)  # another link's credits are its own
    start = time.monotonic()
    assert not order.take_credit(3, link=0, timeout_s=0.05)  # two unanswered on link 0
    assert 0.04 < time.monotonic() - start < 1.0 and not order.unpaced
    order.answered(0, link=0)
    assert order.take_credit(3, link=0, timeout_s=0.0)
    assert order.take_credit(3, link=0, timeout_s=0.0)  # taken once: asking again is free
    assert not order.take_credit(4, link=0, timeout_s=0.0)
    order.answered(1, link=0)
    order.answered(1, link=0)  # a repeated reply frees no second credit
    assert order.take_credit(4, link=0, timeout_s=0.0)
    assert not order.take_credit(5, link=0, timeout_s=0.0)


def test_credits_give_up_after_a_stall_and_release_frees_them():
    order = SendOrder(6, window=6, max_wait_s=5.0, credits=1, stall_s=0.1)
    assert order.take_credit(0, link=0)
    start = time.monotonic()
    assert order.take_credit(1, link=0)  # nothing answered for stall_s: gives up
    assert 0.08 < time.monotonic() - start < 1.0 and order.unpaced
    assert order.take_credit(2, link=0, timeout_s=0.0)

    order = SendOrder(6, window=6, max_wait_s=5.0, credits=1, stall_s=5.0)
    assert order.take_credit(0, link=0)
    results: queue.Queue = queue.Queue()
    waiter = threading.Thread(target=lambda: results.put(order.take_credit(1, link=0)))
    waiter.start()
    time.sleep(0.05)
    assert results.empty()
    order.release()  # the operation settled
    assert results.get(timeout=2) is True
    waiter.join(timeout=2)


def test_giving_up_the_window_keeps_the_credits():
    order = SendOrder(4, window=1, max_wait_s=0.05, credits=1, stall_s=5.0)
    assert order.turn(0, link=0).wait()
    assert order.turn(1, link=1).wait()  # chunk 0 never handed: the window gives up
    assert order.released and not order.unpaced
    assert not order.turn(2, link=0).wait(0.05)  # chunk 0 still unanswered on link 0
    order.answered(0, link=0)
    assert order.turn(2, link=0).wait(0.0)


class _AnsweringTransport(Transport):
    """Takes every request at once, records its offset, and replies to an
    offset when the test calls answer()."""

    name = label = "answering"

    def __init__(self) -> None:
        self.taken: list[int] = []
        self._replies: queue.Queue = queue.Queue()

    def open(self, requests, daemon):
        def take():
            for item in requests:
                self.taken.append(decode_shard(bytes(item[HEADROOM:])).offset)

        threading.Thread(target=take, daemon=True).start()
        return iter(self._replies.get, None)

    def answer(self, offset: int) -> None:
        self._replies.put(ShardView(key="k", round=0, offset=offset,
                                    data=memoryview(np.ones(4, np.float32).tobytes())))

    def close(self) -> None:
        self._replies.put(None)


def _wait_taken(transport, count: int) -> list[int]:
    deadline = time.monotonic() + 5
    while len(transport.taken) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # and nothing more
    return list(transport.taken)


def test_a_link_sends_the_next_chunk_when_the_daemon_answers_one():
    """One link, credits=2: chunks 0 and 1 go, 2 waits for an answer; each
    answer lets one more go, in order."""
    transport = _AnsweringTransport()
    link = DaemonLink("a:1", control=FakeDaemon(), transports=[transport])
    try:
        order = SendOrder(5, window=1, max_wait_s=5.0, credits=2, stall_s=10.0)
        for index in range(5):
            _send(link, order, index)
        assert _wait_taken(transport, 2) == [0, 1]
        transport.answer(1)
        assert _wait_taken(transport, 3) == [0, 1, 2]
        transport.answer(0)
        transport.answer(2)
        assert _wait_taken(transport, 5) == [0, 1, 2, 3, 4] and not order.unpaced
    finally:
        link.close()
