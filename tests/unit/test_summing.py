"""The summing pool (--threads N): partitions, FIFO order, bounds, faults, shutdown, option.

The pool alone first (reducerd.core.summing), then the reduction table on it
(reducerd.core.chunk_sums): the same sums as the inline path, bit for bit; a
fault in a summing thread fails the chunk with INTERNAL; a chunk that times
out or is failed at shutdown while its adds are still queued keeps its
accumulator (and its room in the memory budget) until they have run.
Posts to the loop thread are collected here and run on the test's thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import tomllib

import numpy as np
import pytest
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core import chunk_sums
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.core.summing import PoolClosed, SummingPool
from reducerd.core.summing_c import CSummingPool, _sumpool
from reducerd.ops.config import ConfigError, add_arguments, config_from_args

pytestmark = pytest.mark.timeout(60)

F16, BF16, F32 = pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32
SUM, MEAN = pb.REDUCE_OP_SUM, pb.REDUCE_OP_MEAN
WAIT_S = 10.0


class Loop:
    """Stands in for the event loop: collects posts, runs them on this thread."""

    def __init__(self) -> None:
        self.posted: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, fn, *args) -> None:
        self.posted.put((fn, args))

    def run(self, pool: SummingPool) -> None:
        """Run every post until the pool is idle and nothing is left."""
        while True:
            assert pool.wait_idle(WAIT_S), "summing pool still busy"
            if self.posted.empty():
                return
            while not self.posted.empty():
                fn, args = self.posted.get()
                fn(*args)


POOLS = {"python": SummingPool, "c": CSummingPool}
NEEDS_C = pytest.mark.skipif(_sumpool is None, reason="reducerd.core._sumpool not built")


def pools_of(kind: str):
    pools: list = []

    def make(threads: int = 2, **kwargs) -> tuple[Loop, SummingPool]:
        loop, pool = Loop(), POOLS[kind](threads, **kwargs)
        pool.start(loop.post)
        pools.append(pool)
        return loop, pool

    return pools, make


@pytest.fixture(params=["python", pytest.param("c", marks=NEEDS_C)])
def loop_and_pool(request):
    """Each test on both pools: Python threads (SummingPool) and C (CSummingPool)."""
    pools, make = pools_of(request.param)
    yield make
    for pool in pools:
        assert pool.close(WAIT_S)


@pytest.fixture
def python_loop_and_pool():
    """SummingPool alone: tests that replace the NumPy kernels its tasks call."""
    pools, make = pools_of("python")
    yield make
    for pool in pools:
        assert pool.close(WAIT_S)


# -- the pool alone ------------------------------------------------------------


def test_each_partition_runs_its_tasks_in_order_on_one_thread(loop_and_pool):
    _, pool = loop_and_pool(3)
    ran: dict[int, list[tuple[int, str]]] = {0: [], 1: [], 2: []}

    def task(scratch, partition, seq):
        time.sleep(0.0005 * (seq % 3))  # uneven durations: order must still hold
        ran[partition].append((seq, threading.get_ident()))

    for seq in range(60):
        pool.submit(seq % 3, task, seq % 3, seq)
    assert pool.wait_idle(WAIT_S)
    threads = set()
    for partition, got in ran.items():
        assert [seq for seq, _ in got] == list(range(partition, 60, 3))
        assert len({ident for _, ident in got}) == 1  # one thread per partition
        threads |= {ident for _, ident in got}
    assert len(threads) == 3 and threading.get_ident() not in threads


def test_partitions_run_side_by_side_with_no_lock_held(loop_and_pool):
    """Two tasks that can only pass a barrier together: they ran at once."""
    _, pool = loop_and_pool(2)
    barrier = threading.Barrier(2, timeout=WAIT_S)
    passed = []

    def task(scratch):
        barrier.wait()
        passed.append(threading.get_ident())

    pool.submit(0, task)
    pool.submit(1, task)
    assert pool.wait_idle(WAIT_S)
    assert len(set(passed)) == 2


def test_chunks_open_on_the_least_loaded_partition(loop_and_pool):
    _, pool = loop_and_pool(3)
    gate = threading.Event()
    pool.submit(0, lambda scratch: gate.wait(WAIT_S), nbytes=100)
    # Partition 0 holds 100 bytes: new chunks go to 1 and 2, in turn.
    assert [pool.pick_partition() for _ in range(4)] == [1, 2, 1, 2]
    gate.set()
    assert pool.wait_idle(WAIT_S)
    assert sorted(pool.pick_partition() for _ in range(3)) == [0, 1, 2]


def test_submit_waits_while_the_queue_is_full(loop_and_pool):
    _, pool = loop_and_pool(1, queued_bytes_at_most=1000)
    gate = threading.Event()
    pool.submit(0, lambda scratch: gate.wait(WAIT_S), nbytes=800)
    submitted = threading.Event()
    helper = threading.Thread(target=lambda: (pool.submit(0, lambda s: None, nbytes=300),
                                              submitted.set()))
    helper.start()
    assert not submitted.wait(0.2), "submit went past the bound"
    assert pool.queued_bytes == 800
    gate.set()
    assert submitted.wait(WAIT_S)
    helper.join(WAIT_S)
    assert pool.wait_idle(WAIT_S) and pool.queued_bytes == 0
    # One task larger than the bound alone still goes in (else it never could).
    pool.submit(0, lambda scratch: None, nbytes=5000)
    assert pool.wait_idle(WAIT_S)


def test_close_runs_what_is_queued_then_refuses(loop_and_pool):
    _, pool = loop_and_pool(2)
    gate = threading.Event()
    ran = []
    pool.submit(0, lambda scratch: gate.wait(WAIT_S))
    for i in range(20):
        pool.submit(i % 2, lambda scratch, i=i: ran.append(i))
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(pool.close(WAIT_S)))
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive(), "close returned with work still queued"
    gate.set()
    closer.join(WAIT_S)
    assert closed == [True] and sorted(ran) == list(range(20))
    with pytest.raises(PoolClosed):
        pool.submit(0, lambda scratch: None)


def test_a_task_that_raises_is_logged_and_the_thread_goes_on(loop_and_pool, caplog):
    _, pool = loop_and_pool(1)
    ran = []

    def bad(scratch):
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="reducerd"):
        pool.submit(0, bad)
        pool.submit(0, lambda scratch: ran.append("after"))
        assert pool.wait_idle(WAIT_S)
    assert ran == ["after"]
    (record,) = [r for r in caplog.records if "summing thread 0" in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info is not None


# -- the reduction table on the pool -------------------------------------------


def part(rank, values, world_size, dtype=F16, op=SUM):
    data = convert.to_wire(np.asarray(values, dtype=np.float32), dtype).tobytes()
    return Contribution(rank, world_size, dtype, op, data)


def pooled_table(loop_and_pool, threads=2, clock=time.monotonic):
    loop, pool = loop_and_pool(threads)
    table = ReductionTable(5.0, 1 << 30, clock=clock, summing=pool)
    delivered: list = []
    table.on_deliveries = delivered.extend
    return loop, pool, table, delivered


@pytest.mark.parametrize("dtype,op", [(F16, SUM), (BF16, MEAN), (F32, SUM), (F16, MEAN)])
def test_pooled_sums_are_the_inline_sums_bit_for_bit(loop_and_pool, dtype, op):
    loop, pool, table, delivered = pooled_table(loop_and_pool, threads=3)
    inline = ReductionTable(5.0, 1 << 30)
    rng = np.random.default_rng(7)
    world, chunks, numel = 5, 12, 3000
    expected = {}
    for offset in range(chunks):
        cid = ChunkId("job", "k", 0, offset * numel)
        for rank in range(world):
            p = part(rank, rng.standard_normal(numel) * 100, world, dtype, op)
            assert table.contribute(cid, p, f"s{rank}") == []
            for d in inline.contribute(cid, p, f"s{rank}"):
                expected[cid] = bytes(d.data)
    loop.run(pool)
    assert {d.chunk: bytes(d.data) for d in delivered} == expected
    assert all(set(d.sinks) == {f"s{r}" for r in range(world)} for d in delivered)
    assert table.bytes_held == 0 and table.budget.transport_bytes == 0
    assert table.open_chunk_count == 0 and table.jobs["job"].chunks_completed == chunks


def test_chunks_below_the_pool_size_are_summed_inline_beside_pooled_ones(loop_and_pool):
    """--pool-chunk-bytes: a small chunk completes inside contribute (the loop
    thread summed it), a large one lands later from its summing thread; both
    give the inline table's bytes, and nothing stays held."""
    loop, pool = loop_and_pool(2, min_chunk_bytes=4096)
    table = ReductionTable(5.0, 1 << 30, summing=pool)
    delivered: list = []
    table.on_deliveries = delivered.extend
    inline = ReductionTable(5.0, 1 << 30)
    rng = np.random.default_rng(11)
    small, large = ChunkId("job", "k", 0, 0), ChunkId("job", "k", 0, 1 << 20)
    now = {}
    for cid, numel in ((small, 2047), (large, 2048)):  # float16: 4094 and 4096 bytes
        for rank in range(3):
            p = part(rank, rng.standard_normal(numel), 3)
            now[cid] = table.contribute(cid, p, f"s{rank}")
            expected = inline.contribute(cid, p, f"s{rank}")
        assert len(expected) == 1
        now[cid, "expected"] = bytes(expected[0].data)
    (inline_done,) = now[small]
    assert bytes(inline_done.data) == now[small, "expected"] and not delivered
    assert now[large] == []  # being summed on a summing thread
    loop.run(pool)
    (pooled_done,) = delivered
    assert pooled_done.chunk == large and bytes(pooled_done.data) == now[large, "expected"]
    assert table.bytes_held == 0 and table.budget.transport_bytes == 0
    assert table.jobs["job"].chunks_completed == 2


