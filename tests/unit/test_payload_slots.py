"""PayloadSlots (reducerd.dataplane.base): the plane's receive slots for payloads the loop reads."""

from __future__ import annotations

import asyncio

import pytest

from reducerd.dataplane.base import PayloadSlots

pytestmark = pytest.mark.timeout(30)


class FakeReader:
    def __init__(self, name: str, resumed: list[str]) -> None:
        self.name, self.resumed = name, resumed
        self.wants_slot = True

    def resume_with_slot(self) -> None:
        self.wants_slot = False
        self.resumed.append(self.name)


def test_slots_go_first_come_first_served_and_skip_readers_that_left():
    loop = asyncio.new_event_loop()
    try:
        resumed: list[str] = []
        slots = PayloadSlots(2, loop)
        a, b, c, d, e = (FakeReader(n, resumed) for n in "abcde")
        assert slots.take(a) and slots.take(b)
        assert not slots.take(c) and not slots.take(d) and not slots.take(e)
        assert not slots.take(c)  # asking again does not queue it twice
        d.wants_slot = False  # d's connection ended meanwhile: skipped
        slots.forget(e)  # e's too, and it said so
        slots.give()
        loop.run_until_complete(asyncio.sleep(0))
        assert resumed == ["c"] and slots.taken == 2
        slots.give()
        loop.run_until_complete(asyncio.sleep(0))
        assert resumed == ["c"] and slots.taken == 1  # nobody left waiting
        f = FakeReader("f", resumed)
        assert slots.take(f) and slots.taken == 2
        # A newcomer does not pass one that waits.
        g, h = FakeReader("g", resumed), FakeReader("h", resumed)
        assert not slots.take(g)
        slots.give()
        assert not slots.take(h)  # g was given the freed slot, not h
        loop.run_until_complete(asyncio.sleep(0))
        assert resumed == ["c", "g"]
    finally:
        loop.close()
