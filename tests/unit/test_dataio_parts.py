"""The data plane's non-blocking parts without a daemon: Room (credits and the
plane's backlog, and whom they wake), Wire (a partial send resumes where it
stopped, bytes intact) and WakingOutbox (ThreadOutbox's counts, plus a wake
on each put and a get that never blocks)."""

import socket
import threading
import time

import numpy as np
import pytest
from reducer_wire.framing import SHARD, frame_header

from reducerd.dataio import IoThread
from reducerd.dataroom import Room, WakingOutbox
from reducerd.datawire import Wire
from reducerd.limits import MemoryBudget
from reducerd.replies import Reply

pytestmark = pytest.mark.timeout(30)


class Waiter:
    def __init__(self, name):
        self.name = name
        self.queued = 0
        self.credit_wanted = False
        self.woken = 0

    def wake_for_room(self):
        self.woken += 1


def test_a_connection_out_of_credit_is_woken_when_one_of_its_frames_is_taken():
    room = Room(per_connection=2, backlog=10)
    a = Waiter("a")
    assert room.take(a) and room.take(a)
    assert not room.take(a)  # its own credit is spent; the backlog is not
    assert a.credit_wanted and room.free == 8
    room.release(a)
    assert a.woken == 1 and not a.credit_wanted
    assert room.take(a)
    assert a.queued == 2 and room.free == 8


def test_backlog_waiters_are_woken_oldest_first_one_per_slot():
    room = Room(per_connection=8, backlog=2)
    a, b, c, d = (Waiter(n) for n in "abcd")
    assert room.take(a) and room.take(b)
    assert not room.take(c) and not room.take(d)  # the plane's backlog is full
    assert not c.credit_wanted  # they wait for the backlog, not for their own credit
    room.release(a)
    assert (c.woken, d.woken) == (1, 0)  # one slot, the oldest waiter
    room.release(b)
    assert (c.woken, d.woken) == (1, 1)
    assert room.take(c) and room.take(d)
    assert room.free == 0


def test_a_woken_waiter_that_cannot_use_the_slot_passes_it_on():
    room = Room(per_connection=8, backlog=1)
    a, b, c = Waiter("a"), Waiter("b"), Waiter("c")
    assert room.take(a)
    assert not room.take(b) and not room.take(c)
    room.release(a)  # wakes b, which ended meanwhile (or waits for its writer)
    assert (b.woken, c.woken) == (1, 0)
    room.pass_on(b)
    assert c.woken == 1
    assert room.take(c) and room.free == 0
    room.pass_on(a)  # no slot free: nobody is woken
    assert (b.woken, c.woken) == (1, 1)


def test_a_partial_send_resumes_where_it_stopped():
    """A socket that takes only part of a queued reply: flush() says so, keeps
    its place, and the reader gets every byte once, in order."""
    a, b = socket.socketpair()
    try:
        for sock in (a, b):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        a.setblocking(False)
        wire = Wire(a)
        first = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
        second = b"tail"
        wire.send(first.data)
        wire.send(second)
        moved, done = wire.flush()
        assert moved and not done and wire.pending  # the socket took part of it
        received = bytearray()
        flushes = 1
        b.settimeout(5)
        while wire.pending or len(received) < first.nbytes + len(second):
            received += b.recv(1 << 20)
            if wire.pending:
                wire.flush()
                flushes += 1
        assert flushes > 2
        assert bytes(received) == first.tobytes() + second
        moved, done = wire.flush()
        assert (moved, done) == (False, True)
    finally:
        a.close()
        b.close()


def test_recv_into_says_when_nothing_is_there_and_when_the_stream_ends():
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        wire = Wire(a)
        view = memoryview(bytearray(8))
        assert wire.recv_into(view) is None
        b.sendall(b"abc")
        b.shutdown(socket.SHUT_WR)
        got = None
        for _ in range(100):
            got = wire.recv_into(view)
            if got is not None:
                break
            time.sleep(0.01)
        assert got == 3 and bytes(view[:3]) == b"abc"
        assert wire.recv_into(view) == 0
        assert wire.received_bytes == 3
    finally:
        a.close()
        b.close()


def test_waking_outbox_counts_as_thread_outbox_and_wakes_on_each_put():
    budget = MemoryBudget(1 << 20)
    wakes = []
    outbox = WakingOutbox(budget, lambda: wakes.append(1))
    assert outbox.get_nowait() is None and outbox.below(1, 1)
    frame = memoryview(bytearray(frame_header(SHARD, 100) + bytes(100)))
    reply = Reply(frame, frame[5:], len(frame))
    outbox.put_nowait(reply)
    outbox.put_nowait(("end",), 0)
    assert len(wakes) == 2
    assert budget.transport_bytes == len(frame) and outbox.unsent_bytes == len(frame)
    assert not outbox.below(2, 1 << 20) and not outbox.below(3, len(frame))
    assert outbox.below(3, len(frame) + 1)
    assert outbox.get_nowait() is reply
    outbox.sent(reply)
    assert budget.transport_bytes == 0
    assert outbox.get_nowait() == ("end",)
    assert outbox.get_nowait() is None


def test_every_task_posted_from_other_threads_runs_without_another_wake():
    """Tasks posted while the I/O thread drains its wake bytes still run that
    turn or wake it anew (a wake byte read with the others once left a task,
    the accept of a new connection, waiting for the next timer: 10 s)."""
    thread = IoThread("test-io", threading.Lock())
    thread.start()
    ran = []
    posters, per_poster = 4, 3000

    def post_many(n):
        for i in range(per_poster):
            thread.post(ran.append, (n, i))
            if i % 7 == 0:
                time.sleep(0)  # hand over the GIL: the drain and the posts interleave

    try:
        for _ in range(3):
            ran.clear()
            workers = [threading.Thread(target=post_many, args=(n,)) for n in range(posters)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(20)
            deadline = time.monotonic() + 2  # no timer, no other event: only the wakes
            while len(ran) < posters * per_poster and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(ran) == posters * per_poster
            for n in range(posters):  # each poster's tasks in the order it posted them
                assert [i for m, i in ran if m == n] == list(range(per_poster))
    finally:
        thread.stop_when_idle()
        deadline = time.monotonic() + 5
        while thread.alive and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not thread.alive
