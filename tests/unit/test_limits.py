"""reducerd.core.limits and the table's bookkeeping: costs follow what arrived, not what
a shard declares; the memory budget; the expiry task outlives its faults.

Scenarios: missing ranks of a 2^32-1 world listed in microseconds and capped;
expiry, GetStatus rows and the stalled count stop at the first young chunk;
a job keeps a bounded set of world sizes; check_shard refuses a world size
over --max-world-size; the budget leaves its reserve to the transports and
wakes a waiting reservation; one job's transport bytes stop at its share
while another's still fit, and its entry goes at 0; an outbox counts its
replies against its job; the daemon's expiry loop logs a MemoryError and
goes on.
"""

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time

import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.codec import decode_shard

from reducerd.core.limits import (
    MISSING_LISTED_AT_MOST,
    MemoryBudget,
    describe_missing,
    missing_ranks,
)
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable
from reducerd.dataplane.outbox import AsyncOutbox
from reducerd.ops.config import Config
from reducerd.service.session import check_shard

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
    assert time.perf_counter() - start < 1.0  # O(world) would take minutes: no load trips this
    assert listed == [1, 3, 4, *range(6, 6 + MISSING_LISTED_AT_MOST - 3)]
    assert total == HUGE - 3
    assert missing_ranks(4, {1, 3}) == ([0, 2], 2)
    assert missing_ranks(3, {0, 1, 2}) == ([], 0)
    assert describe_missing(4, {0, 2}) == "1, 3 of 4"
    text = describe_missing(HUGE, {7})
    assert text.endswith(f"and {HUGE - 1 - 64} more of {HUGE}") and len(text) < 600


def test_expiry_of_a_huge_world_is_instant_and_its_message_small():
    clock = Clock()
    table = ReductionTable(5, 1 << 20, clock=clock, max_record_bytes=1 << 30)
    for i in range(1000):
        table.contribute(ChunkId("j", f"k{i}", 0, 0), part(3, HUGE), f"s{i}")
    clock.now = 2.0
    table.contribute(ChunkId("j", "young", 0, 0), part(0, 2), "y")
    clock.now = 5.5
    start = time.perf_counter()
    failed = table.expire()
    assert time.perf_counter() - start < 5.0  # O(world) would take hours: no load trips this
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


def test_budget_leaves_its_reserve_to_the_transports(budget_class):
    budget = budget_class(1000, transport_reserve_bytes=200)
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


def test_a_waiting_reservation_is_woken_when_bytes_come_back(budget_class):
    budget = budget_class(1000)
    assert budget.take_accumulator(900)
    threading.Timer(0.1, budget.give_accumulator, args=(900,)).start()
    start = time.monotonic()
    assert budget.reserve(500, timeout_s=5)
    assert 0.05 < time.monotonic() - start < 2
    assert budget.transport_bytes == 500


def test_one_jobs_transport_bytes_stop_at_its_share_and_leave_the_rest(budget_class):
    budget = budget_class(1000)
    assert budget.job_share_bytes == 500  # half of the limit
    assert budget.reserve(300, timeout_s=0, job="greedy")
    budget.take_transport(200, job="greedy")  # an unread reply: at its share now
    assert not budget.job_has_room("greedy")
    assert budget.job_has_room("good") and budget.job_has_room(None)
    assert not budget.reserve(1, timeout_s=0, job="greedy")
    assert budget.reserve(400, timeout_s=0, job="good")  # the rest stays the others'
    assert budget.job_transport_bytes("greedy") == 500 and budget.transport_bytes == 900
    # A job holding nothing takes one frame of any size the limit admits.
    budget.give_transport(400, job="good")
    assert budget.job_transport_bytes("good") == 0
    assert budget.reserve(500, timeout_s=0, job="good")
    budget.give_transport(500, job="good")
    # A paused stream is woken when its job's bytes come back; the entry goes at 0.
    threading.Timer(0.1, budget.give_transport, args=(200, "greedy")).start()
    start = time.monotonic()
    assert budget.wait_job_room("greedy", timeout_s=5)
    assert 0.05 < time.monotonic() - start < 2
    assert budget.job_has_room("greedy")
    budget.give_transport(300, job="greedy")
    assert budget._jobs == {} and budget.transport_bytes == 0  # nothing kept for it


