"""Shard.incarnation in the reduction table: a restarted job never gets an earlier one's sums.

Scenario (contract section 2, **new**): the ranks of a job restart under
the same job id as new client instances (new ids) and count their rounds
from 0 again, while the table still holds the earlier incarnation's cached
results and the rounds its dead workers left open. The rules are those of
reducerd.core.incarnations; sums are of small integers, exact in every wire
dtype used here, so they are compared exactly.
"""

import secrets
import socket
import threading
import time

import numpy as np
import pytest
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.incarnations import JobIncarnations, Restart
from reducerd.core.reduction import JOB_FORGET_AFTER_S, ChunkId, Contribution, ReductionTable
from reducerd.core.summing import SummingPool
from reducerd.core.summing_c import CSummingPool, _sumpool

F32, SUM = pb.DTYPE_FLOAT32, pb.REDUCE_OP_SUM
OLD = (101, 102, 103)  # ids of the first incarnation's ranks 0, 1, 2
NEW = (201, 202, 203)  # and of the restarted one's
WAIT_S = 10.0


def cid(round_=0, offset=0, key="k", job="J"):
    return ChunkId(job, key, round_, offset)


def part(rank, value, incarnation, world_size=2, numel=3):
    data = convert.to_wire(np.full(numel, value, np.float32), F32).tobytes()
    return Contribution(rank, world_size, F32, SUM, data, incarnation=incarnation)


