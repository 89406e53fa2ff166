"""The reduction table alone: float32 accumulation, MEAN, failures, retries."""

import numpy as np
import pytest
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core.reduction import JOB_FORGET_AFTER_S, ChunkId, Contribution, ReductionTable
from reducerd.core.results import ENTRY_BYTES

F16, BF16, F32 = pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32
SUM, MEAN = pb.REDUCE_OP_SUM, pb.REDUCE_OP_MEAN
CID = ChunkId("job", "k", 0, 0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def part(rank, values, world_size=2, dtype=F16, op=SUM):
    data = convert.to_wire(np.asarray(values, dtype=np.float32), dtype).tobytes()
    return Contribution(rank, world_size, dtype, op, data)


def decode(delivery, n):
    out = np.empty(n, dtype=np.float64)
    convert.from_wire(delivery.data, delivery.dtype, out)
    return out


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_sum_is_float32_accumulation_rounded_once(dtype):
    table = ReductionTable(60, 1 << 30)
    world = 16
    values = [np.float32(1.0)] + [np.float32(2.0 ** -8)] * (world - 1)
    deliveries = []
    for rank, value in enumerate(values):
        deliveries += table.contribute(CID, part(rank, [value], world, dtype), sink=rank)
    (done,) = deliveries
    assert set(done.sinks) == set(range(world))
    # Exact float32 sum 1 + 15/256 rounded once to the wire dtype; a float16
    # or bfloat16 running sum would lose the small terms one by one.
    expected = convert.to_wire(np.float32(1 + 15 / 256), dtype)
    assert done.data == expected.tobytes()
    assert table.bytes_held == 0 and table.open_chunk_count == 0


def test_mean_divides_in_float32_before_rounding():
    table = ReductionTable(60, 1 << 30)
    table.contribute(CID, part(0, [1.0, 65504.0], 3, op=MEAN), "a")
    table.contribute(CID, part(1, [2.0, 65504.0], 3, op=MEAN), "b")
    (done,) = table.contribute(CID, part(2, [4.0, 65504.0], 3, op=MEAN), "c")
    # 3 * 65504 overflows float16, but the float32 sum / 3 does not.
    assert decode(done, 2).tolist() == [np.float16(7 / 3), 65504.0]


def test_retry_is_not_counted_twice_and_both_streams_get_the_result():
    table = ReductionTable(60, 1 << 30)
    assert table.contribute(CID, part(0, [1.0]), "first-stream") == []
    assert table.contribute(CID, part(0, [1.0]), "retry-stream") == []
    (done,) = table.contribute(CID, part(1, [2.0]), "other")
    assert decode(done, 1).tolist() == [3.0]
    assert set(done.sinks) == {"first-stream", "retry-stream", "other"}


@pytest.mark.parametrize("field,bad", [("length", dict(values=[1.0, 2.0])),
                                       ("dtype", dict(dtype=F32)),
                                       ("op", dict(op=MEAN)),
                                       ("world_size", dict(world_size=3))])
def test_mismatch_fails_the_chunk_for_every_contributor(field, bad):
    table = ReductionTable(60, 1 << 30)
    table.contribute(CID, part(0, [1.0]), "r0")
    kwargs = dict(values=[1.0]) | bad
    (failed,) = table.contribute(CID, part(1, **kwargs), "r1")
    assert failed.error_code == "INVALID_ARGUMENT"
    assert set(failed.sinks) == {"r0", "r1"}
    assert f"rank 1 sent {field}" in failed.error_message and "rank 0" in failed.error_message
    assert "'job'" in failed.error_message and "'k'" in failed.error_message
    assert table.bytes_held == 0
    # A rank arriving after the failure learns it at once.
    (late,) = table.contribute(CID, part(0, [1.0]), "r0-retry")
    assert late.error_code == "INVALID_ARGUMENT" and late.sinks == ("r0-retry",)
    # Other chunks are unaffected.
    other = ChunkId("job", "k", 1, 0)
    table.contribute(other, part(0, [1.0]), "r0")
    (ok,) = table.contribute(other, part(1, [1.0]), "r1")
    assert decode(ok, 1).tolist() == [2.0]


def test_timeout_names_the_missing_ranks_and_frees_memory():
    clock = Clock()
    table = ReductionTable(5.0, 1 << 30, clock=clock)
    table.contribute(CID, part(0, [1.0] * 100, world_size=4), "r0")
    table.contribute(CID, part(2, [1.0] * 100, world_size=4), "r2")
    assert table.bytes_held == 400
    clock.now = 4.9
    assert table.expire() == []
    clock.now = 5.0
    (failed,) = table.expire()
    assert failed.error_code == "DEADLINE_EXCEEDED"
    assert "rank(s) 1, 3 of 4" in failed.error_message
    assert "round 0" in failed.error_message and "'k'" in failed.error_message
    assert set(failed.sinks) == {"r0", "r2"}
    assert table.bytes_held == 0 and table.open_chunk_count == 0
    assert table.jobs["job"].chunks_failed == 1


def test_memory_limit_refuses_new_chunks_with_resource_exhausted():
    table = ReductionTable(60, max_inflight_bytes=1000, max_job_inflight_bytes=1000)
    table.contribute(CID, part(0, [1.0] * 200), "a")  # 800 bytes of float32
    other = ChunkId("job", "k2", 0, 0)
    (refused,) = table.contribute(other, part(0, [1.0] * 100), "a")
    assert refused.error_code == "RESOURCE_EXHAUSTED"
    assert "--max-inflight-bytes" in refused.error_message
    (still,) = table.contribute(other, part(1, [1.0] * 100), "b")  # same verdict
    assert still.error_code == "RESOURCE_EXHAUSTED"


def test_world_size_one_completes_at_once():
    table = ReductionTable(60, 1 << 30)
    (done,) = table.contribute(CID, part(0, [3.0], world_size=1, op=MEAN), "a")
    assert decode(done, 1).tolist() == [3.0]
    assert table.bytes_held == 0


def test_contribution_resent_after_completion_gets_the_cached_result():
    clock = Clock()
    table = ReductionTable(10.0, 1 << 30, clock=clock)
    table.contribute(CID, part(0, [1.0]), "r0")
    table.contribute(CID, part(1, [2.0]), "r1")
    (repeat,) = table.contribute(CID, part(1, [2.0]), "r1-reconnected")
    assert decode(repeat, 1).tolist() == [3.0] and repeat.sinks == ("r1-reconnected",)
    entry = len(CID.job) + len(CID.key) + ENTRY_BYTES  # beside the reply (reducerd.core.results)
    assert table.open_chunk_count == 0 and table.cached_bytes == repeat.reply.held_bytes + entry
    # The next round of the chunk completing drops the older result.
    nxt = ChunkId("job", "k", 1, 0)
    table.contribute(nxt, part(0, [1.0]), "r0")
    (done,) = table.contribute(nxt, part(1, [1.0]), "r1")
    assert CID not in table._results and table.cached_bytes == done.reply.held_bytes + entry
    clock.now = 10.0
    table.expire()
    assert table.cached_bytes == 0
    # Once forgotten, a resend opens the round anew (it is counted once per rank).
    assert table.contribute(CID, part(1, [2.0]), "late") == []
    assert table.open_chunk_count == 1


def test_ranks_that_disagree_on_the_layout_fail_fast():
    """Rank 1 has another daemon list (other fingerprint): the job's open chunks
    fail with INVALID_ARGUMENT at once instead of stalling to the timeout."""
    table = ReductionTable(60, 1 << 30)
    first = Contribution(0, 2, F16, SUM, part(0, [1.0]).data, layout=111)
    assert table.contribute(CID, first, "r0") == []
    other = ChunkId("job", "k", 0, 8)  # a chunk rank 0 never sends to this daemon
    odd = Contribution(1, 2, F16, SUM, part(1, [1.0]).data, layout=222)
    failed = table.contribute(other, odd, "r1")
    assert {d.chunk for d in failed} == {CID, other}
    assert all(d.error_code == "INVALID_ARGUMENT" for d in failed)
    assert "disagree on the chunk layout" in failed[0].error_message
    assert table.open_chunk_count == 0 and table.bytes_held == 0
    # Once the job has nothing open, a new run may bring a new layout.
    nxt = ChunkId("job", "k", 1, 0)
    assert table.contribute(nxt, odd, "r1") == []


def test_idle_jobs_are_forgotten():
    clock = Clock()
    table = ReductionTable(5.0, 1 << 30, clock=clock)
    table.contribute(CID, part(0, [1.0], world_size=1), "r0")
    clock.now = JOB_FORGET_AFTER_S - 1
    table.expire()
    assert "job" in table.jobs
    clock.now = JOB_FORGET_AFTER_S + 1
    table.expire()
    assert "job" not in table.jobs


def test_local_group_fails_a_round_that_never_completes_after_its_timeout():
    import grpc
    from reducer_client import ReducerError
    from reducer_client.testing import LocalGroup

    group = LocalGroup(world_size=2, timeout=0.2)
    future = group.client(0).allreduce_async(np.ones(3), key="k")
    with pytest.raises(ReducerError) as info:
        future.result(timeout=5)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_open_chunks_per_job_are_capped():
    table = ReductionTable(60, 1 << 30, max_open_chunks_per_job=2)
    for offset in (0, 1):
        assert table.contribute(ChunkId("job", "k", 0, offset), part(0, [1.0]), "a") == []
    (refused,) = table.contribute(ChunkId("job", "k", 0, 2), part(0, [1.0]), "a")
    assert refused.error_code == "RESOURCE_EXHAUSTED"
    assert "--max-open-chunks-per-job" in refused.error_message
    assert table.contribute(ChunkId("other", "k", 0, 2), part(0, [1.0]), "a") == []


def test_one_jobs_open_chunk_bytes_are_capped_and_given_back():
    clock = Clock()
    table = ReductionTable(10, max_inflight_bytes=4000, clock=clock)  # 2000 per job
    assert table.max_job_inflight_bytes == 2000
    greedy = [ChunkId("greedy", "k", 0, offset) for offset in range(3)]
    for cid in greedy[:2]:  # 800 bytes of float32 each, never completed
        assert table.contribute(cid, part(0, [1.0] * 200), "g") == []
    (refused,) = table.contribute(greedy[2], part(0, [1.0] * 200), "g")
    assert refused.error_code == "RESOURCE_EXHAUSTED"
    assert "--max-inflight-bytes-per-job" in refused.error_message
    assert "1600 bytes in 2 open chunks" in refused.error_message
    assert table.jobs["greedy"].open_chunk_bytes == 1600 and table.bytes_held == 1600
    # The rest of the limit is the other jobs': one of 2000 bytes fits beside it.
    good = ChunkId("good", "k", 0, 0)
    assert table.contribute(good, part(0, [1.0] * 500), "a") == []
    (done,) = table.contribute(good, part(1, [2.0] * 500), "b")
    assert decode(done, 500).tolist() == [3.0] * 500
    # A completed chunk gives its bytes back to its job ...
    (done,) = table.contribute(greedy[0], part(1, [1.0] * 200), "g1")
    assert done.error_code == "" and done.reply is not None
    assert table.jobs["greedy"].open_chunk_bytes == 800
    assert table.contribute(greedy[2], part(0, [1.0] * 200, world_size=2),
                            "g")[0].error_code == "RESOURCE_EXHAUSTED"  # failed: remembered
    fresh = ChunkId("greedy", "k", 1, 0)
    assert table.contribute(fresh, part(0, [1.0] * 200), "g") == []
    # ... and so do the chunks the round timeout fails.
    clock.now = 11
    assert {d.chunk for d in table.expire()} == {greedy[1], fresh}
    assert table.jobs["greedy"].open_chunk_bytes == 0 and table.bytes_held == 0