def test_two_contributors_in_either_order_are_bit_identical(loop_and_pool):
    loop, pool, table, delivered = pooled_table(loop_and_pool)
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(10_000).astype(np.float32) * 1e3 for _ in range(2))
    cid = ChunkId("job", "k", 0, 0)
    table.contribute(cid, part(1, b, 2), "s1")
    table.contribute(cid, part(0, a, 2), "s0")
    loop.run(pool)
    inline = ReductionTable(5.0, 1 << 30)
    inline.contribute(cid, part(0, a, 2), "s0")
    (done,) = inline.contribute(cid, part(1, b, 2), "s1")
    assert bytes(delivered[0].data) == bytes(done.data)


def test_a_fault_in_a_summing_thread_fails_the_chunk_with_internal(
        python_loop_and_pool, monkeypatch, caplog):
    loop, pool, table, delivered = pooled_table(python_loop_and_pool)
    real_add = chunk_sums.accumulate.add_wire_into

    def add(acc, data, dtype, scratch=None):
        if bytes(data) == part(1, [13.0], 3).data:
            raise MemoryError("no room for the sum")
        real_add(acc, data, dtype, scratch)

    monkeypatch.setattr(chunk_sums.accumulate, "add_wire_into", add)
    cid = ChunkId("job", "k", 0, 0)
    with caplog.at_level(logging.ERROR, logger="reducerd"):
        for rank, value in enumerate([1.0, 13.0, 2.0]):
            table.contribute(cid, part(rank, [value], 3), f"s{rank}")
        loop.run(pool)
    (failed,) = delivered
    assert failed.error_code == "INTERNAL" and set(failed.sinks) == {"s0", "s1", "s2"}
    assert "fault of the daemon" in failed.error_message and "MemoryError" in failed.error_message
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
    assert table.bytes_held == 0 and table.budget.transport_bytes == 0
    # A rank that comes later hears the same failure, not a new round.
    (again,) = table.contribute(cid, part(0, [1.0], 3), "late")
    assert again.error_code == "INTERNAL" and again.repeat


