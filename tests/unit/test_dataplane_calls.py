"""DataPlane.call: what the connections' threads hand the event loop, run in order,
one wake-up of the loop for all that queued meanwhile (reducerd.dataplane.plane)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from reducerd.core.limits import MemoryBudget
from reducerd.dataplane.plane import DataPlane

pytestmark = pytest.mark.timeout(30)


def _plane(loop: asyncio.AbstractEventLoop) -> DataPlane:
    # Only call() is used: no session, access or socket behind it.
    return DataPlane(None, loop, None, 1 << 20, budget=MemoryBudget(1 << 20))  # type: ignore[arg-type]


def test_calls_queued_while_the_loop_is_busy_take_one_wakeup_and_keep_their_order():
    loop = asyncio.new_event_loop()
    plane = _plane(loop)
    ran: list[tuple[int, int, bool]] = []
    loop_thread: list[threading.Thread] = []
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(callback, *args):
        nonlocal wakeups
        wakeups += 1
        return original(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

    def sender(index: int) -> None:
        for n in range(500):
            plane.call(lambda i, k: ran.append((i, k, threading.current_thread() is
                                                 loop_thread[0])), index, n)

    async def main() -> None:
        loop_thread.append(threading.current_thread())
        threads = [threading.Thread(target=sender, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:  # the loop is busy meanwhile: every call queues up
            t.join()
        while len(ran) < 2000:
            await asyncio.sleep(0.001)

    try:
        loop.run_until_complete(asyncio.wait_for(main(), 20))
    finally:
        loop.close()
    assert len(ran) == 2000 and all(on_loop for _, _, on_loop in ran)
    for index in range(4):
        assert [k for i, k, _ in ran if i == index] == list(range(500))
    # One wake-up ran them all (one per thread at most, where their first calls raced).
    assert 1 <= wakeups <= 4, wakeups


def test_a_call_that_raises_is_logged_and_the_rest_run(caplog):
    loop = asyncio.new_event_loop()
    plane = _plane(loop)
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("a bug")

    try:
        plane.call(ran.append, 1)
        plane.call(boom)
        plane.call(ran.append, 2)
        with caplog.at_level(logging.ERROR, logger="reducerd"):
            loop.run_until_complete(asyncio.sleep(0.05))
    finally:
        loop.close()
    assert ran == [1, 2]
    assert "data-plane call" in caplog.text and "a bug" in caplog.text


def test_calls_after_the_loop_closed_are_dropped_not_kept():
    loop = asyncio.new_event_loop()
    plane = _plane(loop)
    loop.close()
    for n in range(1000):
        plane.call(print, n)
    assert len(plane._calls) == 0 and not plane._calls_scheduled
