"""reducerd.dataplane.outbox: unsent replies counted per stream and in the memory budget."""

import asyncio
import socket
import threading
import time

from reducerd.core.limits import MemoryBudget
from reducerd.core.replies import Reply, error_reply
from reducerd.dataplane.outbox import AsyncOutbox, ThreadOutbox, reply_nbytes
from reducerd.service.session import END


def test_reply_nbytes_counts_messages_and_frames_only():
    reply = error_reply(job="j", key="k", round=0, offset=0, dtype=3, op=1, world_size=2,
                        error_code=4, error_message="late")
    assert reply_nbytes(b"abc") == 3 and reply_nbytes(reply) == len(reply.frame)
    assert reply_nbytes(END) == 0 and reply_nbytes(("code", "message")) == 0


def test_async_outbox_pauses_its_reader_and_gives_back_what_it_held():
    budget = MemoryBudget(1000)

    async def scenario():
        outbox = AsyncOutbox(budget, pause_at_bytes=100)
        outbox.put_nowait(b"x" * 60)
        outbox.put_nowait(b"y" * 60)
        assert outbox.unsent_bytes == 120 and budget.transport_bytes == 120
        waiter = asyncio.create_task(outbox.room())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # 120 unsent >= 100: the reader waits
        outbox.sent(await outbox.get())
        await asyncio.wait_for(waiter, 1)
        outbox.put_nowait(END)
        outbox.discard()  # the stream ended with a reply still queued
        assert budget.transport_bytes == 0 and outbox.unsent_bytes == 0
        outbox.put_nowait(b"z" * 10)  # after the end: not counted
        assert budget.transport_bytes == 0

    asyncio.run(scenario())


def test_thread_outbox_waits_below_frames_and_bytes():
    budget = MemoryBudget(1 << 20)
    outbox = ThreadOutbox(budget)
    for _ in range(3):
        outbox.put_nowait(b"x" * 100)
    assert not outbox.wait_below(frames=8, nbytes=300, timeout_s=0)
    assert not outbox.wait_below(frames=3, nbytes=10_000, timeout_s=0)

    def writer():
        time.sleep(0.05)
        item, _ = outbox.take()
        outbox.sent(item)

    threading.Thread(target=writer).start()
    start = time.monotonic()
    assert outbox.wait_below(frames=8, nbytes=300, timeout_s=5)
    assert time.monotonic() - start < 2 and budget.transport_bytes == 200
    outbox.discard()
    assert budget.transport_bytes == 0


def _reply(fill: bytes, nbytes: int) -> Reply:
    frame = memoryview(fill * nbytes)
    return Reply(frame=frame, payload=frame[:0], held_bytes=nbytes)


def _receive(sock: socket.socket, nbytes: int) -> bytes:
    sock.settimeout(5)
    chunks, got = [], 0
    while got < nbytes:
        chunk = sock.recv(nbytes - got)
        assert chunk, f"peer closed after {got} of {nbytes} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def test_a_reply_the_socket_takes_at_once_goes_out_from_the_putting_thread():
    budget = MemoryBudget(1 << 20)
    ours, peer = socket.socketpair()
    with ours, peer:
        outbox = ThreadOutbox(budget, direct=ours)
        outbox.put_nowait(_reply(b"a", 1000))  # no writer thread exists at all
        assert _receive(peer, 1000) == b"a" * 1000
        assert outbox.unsent_bytes == 0 and budget.transport_bytes == 0
        assert outbox.wait_below(frames=1, nbytes=1, timeout_s=0)  # nothing queued
        outbox.put_nowait(END)  # the last items are the writer's: they end the stream
        assert outbox.take() == (END, 0)


def test_what_a_direct_send_leaves_goes_first_through_the_writer_in_order():
    budget = MemoryBudget(64 << 20)
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        outbox = ThreadOutbox(budget, direct=ours)
        big, after = _reply(b"b", 4 << 20), _reply(b"c", 100)
        outbox.put_nowait(big)  # more than the socket holds: part of it waits
        outbox.put_nowait(after)  # behind the part-sent one, not beside it
        assert outbox.unsent_bytes == len(big.frame) + 100
        item, already_sent = outbox.take()
        assert item is big and 0 < already_sent < len(big.frame)
        outbox.put_nowait(_reply(b"d", 10))  # the writer holds one: no direct send now
        received = []
        reader = threading.Thread(target=lambda: received.append(
            _receive(peer, len(big.frame) + 110)))
        reader.start()
        ours.sendall(big.frame[already_sent:])
        outbox.sent(big)
        for expected in (after, None):
            item, already_sent = outbox.take()
            assert already_sent == 0 and (expected is None or item is expected)
            ours.sendall(item.frame)
            outbox.sent(item)
        reader.join(10)
        assert received == [b"b" * (4 << 20) + b"c" * 100 + b"d" * 10]
        assert outbox.unsent_bytes == 0 and budget.transport_bytes == 0


def test_without_a_direct_socket_or_on_a_broken_one_the_writer_sends_everything():
    over_tls = ThreadOutbox()
    reply = _reply(b"e", 10)
    over_tls.put_nowait(reply)
    assert over_tls.take() == (reply, 0) and over_tls.unsent_bytes == 10
    ours, peer = socket.socketpair()
    with ours:
        peer.close()
        broken = ThreadOutbox(direct=ours)
        broken.put_nowait(reply)  # no error here: the writer's send meets it
        assert broken.take() == (reply, 0) and broken.unsent_bytes == 10


def test_the_writer_starts_only_once_something_waits_for_it():
    starts = []
    ours, peer = socket.socketpair()
    with ours, peer:
        outbox = ThreadOutbox(direct=ours, start_writer=lambda: starts.append(1))
        for _ in range(3):
            outbox.put_nowait(_reply(b"f", 100))  # all sent directly
        assert _receive(peer, 300) == b"f" * 300 and starts == []
        outbox.put_nowait(END)
        outbox.put_nowait(_reply(b"g", 100))  # queued behind the end: no second start
        assert starts == [1] and outbox.take() == (END, 0)


def _voluntary_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def test_an_idle_writer_sleeps_through_the_frames_the_loop_takes():
    """promise/kept run for every frame; a writer waiting in take() for a reply
    is woken by a reply, not by each frame the loop took (which cost a futex
    wake and a thread switch per frame), and a reader waiting for room is still
    woken by them."""
    outbox = ThreadOutbox()
    ids: list[int] = []
    taken: list[object] = []

    def writer() -> None:
        ids.append(threading.get_native_id())
        taken.append(outbox.take()[0])

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not ids and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # in take(), waiting
    before = _voluntary_switches(ids[0])
    for _ in range(500):
        outbox.promise(1 << 20)
        outbox.kept(1 << 20)
        time.sleep(0)  # let a woken writer run
    assert _voluntary_switches(ids[0]) - before < 20  # about 500 when every kept woke it
    outbox.put_nowait(b"reply")
    thread.join(5)
    assert taken == [b"reply"]
    # A reader waiting for room is woken when the loop takes the frame it promised.
    outbox.promise(10 << 20)
    room: list[bool] = []
    reader = threading.Thread(target=lambda: room.append(outbox.wait_below(64, 8 << 20, 5.0)))
    reader.start()
    time.sleep(0.05)
    assert not room
    started = time.monotonic()
    outbox.kept(10 << 20)
    reader.join(5)
    assert room == [True] and time.monotonic() - started < 1.0