def test_a_timeout_with_adds_in_flight_keeps_the_accumulator_until_they_ran(
        python_loop_and_pool, monkeypatch):
    clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
    loop, pool, table, delivered = pooled_table(python_loop_and_pool, clock=clock)
    gate, inside = threading.Event(), threading.Event()
    real_add = chunk_sums.accumulate.add_wire_into
    written: list[np.ndarray] = []

    def slow_add(acc, data, dtype, scratch=None):
        inside.set()
        assert gate.wait(WAIT_S)
        real_add(acc, data, dtype, scratch)
        written.append(acc)

    monkeypatch.setattr(chunk_sums.accumulate, "add_wire_into", slow_add)
    cid = ChunkId("job", "k", 0, 0)
    numel = 1000
    table.contribute(cid, part(0, np.ones(numel), 3), "s0")
    table.contribute(cid, part(1, np.ones(numel), 3), "s1")  # its add is held at the gate
    assert inside.wait(WAIT_S)
    clock.now = 6.0
    (late,) = table.expire()  # told at once, while the add is still running
    assert late.error_code == "DEADLINE_EXCEEDED" and set(late.sinks) == {"s0", "s1"}
    assert "rank(s) 2 of 3" in late.error_message
    assert table.open_chunk_count == 0
    assert table.bytes_held == numel * 4, "the accumulator's room went back too early"
    gate.set()
    loop.run(pool)
    assert delivered == [] and table.bytes_held == 0 and table.budget.transport_bytes == 0
    assert written and written[0].tolist() == [2.0] * numel  # it wrote memory still its own


