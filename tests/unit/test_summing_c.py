"""The summing pool's C threads (reducerd/core/_sumpool.c, reducerd.core.summing_c).

What the C tasks add to test_summing.py (which runs every pool test on both
pools): every wire dtype summed in C gives the inline table's bytes, special
values included; the sums finish while the loop thread holds the GIL (no
summing thread takes it); finished sums wake a real asyncio loop through the
eventfd; a chunk that fails with its C adds still queued keeps its room
until they ran; a wrong size is refused at submit, by name.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import numpy as np
import pytest
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.core.summing_c import ADD, COPY, CSummingPool, _sumpool

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(_sumpool is None, reason="reducerd.core._sumpool not built")]

SUM, MEAN = pb.REDUCE_OP_SUM, pb.REDUCE_OP_MEAN
WAIT_S = 10.0
DTYPES = [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_INT8_BLOCK128,
          pb.DTYPE_FP8_E4M3, pb.DTYPE_FP8_E5M2]


def part(rank, values, world_size, dtype=pb.DTYPE_FLOAT16, op=SUM):
    data = convert.to_wire(np.asarray(values, dtype=np.float32), dtype).tobytes()
    return Contribution(rank, world_size, dtype, op, data)


@pytest.fixture
def c_pool():
    pools: list[CSummingPool] = []

    def make(threads=2, **kwargs):
        posted: list = []
        pool = CSummingPool(threads, **kwargs)
        pool.start(lambda fn, *args: posted.append((fn, args)))
        pools.append(pool)

        def run():  # the loop's part: every post, until the pool is idle
            while True:
                assert pool.wait_idle(WAIT_S), "summing pool still busy"
                if not posted:
                    return
                while posted:
                    fn, args = posted.pop(0)
                    fn(*args)

        return pool, run

    yield make
    for pool in pools:
        assert pool.close(WAIT_S)


def awkward_values(rng, numel, rank):
    """Normal values with outliers, zeros, subnormals and (rank 0) NaN and Inf."""
    values = rng.standard_normal(numel).astype(np.float32) * 10
    values[::97] *= 1e4  # outliers in some int8 blocks
    values[5:300] = 0.0  # whole zero blocks
    values[400:420] = np.float32(1e-40) * (rank + 1)  # float32 subnormals
    values[450:460] = np.float32(3e-6)  # float16 subnormals
    if rank == 0:
        values[600], values[601], values[602] = np.nan, np.inf, -np.inf
    return values


@pytest.mark.parametrize("op", [SUM, MEAN])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: pb.DType.Name(d))
def test_c_sums_are_the_inline_sums_bit_for_bit_for_every_wire_dtype(c_pool, dtype, op):
    pool, run = c_pool(3)
    table = ReductionTable(5.0, 1 << 30, summing=pool)
    delivered: list = []
    table.on_deliveries = delivered.extend
    inline = ReductionTable(5.0, 1 << 30)
    rng = np.random.default_rng(dtype * 10 + op)
    world, numel, expected = 3, 1000 + 37, {}  # MEAN: no exact reciprocal; a partial int8 block
    for offset in range(6):
        cid = ChunkId("job", "k", 0, offset * numel)
        for rank in range(world):
            p = part(rank, awkward_values(rng, numel, rank), world, dtype, op)
            assert table.contribute(cid, p, f"s{rank}") == []
            for d in inline.contribute(cid, p, f"s{rank}"):
                expected[cid] = bytes(d.data)
    run()
    assert {d.chunk: bytes(d.data) for d in delivered} == expected
    assert all(not d.error_code for d in delivered)
    assert table.bytes_held == 0 and table.budget.transport_bytes == 0


def test_c_sums_finish_while_the_loop_thread_holds_the_gil(c_pool):
    """Python summing threads need the GIL for every task; here the test's
    thread keeps it (a switch interval of 100 s, a busy loop) and the 64 sums
    still run. Finished sums wake the loop by eventfd, which needs no GIL."""
    pool = CSummingPool(2)
    watched = []
    pool.start(lambda fn, *args: None, add_reader=lambda fd, cb: watched.append((fd, cb)))
    try:
        acc = pool.new_accumulator(1 << 16)
        data = convert.to_wire(np.ones(acc.size, np.float32), pb.DTYPE_FLOAT16).tobytes()
        done: list = []
        previous = sys.getswitchinterval()
        sys.setswitchinterval(100.0)
        try:
            for kind in [COPY] + [ADD] * 63:
                pool.submit_sum(0, kind, acc, data, pb.DTYPE_FLOAT16, (done.append, 1))
            deadline = time.monotonic() + 5.0
            while pool.pending and time.monotonic() < deadline:
                pass  # never releases the GIL
            left = pool.pending
        finally:
            sys.setswitchinterval(previous)
        assert left == 0, f"{left} sums waited for the GIL"
        (fd, callback), = watched
        assert fd == pool._c.fileno()
        callback()  # what the loop runs when the eventfd is readable
        assert done == [1] * 64 and np.all(np.frombuffer(acc, np.float32) == 64.0)
    finally:
        assert pool.close(WAIT_S)


def test_finished_sums_wake_an_asyncio_loop_through_the_eventfd():
    async def main():
        loop = asyncio.get_running_loop()
        pool = CSummingPool(2)
        pool.start(loop.call_soon_threadsafe, loop.add_reader)
        table = ReductionTable(5.0, 1 << 30, summing=pool)
        landed = loop.create_future()
        table.on_deliveries = lambda ds: landed.done() or landed.set_result(ds)
        cid = ChunkId("job", "k", 0, 0)
        for rank in range(3):
            table.contribute(cid, part(rank, np.full(1 << 16, rank + 1.0), 3), f"s{rank}")
        try:
            (result,) = await asyncio.wait_for(landed, WAIT_S)
        finally:
            loop.remove_reader(pool._c.fileno())
            await asyncio.to_thread(pool.close, WAIT_S)
        assert np.all(np.frombuffer(result.data, np.float16) == 6.0)
        assert table.bytes_held == 0 and table.budget.transport_bytes == 0

    asyncio.run(main())


def test_a_timeout_with_c_adds_queued_keeps_the_accumulator_until_they_ran(c_pool):
    pool, run = c_pool(1)
    now = [0.0]
    table = ReductionTable(5.0, 1 << 30, clock=lambda: now[0], summing=pool)
    delivered: list = []
    table.on_deliveries = delivered.extend
    gate = threading.Event()
    pool.submit(0, lambda scratch: gate.wait(WAIT_S))  # holds the one partition
    cid, numel = ChunkId("job", "k", 0, 0), 1000
    table.contribute(cid, part(0, np.ones(numel), 3), "s0")
    table.contribute(cid, part(1, np.ones(numel), 3), "s1")
    now[0] = 6.0
    (late,) = table.expire()
    assert late.error_code == "DEADLINE_EXCEEDED" and "rank(s) 2 of 3" in late.error_message
    assert table.bytes_held == numel * 4, "the accumulator's room went back too early"
    assert table.budget.transport_bytes == 2 * numel * 2  # both contributions still held
    gate.set()
    run()
    assert delivered == [] and table.bytes_held == 0 and table.budget.transport_bytes == 0


def test_fail_all_with_a_c_finish_queued_delivers_only_the_failure(c_pool):
    pool, run = c_pool(1)
    table = ReductionTable(5.0, 1 << 30, summing=pool)
    delivered: list = []
    table.on_deliveries = delivered.extend
    gate = threading.Event()
    pool.submit(0, lambda scratch: gate.wait(WAIT_S))
    cid = ChunkId("job", "k", 0, 0)
    assert table.contribute(cid, part(0, [1.0] * 64, 1), "s0") == []  # complete, queued
    (failed,) = table.fail_all("UNAVAILABLE", "daemon shut down")
    assert failed.error_code == "UNAVAILABLE" and failed.sinks == ("s0",)
    gate.set()
    run()
    assert delivered == [] and table.bytes_held == 0 and table.budget.transport_bytes == 0


def test_a_sum_of_the_wrong_size_or_kind_is_refused_at_submit(c_pool):
    pool, run = c_pool(1)
    acc = pool.new_accumulator(100)
    with pytest.raises(ValueError, match="199 wire bytes for 100 elements"):
        pool.submit_sum(0, ADD, acc, b"\0" * 199, pb.DTYPE_FLOAT16, (print,))
    with pytest.raises(TypeError, match="Accumulator"):
        pool.submit_sum(0, ADD, np.zeros(100, np.float32), b"\0" * 200, pb.DTYPE_FLOAT16,
                        (print,))
    with pytest.raises(ValueError, match="partition 3: the pool has 1"):
        pool.submit_sum(3, ADD, acc, b"\0" * 200, pb.DTYPE_FLOAT16, (print,))
    assert pool.pending == 0 and pool.queued_bytes == 0
    pool.submit_mark(0, (len, ()), acc)  # given back: nothing more can be queued on it
    run()
    assert not acc.held
    with pytest.raises(ValueError, match="given back"):
        pool.submit_sum(0, ADD, acc, b"\0" * 200, pb.DTYPE_FLOAT16, (print,))
    with pytest.raises(BufferError):
        memoryview(acc)


def test_each_thread_keeps_one_spare_accumulator_and_the_next_chunk_takes_it(c_pool):
    """A finished chunk's accumulator stays with its thread (one at most, not
    counted in the budget) and the next chunk of that size there starts in it:
    the copy into it writes memory that core has in its cache."""
    pool, run = c_pool(1)
    data = convert.to_wire(np.full(4096, 2.0, np.float32), pb.DTYPE_FLOAT16).tobytes()
    payload = bytearray(len(data))
    sizes_kept = []
    for _ in range(3):
        acc = pool.new_accumulator(4096)
        pool.submit_sum(0, COPY, acc, data, pb.DTYPE_FLOAT16, (len, ()))
        pool.submit_finish(0, acc, payload, pb.DTYPE_FLOAT16, 0, (len, ()))
        run()
        assert not acc.held and np.all(np.frombuffer(payload, np.float16) == 2.0)
        sizes_kept.append(pool.spare_bytes)
    assert sizes_kept == [4096 * 4] * 3  # one spare, not one per chunk
    huge = pool.new_accumulator((1 << 20) + 1)  # above the spares' 4 MiB: freed, not kept
    pool.submit_mark(0, (len, ()), huge)
    run()
    assert not huge.held and pool.spare_bytes == 4096 * 4


def test_room_freed_by_finished_c_sums_admits_a_chunk_before_the_loop_took_it():
    """A chunk's C tasks ran but the loop has not taken their done tuples (its
    eventfd callback has not run yet): a new chunk that needs that room is
    admitted, not refused RESOURCE_EXHAUSTED, and the finished chunk's result
    still lands, later, from a post."""
    numel = 4096
    posted: list = []
    pool = CSummingPool(1)
    pool.start(lambda fn, *args: posted.append((fn, args)), add_reader=lambda fd, cb: None)
    try:
        limit = 4 * numel + 2 * numel + 2 * numel  # one accumulator and its data, not two
        table = ReductionTable(5.0, limit, summing=pool, max_job_inflight_bytes=limit)
        delivered: list = []
        table.on_deliveries = delivered.extend
        first, second = ChunkId("job", "k", 0, 0), ChunkId("job", "k", 0, numel)
        assert table.contribute(first, part(0, np.ones(numel), 1), "s0") == []
        assert pool.wait_idle(WAIT_S) and table.bytes_held == 4 * numel  # not taken back yet
        assert table.contribute(second, part(0, np.full(numel, 2.0), 1), "s0") == []
        assert table.open_chunk_count == 2 and delivered == []  # the first lands later
        for fn, args in posted:
            fn(*args)
        assert [d.chunk for d in delivered] == [first]
        assert np.all(np.frombuffer(delivered[0].data, np.float16) == 1.0)
        assert pool.wait_idle(WAIT_S)
        pool.drain()
        assert [d.chunk for d in delivered] == [first, second]
        assert table.bytes_held == 0 and table.budget.transport_bytes == 0
        assert table.open_chunk_count == 0
    finally:
        assert pool.close(WAIT_S)


def test_the_daemons_pool_is_the_c_one_and_queues_at_most_its_share_of_the_budget():
    from reducerd.core.summing import QUEUED_BYTES_PER_THREAD
    from reducerd.core.summing_c import summing_pool

    roomy = summing_pool(2, min_chunk_bytes=4096)
    assert isinstance(roomy, CSummingPool) and roomy.min_chunk_bytes == 4096
    assert roomy.queued_bytes_at_most == 2 * QUEUED_BYTES_PER_THREAD
    tight = summing_pool(4, budget_bytes=64 << 20)  # an eighth of the budget
    assert tight.queued_bytes_at_most == 8 << 20


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, pb.DTYPE_INT8_BLOCK128],
                         ids=lambda d: pb.DType.Name(d))
def test_without_the_c_kernels_the_c_threads_sum_with_numpy_as_python_tasks(c_pool, dtype):
    """The daemon's wire_numpy setting: NumPy's kernels, run as Python tasks on
    the C threads in the same order; the same bytes as the inline table."""
    previous = convert.use_accelerator(False)
    try:
        pool, run = c_pool(2)
        assert not pool.sums_in_c(dtype)
        table = ReductionTable(5.0, 1 << 30, summing=pool)
        delivered: list = []
        table.on_deliveries = delivered.extend
        inline = ReductionTable(5.0, 1 << 30)
        rng = np.random.default_rng(5)
        expected = {}
        for offset in range(4):
            cid = ChunkId("job", "k", 0, offset * 999)
            for rank in range(3):
                p = part(rank, awkward_values(rng, 999, rank), 3, dtype, MEAN)
                assert table.contribute(cid, p, f"s{rank}") == []
                for d in inline.contribute(cid, p, f"s{rank}"):
                    expected[cid] = bytes(d.data)
        run()
        assert {d.chunk: bytes(d.data) for d in delivered} == expected
        assert table.bytes_held == 0 and table.budget.transport_bytes == 0
    finally:
        convert.use_accelerator(previous)