def value_of(delivery):
    out = np.empty(len(delivery.data) // 4, np.float64)
    convert.from_wire(delivery.data, F32, out)
    assert np.all(out == out[0])
    return out[0]


def results(deliveries):
    return [d for d in deliveries if not d.error_code]


def failures(deliveries):
    return [d for d in deliveries if d.error_code]


def one_round(table, ids, values, round_=0, tag="", world_size=2):
    """Every rank contributes; the completing delivery."""
    out = []
    for rank, (inc, value) in enumerate(zip(ids, values, strict=True)):
        out += table.contribute(cid(round_), part(rank, value, inc, world_size),
                                f"{tag}{rank}")
    (done,) = out
    return done


def test_restart_with_a_cached_result_sums_the_new_values():
    table = ReductionTable(60, 1 << 30)
    assert value_of(one_round(table, OLD[:2], (1, 2))) == 3
    done = one_round(table, NEW[:2], (10, 20), tag="new")
    assert not done.error_code and value_of(done) == 30
    assert set(done.sinks) == {"new0", "new1"}


def test_without_ids_the_same_restart_gets_the_cached_sum():
    """Old clients (incarnation 0) keep today's behaviour: this is what the ids fix."""
    table = ReductionTable(60, 1 << 30)
    assert value_of(one_round(table, (0, 0), (1, 2))) == 3
    (repeat,) = table.contribute(cid(), part(0, 10, 0), "new0")
    assert repeat.repeat and value_of(repeat) == 3


def test_restart_fails_the_rounds_the_dead_instances_left_open():
    table = ReductionTable(60, 1 << 30)
    one_round(table, OLD[:2], (1, 2))
    assert table.contribute(cid(1), part(1, 5, OLD[1]), "old1") == []  # rank 0 died first
    out = table.contribute(cid(0), part(0, 10, NEW[0]), "new0")
    (failed,) = out
    assert failed.chunk == cid(1) and failed.sinks == ("old1",)
    assert failed.error_code == "FAILED_PRECONDITION"
    assert "job 'J' restarted (rank 0: new client instance)" in failed.error_message
    (done,) = table.contribute(cid(0), part(1, 20, NEW[1]), "new1")
    assert value_of(done) == 30
    done = one_round(table, NEW[:2], (100, 200), round_=1, tag="new")
    assert value_of(done) == 300  # never 5 + 100: the dead rank 1's value is gone


def test_a_new_instance_meeting_the_open_round_directly_opens_it_anew():
    table = ReductionTable(60, 1 << 30)
    one_round(table, OLD[:2], (1, 2))
    table.contribute(cid(1), part(1, 5, OLD[1]), "old1")  # round 1 left open
    (failed,) = table.contribute(cid(1), part(0, 10, NEW[0]), "new0")
    assert failed.chunk == cid(1) and failed.sinks == ("old1",)
    assert failed.error_code == "FAILED_PRECONDITION"
    (done,) = table.contribute(cid(1), part(1, 20, NEW[1]), "new1")
    assert value_of(done) == 30 and set(done.sinks) == {"new0", "new1"}


def test_new_ranks_arriving_one_by_one_never_fail_each_other():
    """Rank 0 of the new incarnation sends many chunks before rank 1 arrives;
    rank 1's own new id joins that incarnation: nothing of rank 0's fails."""
    table = ReductionTable(60, 1 << 30)
    for offset in range(4):
        table.contribute(cid(0, offset), part(0, 1, OLD[0]), "old0")
        table.contribute(cid(0, offset), part(1, 2, OLD[1]), "old1")
    out = []
    for offset in range(4):
        out += table.contribute(cid(0, offset), part(0, 10, NEW[0]), "new0")
    assert out == []  # rounds open anew; no cached 3 answers them
    for offset in range(4):
        out += table.contribute(cid(0, offset), part(1, 20, NEW[1]), "new1")
    assert failures(out) == [] and [value_of(d) for d in out] == [30] * 4


def test_same_instance_resend_is_served_from_the_cache():
    table = ReductionTable(60, 1 << 30)
    one_round(table, NEW[:2], (10, 20))
    (repeat,) = table.contribute(cid(0), part(0, 10, NEW[0]), "resend0")
    assert repeat.repeat and value_of(repeat) == 30 and repeat.sinks == ("resend0",)
    assert table.jobs["J"].chunks_completed == 1


def test_an_instance_of_before_the_restart_is_refused_not_counted():
    table = ReductionTable(60, 1 << 30)
    one_round(table, OLD[:2], (1, 2))
    table.contribute(cid(1), part(0, 10, NEW[0]), "new0")  # the restart, round 1 open
    for rank, inc in ((1, OLD[1]), (0, OLD[0])):  # rank 1 never restarted; rank 0's old id
        (refused,) = table.contribute(cid(1), part(rank, 5, inc), f"old{rank}")
        assert refused.error_code == "FAILED_PRECONDITION"
        assert refused.sinks == (f"old{rank}",)
        assert "before the restart" in refused.error_message
    assert table.jobs["J"].incarnations.era == 1  # no restart of its own
    (done,) = table.contribute(cid(1), part(1, 20, NEW[1]), "new1")
    assert value_of(done) == 30 and set(done.sinks) == {"new0", "new1"}


def test_a_job_restarted_larger_keeps_the_added_ranks_rounds():
    """Rank 2 (new, unknown to the daemon) arrives before any rank it knows."""
    table = ReductionTable(60, 1 << 30)
    one_round(table, OLD[:2], (1, 2))
    table.contribute(cid(1), part(1, 5, OLD[1]), "old1")  # round 1 left open
    (failed,) = table.contribute(cid(0), part(2, 30, NEW[2], world_size=3), "new2")
    assert failed.chunk == cid(1) and failed.sinks == ("old1",)
    assert "rank 2: new client instance at world size 3, outside the world of 2" in (
        failed.error_message)
    assert table.contribute(cid(0), part(0, 10, NEW[0], world_size=3), "new0") == []
    (done,) = table.contribute(cid(0), part(1, 20, NEW[1], world_size=3), "new1")
    assert value_of(done) == 60 and set(done.sinks) == {"new0", "new1", "new2"}


def test_a_second_restart_after_the_first_completed():
    table = ReductionTable(60, 1 << 30)
    one_round(table, OLD[:2], (1, 2))
    one_round(table, NEW[:2], (10, 20), tag="new")
    done = one_round(table, (301, 302), (100, 200), tag="third")
    assert value_of(done) == 300 and table.jobs["J"].incarnations.era == 2


def test_other_jobs_are_left_alone():
    table = ReductionTable(60, 1 << 30)
    one_round(table, OLD[:2], (1, 2))
    table.contribute(cid(1, job="other"), part(0, 7, 901), "other0")
    table.contribute(cid(0, job="other"), part(0, 7, 901), "other0")
    (done,) = table.contribute(cid(0, job="other"), part(1, 8, 902), "other1")
    one_round(table, NEW[:2], (10, 20), tag="new")  # J restarts
    (repeat,) = table.contribute(cid(0, job="other"), part(1, 8, 902), "resend")
    assert repeat.repeat and value_of(repeat) == 15
    (done,) = table.contribute(cid(1, job="other"), part(1, 8, 902), "other1")
    assert value_of(done) == 15


def test_records_are_bounded_and_go_with_the_job():
    clock = [0.0]
    table = ReductionTable(60, 1 << 30, clock=lambda: clock[0])
    world = 4
    for restart in range(50):
        for rank in range(world):
            table.contribute(cid(restart), part(rank, 1, secrets.randbits(64) or 1, world),
                             f"s{rank}")
    record = table.jobs["J"].incarnations
    assert len(record) == world and record.retired_count <= 2 * world + 16
    assert record.era == 49
    clock[0] += JOB_FORGET_AFTER_S + 1
    table.expire()
    assert "J" not in table.jobs


def test_the_rules_on_their_own():
    job = JobIncarnations()
    assert job.check(0, OLD[0], 2) is None and job.check(1, OLD[1], 2) is None
    assert job.check(0, OLD[0], 2) is None  # a resend
    assert job.check(0, NEW[0], 2) == Restart(0, "new client instance")
    assert isinstance(job.check(1, OLD[1], 2), str)  # not restarted: refused
    assert isinstance(job.check(0, OLD[0], 2), str)  # rank 0's old id
    assert job.check(1, NEW[1], 2) is None  # joins
    assert job.check(1, NEW[1], 2) is None and job.era == 1


POOLS = {"python": SummingPool, "c": CSummingPool}
KINDS = ["python", pytest.param("c", marks=pytest.mark.skipif(_sumpool is None,
                                                              reason="_sumpool not built"))]


@pytest.fixture(params=KINDS)
def pooled(request):
    pool = POOLS[request.param](2)
    posted = []
    pool.start(lambda fn, *args: posted.append((fn, args)))
    table = ReductionTable(60, 1 << 30, summing=pool)
    delivered = []
    table.on_deliveries = delivered.extend

    def settle():
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert pool.wait_idle(WAIT_S)
            if not posted:
                return
            while posted:
                fn, args = posted.pop(0)
                fn(*args)
        raise AssertionError("summing pool still busy")

    yield table, delivered, settle
    assert pool.close(WAIT_S)


def test_summing_threads_restart_too(pooled):
    """With --threads > 1 the new instances get what they get inline; a round
    of the dead ones that is complete but still being summed fails for its
    streams (inline it was answered just before the restart)."""
    table, delivered, settle = pooled
    table.contribute(cid(0), part(0, 1, OLD[0]), "old0")
    table.contribute(cid(0), part(1, 2, OLD[1]), "old1")  # complete, lands at settle()
    table.contribute(cid(1), part(1, 5, OLD[1]), "old1")
    out = table.contribute(cid(0), part(0, 10, NEW[0]), "new0")
    assert [(d.chunk, set(d.sinks), d.error_code) for d in out] == [
        (cid(0), {"old0", "old1"}, "FAILED_PRECONDITION"),
        (cid(1), {"old1"}, "FAILED_PRECONDITION")]
    out += table.contribute(cid(0), part(1, 20, NEW[1]), "new1")
    settle()
    assert [(d.chunk, set(d.sinks), value_of(d)) for d in delivered] == [
        (cid(0), {"new0", "new1"}, 30)]
    assert table.open_chunk_count == 0 and table.bytes_held == 0


def test_each_client_instance_puts_its_own_random_id_in_every_shard(monkeypatch):
    import reducer_client.sending as sending_module
    from reducer_client import ReducerClient

    seen = []

    class Recording(sending_module.ShardEncoder):
        def __init__(self, **fields):
            seen.append(fields["incarnation"])
            super().__init__(**fields)

    monkeypatch.setattr(sending_module, "ShardEncoder", Recording)
    # Daemons that take the connection and never answer: the operation cannot
    # fail (a refused connection would) before all its chunks were encoded.
    silent = [socket.create_server(("127.0.0.1", 0), backlog=16) for _ in range(2)]
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in silent]
    clients = [ReducerClient(addresses, "J", 0, 2, timeout=5.0, chunk_bytes=64,
                             node_local=False) for _ in range(2)]
    try:
        ids = [c.incarnation for c in clients]
        assert all(0 < i < 1 << 64 for i in ids) and ids[0] != ids[1]
        for c in clients:
            seen.clear()
            c.allreduce_async(np.ones(100, np.float32), key="k")  # never answered
            assert len(seen) > 2 and set(seen) == {c.incarnation}
    finally:
        for c in clients:
            c.close()
        for server in silent:
            server.close()