def test_fail_all_with_a_finish_queued_delivers_only_the_failure(python_loop_and_pool,
                                                                monkeypatch):
    loop, pool, table, delivered = pooled_table(python_loop_and_pool)
    gate = threading.Event()
    real_copy = chunk_sums.accumulate.copy_wire_into
    monkeypatch.setattr(chunk_sums.accumulate, "copy_wire_into",
                        lambda *a: (gate.wait(WAIT_S), real_copy(*a)))
    cid = ChunkId("job", "k", 0, 0)
    assert table.contribute(cid, part(0, [1.0], 1), "s0") == []  # complete, being summed
    assert table.open_chunk_count == 1  # the drain waits for it
    (failed,) = table.fail_all("UNAVAILABLE", "daemon shut down")
    assert failed.error_code == "UNAVAILABLE" and failed.sinks == ("s0",)
    gate.set()
    loop.run(pool)
    assert delivered == [] and table.bytes_held == 0
    assert pool.close(WAIT_S)


# -- the option ------------------------------------------------------------------


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), environ={})


def test_threads_default_to_the_cpus_the_process_may_run_on(tmp_path):
    assert parse().threads == len(os.sched_getaffinity(0))
    assert parse("--threads", "3").threads == 3
    toml = tmp_path / "r.toml"
    toml.write_text("threads = 5\n")
    assert parse("--config", str(toml)).threads == 5
    with pytest.raises(ConfigError, match="threads: must be between 1 and 1024, got 0"):
        parse("--threads", "0")
    assert parse().pool_chunk_bytes == 1 << 20
    assert parse("--pool-chunk-bytes", "0").pool_chunk_bytes == 0
    with pytest.raises(ConfigError, match="pool_chunk_bytes: must be >= 0, got -1"):
        parse("--pool-chunk-bytes", "-1")
    # Pinned to one CPU (as reducerd@N.service is): one thread, the inline path.
    one_cpu = min(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-m", "reducerd", "--print-config"],
                          capture_output=True, text=True, timeout=30, check=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}))
    assert tomllib.loads(done.stdout)["threads"] == 1


# -- memory: a pooled chunk's accumulator goes when its last task ran -----------

def acc_of(chunk):
    """A chunk's accumulator: the C pool's (ChunkSums.acc) or the table's array."""
    return chunk.sums.acc if chunk.sums.acc is not None else chunk.acc


def test_a_pooled_chunk_leaves_nothing_for_the_cyclic_gc(loop_and_pool):
    """Completed or timed out with adds queued: once its last task ran and the
    loop took the result, the accumulator and the streams waiting for it are
    freed by reference counting alone (the chunk and its ChunkSums point at
    each other; the table breaks that when it releases the chunk)."""
    import gc
    import weakref

    class Sink:  # a stream stand-in that a weak reference can follow
        pass

    now = [0.0]
    loop, pool, table, delivered = pooled_table(loop_and_pool, clock=lambda: now[0])
    gc.disable()
    try:
        done, timed_out = ChunkId("job", "k", 0, 0), ChunkId("job", "k", 0, 4096)
        sinks = [Sink(), Sink()]
        for rank in range(2):
            table.contribute(done, part(rank, np.ones(4096), 2), sinks[rank])
        table.contribute(timed_out, part(0, np.ones(4096), 2), sinks[0])
        accs = [weakref.ref(acc_of(table._open[cid])) for cid in (done, timed_out)]
        loop.run(pool)
        now[0] = 10.0  # past the round timeout of 5 s: the open chunk fails
        failed = table.expire()
        loop.run(pool)
        assert [d.chunk for d in delivered] == [done] and [d.chunk for d in failed] == [timed_out]
        streams = [weakref.ref(s) for s in sinks]
        del sinks
        table._results.clear()  # the result cache holds replies, not accumulators or streams
        delivered.clear()
        failed.clear()
        assert [ref() for ref in accs] == [None, None]
        assert [ref() for ref in streams] == [None, None]
    finally:
        gc.enable()


