"""reducerd.limits and the table's bookkeeping: costs follow what arrived, not what
a shard declares; the memory budget; the expiry task outlives its faults.

Scenarios: missing ranks of a 2^32-1 world listed in microseconds and capped;
expiry, GetStatus rows and the stalled count stop at the first young chunk;
a job keeps a bounded set of world sizes; check_shard refuses a world size
over --max-world-size; the budget leaves its reserve to the transports and
wakes a waiting reservation; the daemon's expiry loop logs a MemoryError and
goes on.
"""

import asyncio
import logging
import threading
import time

import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import decode_shard

from reducerd.config import Config
from reducerd.limits import MISSING_LISTED_AT_MOST, MemoryBudget, describe_missing, missing_ranks
from reducerd.reduction import ChunkId, Contribution, ReductionTable
from reducerd.session import check_shard

HUGE = (1 << 32) - 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def part(rank, world_size, values=(1.0,)):
    data = np.asarray(values, np.float32).tobytes()
    return Contribution(rank, world_size, pb.DTYPE_FLOAT32, pb.REDUCE_OP_SUM, data)


def test_missing_ranks_cost_follows_the_ranks_present():
    start = time.perf_counter()
    listed, total = missing_ranks(HUGE, {0, 2, 5})
    assert time.perf_counter() - start < 0.01
    assert listed == [1, 3, 4, *range(6, 6 + MISSING_LISTED_AT_MOST - 3)]
    assert total == HUGE - 3
    assert missing_ranks(4, {1, 3}) == ([0, 2], 2)
    assert missing_ranks(3, {0, 1, 2}) == ([], 0)
    assert describe_missing(4, {0, 2}) == "1, 3 of 4"
    text = describe_missing(HUGE, {7})
    assert text.endswith(f"and {HUGE - 1 - 64} more of {HUGE}") and len(text) < 600


def test_expiry_of_a_huge_world_is_instant_and_its_message_small():
    clock = Clock()
    table = ReductionTable(5, 1 << 20, clock=clock)
    for i in range(1000):
        table.contribute(ChunkId("j", f"k{i}", 0, 0), part(3, HUGE), f"s{i}")
    clock.now = 2.0
    table.contribute(ChunkId("j", "young", 0, 0), part(0, 2), "y")
    clock.now = 5.5
    start = time.perf_counter()
    failed = table.expire()
    assert time.perf_counter() - start < 0.5
    assert len(failed) == 1000 and table.open_chunk_count == 1  # the young one waits on
    assert max(len(d.error_message) for d in failed) < 1000
    assert f"{HUGE - 1 - 64} more of {HUGE}" in failed[0].error_message


def test_open_chunks_and_stalled_count_stop_at_the_first_young_chunk():
    clock = Clock()
    table = ReductionTable(60, 1 << 20, clock=clock)
    for i in range(5):
        clock.now = float(i)
        table.contribute(ChunkId("a" if i % 2 else "b", f"k{i}", 0, 0), part(0, HUGE), "s")
    clock.now = 10.0
    assert table.stalled_count(7.5) == 3  # opened at 0, 1, 2
    rows = table.open_chunks(7.5)
    assert [cid.key for cid, *_ in rows] == ["k0", "k1", "k2"]
    assert all(len(missing) == MISSING_LISTED_AT_MOST for _, _, missing, _ in rows)
    assert [cid.key for cid, *_ in table.open_chunks(0, at_most=1, job="a")] == ["k1"]
    assert [row[3] for row in table.open_chunks()] == [10.0, 9.0, 8.0, 7.0, 6.0]


def test_a_job_keeps_a_bounded_set_of_world_sizes():
    table = ReductionTable(60, 1 << 30)
    for world_size in range(2, 1000):
        table.contribute(ChunkId("j", f"k{world_size}", 0, 0), part(0, world_size), "s")
    assert len(table.jobs["j"].world_sizes) == 16


def test_check_shard_refuses_a_world_size_over_the_limit():
    def view(world_size):
        return decode_shard(pb.Shard(job="j", key="k", rank=0, world_size=world_size,
                                     dtype=pb.DTYPE_FLOAT32, data=b"\0" * 4).SerializeToString())

    assert "--max-world-size" in check_shard(view(65537))
    assert check_shard(view(65536)) == ""
    assert check_shard(view(HUGE), max_world_size=HUGE) == ""
    assert "above the daemon's limit of 8" in check_shard(view(9), max_world_size=8)


def test_budget_leaves_its_reserve_to_the_transports():
    budget = MemoryBudget(1000, transport_reserve_bytes=200)
    assert budget.take_accumulator(800)
    assert not budget.take_accumulator(1)  # the last 200 bytes are the transports'
    assert budget.reserve(200, timeout_s=0)
    assert not budget.reserve(1, timeout_s=0)
    assert budget.held_bytes == 1000
    budget.give_transport(200)
    budget.take_transport(300)  # a queued reply is counted even over the limit
    assert not budget.take_accumulator(1) and not budget.fits_transport(1)
    assert budget.held_bytes == 1100
    assert not budget.reserve(2000, timeout_s=10)  # larger than the limit: at once


def test_a_waiting_reservation_is_woken_when_bytes_come_back():
    budget = MemoryBudget(1000)
    assert budget.take_accumulator(900)
    threading.Timer(0.1, budget.give_accumulator, args=(900,)).start()
    start = time.monotonic()
    assert budget.reserve(500, timeout_s=5)
    assert 0.05 < time.monotonic() - start < 2
    assert budget.transport_bytes == 500


def test_the_expiry_loop_outlives_a_memory_error(caplog):
    from reducerd.server import Daemon

    daemon = Daemon(Config(round_timeout_s=0.5))  # ticks every 50 ms
    calls = []

    def expire(idle_timeout_s):
        calls.append(idle_timeout_s)
        if len(calls) == 1:
            raise MemoryError("injected")

    daemon.session.expire = expire

    async def run():
        task = asyncio.create_task(daemon._expire_loop())
        await asyncio.sleep(0.4)
        task.cancel()

    with caplog.at_level(logging.ERROR, logger="reducerd"):
        asyncio.run(run())
    assert len(calls) >= 3
    assert any("MemoryError" in (r.exc_text or "") for r in caplog.records)