def test_the_eras_own_id_outside_its_world_is_no_restart():
    """A rank first seen outside the world, with an id a rank of the era
    already holds, is that instance at a disagreeing world size: the chunk
    fails with INVALID_ARGUMENT as without ids, and nothing restarts."""
    table = ReductionTable(60, 1 << 30)
    assert table.contribute(cid(), part(1, 1, OLD[0]), "a") == []
    (failed,) = table.contribute(cid(), part(2, 2, OLD[0], world_size=3), "b")
    assert failed.error_code == "INVALID_ARGUMENT" and "world_size" in failed.error_message
    assert set(failed.sinks) == {"a", "b"}
    assert table.jobs["J"].incarnations.era == 0


def test_a_new_id_outside_the_world_is_a_restart_at_the_larger_size():
    table = ReductionTable(60, 1 << 30)
    assert table.contribute(cid(), part(1, 1, OLD[1]), "old1") == []
    (failed,) = table.contribute(cid(), part(2, 2, NEW[2], world_size=3), "new2")
    assert failed.error_code == "FAILED_PRECONDITION" and failed.sinks == ("old1",)
    assert "outside the world of 2" in failed.error_message
    assert table.jobs["J"].incarnations.era == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_restart_on_a_full_budget_waits_for_the_failed_chunks_room(monkeypatch, kind):
    """With --threads > 1 a failed chunk's accumulator goes back to the budget
    only once its summing thread ran its last task. The restarted job's first
    contribution waits for the earlier era's chunks to give theirs back
    (here held 0.3 s) instead of being refused RESOURCE_EXHAUSTED."""
    numel = 64 * 1024  # 256 KiB float32: two accumulators fill the budget
    pool = POOLS[kind](2)
    pool.start(lambda fn, *args: None)
    table = ReductionTable(60, 2 * numel * 4 + 2 * numel * 4, summing=pool)
    gate = threading.Event()
    for partition in (0, 1):  # both summing threads held until the gate opens
        pool.submit(partition, lambda scratch: gate.wait(WAIT_S))
    try:
        for round_ in (0, 1):
            for rank in (0, 1):
                assert table.contribute(cid(round_), part(rank, 1, OLD[rank], 3, numel),
                                        f"old{rank}") == []
        assert table.bytes_held == 2 * numel * 4
        threading.Timer(0.3, gate.set).start()
        started = time.monotonic()
        out = table.contribute(cid(0), part(0, 10, NEW[0], 3, numel), "new0")
        waited = time.monotonic() - started
        assert [(d.chunk, d.error_code) for d in out] == [
            (cid(0), "FAILED_PRECONDITION"), (cid(1), "FAILED_PRECONDITION")]
        assert table.open_chunk_count == 1, "the new era's contribution was not counted"
        assert waited < WAIT_S
    finally:
        gate.set()
        assert pool.close(WAIT_S)