_POOLED_RSS_SCRIPT = """
import gc, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import os
import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducerd.bench.procs import proc_status
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.core.summing import SummingPool
from reducerd.core.summing_c import CSummingPool

def rss():
    return proc_status(os.getpid())["VmRSS"]

posted = []
pool = {"python": SummingPool, "c": CSummingPool}[sys.argv[2]](2)
pool.start(lambda fn, *args: posted.append((fn, args)))
table = ReductionTable(60.0, 1 << 30, summing=pool)
table.on_deliveries = lambda deliveries: None
data = np.ones(1 << 19, np.float16).tobytes()  # 1 MiB of float16: a 2 MiB accumulator
gc.disable()  # what reference counting alone frees
def chunks(first, count):
    for i in range(first, first + count):
        cid = ChunkId("job", "k", i, 0)  # round i: the cache keeps the last round's reply
        for rank in range(2):
            table.contribute(cid, Contribution(rank, 2, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, data),
                             rank)
        assert pool.wait_idle(10)
        while posted:
            fn, args = posted.pop(0)
            fn(*args)
chunks(0, 8)
before = rss()
chunks(8, int(sys.argv[1]))
print(json.dumps({"before": before, "after": rss(), "open": table.open_chunk_count}))
"""


@pytest.mark.parametrize("kind", ["python", pytest.param("c", marks=NEEDS_C)])
def test_pooled_chunks_hold_no_memory_once_done_measured_in_vmrss(kind):
    """200 rounds of a pooled chunk with a 2 MiB accumulator, one after the
    other, the cyclic GC off, under RLIMIT_AS: the process's VmRSS stays flat
    (before the chunk <-> sums cycle was broken: +400 MiB, every accumulator)."""
    count = 200
    done = subprocess.run([sys.executable, "-c", _POOLED_RSS_SCRIPT, str(count), kind],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    import json

    figures = json.loads(done.stdout)
    assert figures["open"] == 0
    assert figures["after"] - figures["before"] < 32 << 20, figures


def test_a_complete_chunk_still_being_summed_is_not_timed_out(loop_and_pool):
    """The last contribution came just before the round timeout and the
    summing thread's result has not landed when the loop's expiry tick runs:
    the result is still delivered, as inline, not DEADLINE_EXCEEDED naming
    no missing rank."""
    now = [0.0]
    loop, pool, table, delivered = pooled_table(loop_and_pool, clock=lambda: now[0])
    cid = ChunkId("job", "k", 0, 0)
    assert table.contribute(cid, part(0, [1.0] * 8, 2), "a") == []
    now[0] = 4.999
    assert table.contribute(cid, part(1, [2.0] * 8, 2), "b") == []
    assert pool.wait_idle(WAIT_S)  # summed; its landing is posted, not yet run
    now[0] = 5.0
    assert table.expire() == []
    loop.run(pool)
    assert [(d.error_code, d.chunk) for d in delivered] == [("", cid)]
    assert np.frombuffer(delivered[0].data, np.float16).tolist() == [3.0] * 8
    assert table.open_chunk_count == 0 and table.bytes_held == 0
    # A chunk still missing a rank at the timeout fails as before.
    other = ChunkId("job", "k", 1, 0)
    table.contribute(other, part(0, [1.0] * 8, 2), "a")
    now[0] = 10.0
    [late] = table.expire()
    assert late.error_code == "DEADLINE_EXCEEDED" and "rank(s) 1 of 2" in late.error_message