def test_an_outbox_counts_its_replies_against_its_job():
    budget = MemoryBudget(1 << 20)
    outbox = AsyncOutbox(budget)
    outbox.job = "greedy"
    outbox.put_nowait(b"x" * 1000)
    outbox.put_nowait(b"y" * 24)
    assert budget.job_transport_bytes("greedy") == 1024
    outbox.sent(b"x" * 1000)
    assert budget.job_transport_bytes("greedy") == 24
    outbox.discard()
    assert budget.job_transport_bytes("greedy") == 0 and budget.transport_bytes == 0
    # A job token's stream counts against its job from the start; another, its first shard's.
    from reducerd.service.session import Stream

    bound = Stream("peer", True, outbox=AsyncOutbox(budget), job="tokened")
    assert bound.tenant == "tokened" and bound.outbox.job == "tokened"
    free = Stream("peer", True, outbox=AsyncOutbox(budget))
    free.count_against("first")
    free.count_against("second")
    assert free.tenant == "first" and free.outbox.job == "first"


def test_the_expiry_loop_outlives_a_memory_error(caplog):
    from reducerd.daemon.server import Daemon

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


_REFUSALS_RSS_SCRIPT = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducerd.bench.procs import proc_status
from reducerd.core.limits import FAILURE_BYTES_KEPT, FAILURES_KEPT
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable

table = ReductionTable(60.0, 1 << 30, max_open_chunks_per_job=1)
one = np.ones(1, np.float16).tobytes()
def refused(first, count):  # one element each, every key new and 1,024 characters long
    for i in range(first, first + count):
        cid = ChunkId("job", f"{i:08d}".ljust(1024, "k"), 0, 0)
        [d] = table.contribute(cid, Contribution(0, 2, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, one), 0)
        assert d.error_code == "RESOURCE_EXHAUSTED", d
table.contribute(ChunkId("job", "open", 0, 0),
                 Contribution(0, 2, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, one), 0)  # the open one
refused(1, 2 * FAILURES_KEPT)  # the failure records are full from here on
before = proc_status(os.getpid())["VmRSS"]
refused(1 + 2 * FAILURES_KEPT, int(sys.argv[1]))
print(json.dumps({"before": before, "after": proc_status(os.getpid())["VmRSS"],
                  "failures": len(table._failed), "kept": FAILURES_KEPT,
                  "failure_bytes": table._failed.nbytes, "bytes_kept": FAILURE_BYTES_KEPT}))
