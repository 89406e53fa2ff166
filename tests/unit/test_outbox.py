"""reducerd.outbox: unsent replies counted per stream and in the daemon's memory budget."""

import asyncio
import threading
import time

from reducerd.limits import MemoryBudget
from reducerd.outbox import AsyncOutbox, ThreadOutbox, reply_nbytes
from reducerd.replies import error_reply
from reducerd.session import END


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
        item = outbox.get()
        outbox.sent(item)

    threading.Thread(target=writer).start()
    start = time.monotonic()
    assert outbox.wait_below(frames=8, nbytes=300, timeout_s=5)
    assert time.monotonic() - start < 2 and budget.transport_bytes == 200
    outbox.discard()
    assert budget.transport_bytes == 0