"""


def test_refused_shards_leave_a_bounded_record_measured_in_vmrss():
    """A tenant whose every shard is refused (here: over --max-open-chunks-per-job,
    each to a new key of the longest name allowed) makes a failure record per
    shard; past FAILURES_KEPT the oldest go, and the process's VmRSS stays
    flat under RLIMIT_AS (before: +3 KiB per refused shard, for a round timeout)."""
    count = 40_000
    done = subprocess.run([sys.executable, "-c", _REFUSALS_RSS_SCRIPT, str(count)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    # Past FAILURES_KEPT records or FAILURE_BYTES_KEPT of them (these long keys: bytes).
    assert 0 < figures["failures"] <= figures["kept"]
    assert figures["failure_bytes"] <= figures["bytes_kept"]
    assert figures["failures"] == figures["kept"] or (
        figures["failure_bytes"] > figures["bytes_kept"] - 8192), figures
    assert figures["after"] - figures["before"] < 8 << 20, figures


def test_the_newest_failures_are_kept_and_a_late_contributor_hears_them():
    """Past FAILURES_KEPT the oldest record goes: a late rank of a chunk failed
    long ago opens it afresh; of the newest, it hears the failure at once."""
    from reducerd.core.limits import FAILURES_KEPT

    table = ReductionTable(60.0, 1 << 30, max_open_chunks_per_job=1)
    one = np.ones(1, np.float16).tobytes()

    def send(key: str, rank: int = 0):
        return table.contribute(ChunkId("job", key, 0, 0),
                                Contribution(rank, 2, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, one),
                                rank)
    assert send("open") == []
    for i in range(FAILURES_KEPT + 10):
        [refusal] = send(f"k{i}")
        assert refusal.error_code == "RESOURCE_EXHAUSTED"
    assert len(table._failed) == FAILURES_KEPT
    [heard] = send(f"k{FAILURES_KEPT + 9}", rank=1)
    assert heard.error_code == "RESOURCE_EXHAUSTED" and heard.repeat
    [refused_again] = send("k0", rank=1)  # forgotten: a new chunk, refused as new
    assert refused_again.error_code == "RESOURCE_EXHAUSTED" and not refused_again.repeat


def test_stream_count_caps_all_streams_and_each_jobs_share():
    from reducerd.core.limits import StreamCount

    count = StreamCount(5, "calls")  # 2 per job token
    assert count.job_cap == 2
    count.add("a")
    count.add("a")
    assert "job 'a' holds 2 calls, its share of the 5" in count.refusal("a")
    assert count.refusal("b") is None and count.refusal(None) is None
    for _ in range(3):
        count.add(None)  # the daemon token's: no job, the cap alone
    assert count.refusal("b") == "too many calls (5)"
    count.remove("a")
    assert count.refusal("a") is None and count.total == 4
    count.remove("a")
    count.remove(None)
    assert count.total == 2 and count._jobs == {}  # nothing kept for a job with none


_JOBS_RSS_SCRIPT = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducerd.bench.procs import proc_status
from reducerd.core.limits import JOBS_KEPT
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable

table = ReductionTable(60.0, 16 << 20)  # results kept for resends: 8 MiB at most
one = np.ones(1, np.float16).tobytes()
def jobs(first, count):  # a new job of the longest name in every shard, each complete
    for i in range(first, first + count):
        cid = ChunkId(f"{i:08d}".ljust(1024, "j"), "k", 0, 0)
        part = Contribution(0, 1, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, one)
        [done] = table.contribute(cid, part, 0)
        assert not done.error_code, done
jobs(0, 2 * JOBS_KEPT)  # the records are full from here on
before = proc_status(os.getpid())["VmRSS"]
jobs(2 * JOBS_KEPT, int(sys.argv[1]))
print(json.dumps({"before": before, "after": proc_status(os.getpid())["VmRSS"],
                  "jobs": len(table.jobs), "kept": JOBS_KEPT}))
"""


def test_a_new_job_in_every_shard_leaves_a_bounded_record_measured_in_vmrss():
    """Each job's record (counters, incarnations, layout) was kept for an hour
    after its last shard: a tenant naming a new job in every shard grew the
    daemon with every shard (+108 MiB over this run's 60,000, 92,768 records
    kept). Past JOBS_KEPT the least recently active idle ones go."""
    done = subprocess.run([sys.executable, "-c", _JOBS_RSS_SCRIPT, "60000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["jobs"] <= figures["kept"]
    assert figures["after"] - figures["before"] < 16 << 20, figures


def test_past_the_jobs_kept_the_idle_go_first_and_open_ones_stay(monkeypatch):
    import reducerd.core.records as records

    monkeypatch.setattr(records, "JOBS_KEPT", 4)
    table = ReductionTable(60.0, 1 << 30)
    one = np.ones(1, np.float16).tobytes()

    def send(job: str, rank: int = 0, world: int = 2):
        return table.contribute(ChunkId(job, "k", 0, 0),
                                Contribution(rank, world, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM,
                                             one), rank)
    for job in "abcd":
        assert send(job) == []  # 4 jobs, each with a chunk open
    [refused] = send("e")
    assert refused.error_code == "RESOURCE_EXHAUSTED"
    assert "open chunks of 4 jobs, as many as it keeps" in refused.error_message
    assert set(table.jobs) == set("abcd")
    [done] = send("b", rank=1)  # b's chunk completes: b is idle now
    assert not done.error_code
    assert send("e") == []  # b is forgotten to make room; the open ones stay
    assert set(table.jobs) == {"a", "c", "d", "e"}
