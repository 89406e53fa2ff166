import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reducer_wire.layout import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, plan_chunks


def _check_cover(chunks, numel):
    """Every element in exactly one chunk, chunks contiguous and in order."""
    offset = 0
    for chunk in chunks:
        assert chunk.offset == offset and chunk.numel > 0
        offset += chunk.numel
    assert offset == numel


@settings(max_examples=120, deadline=None)  # tiny chunk_bytes plan 1e5 chunks
@given(numel=st.integers(0, 200_000), itemsize=st.sampled_from([2, 4]),
       daemons=st.integers(1, 8), chunk_bytes=st.integers(4, 1 << 20),
       key=st.text(max_size=8))
def test_every_element_once_balanced_and_deterministic(numel, itemsize, daemons,
                                                       chunk_bytes, key):
    chunks = plan_chunks(numel, itemsize, daemons, chunk_bytes, key)
    _check_cover(chunks, numel)
    assert chunks == plan_chunks(numel, itemsize, daemons, chunk_bytes, key)
    assert all(c.numel * itemsize <= max(chunk_bytes, itemsize) for c in chunks)
    assert all(0 <= c.daemon < daemons for c in chunks)
    sizes = {c.numel for c in chunks}
    assert not chunks or max(sizes) - min(sizes) <= 1
    floor = max(1, min(MIN_CHUNK_BYTES, chunk_bytes) // itemsize)
    if numel >= daemons * floor:
        # Spread over every daemon: chunks go round-robin, so the daemons'
        # shares differ by at most one element per chunk they hold.
        assert len(chunks) % daemons == 0 or len(chunks) == numel  # one element each
        per_daemon = [sum(c.numel for c in chunks if c.daemon == d) for d in range(daemons)]
        assert max(per_daemon) - min(per_daemon) <= -(-len(chunks) // daemons)
    elif chunks:
        # A small key: at most one chunk per daemon, each of the floor at least
        # unless chunk_bytes asks for more chunks.
        assert len({c.daemon for c in chunks}) == len(chunks) <= daemons
        needed = -(-numel // max(1, chunk_bytes // itemsize))
        assert len(chunks) == needed or min(sizes) >= floor


def test_small_keys_spread_over_daemons():
    firsts = {plan_chunks(1, 2, 4, 1 << 20, f"grad/{i}")[0].daemon for i in range(64)}
    assert firsts == {0, 1, 2, 3}


def test_keys_under_a_floor_chunk_per_daemon_are_not_cut_for_every_daemon():
    """A 64 Ki-element float32 bucket on a float16 wire (128 KiB) over 8 daemons:
    2 chunks of 64 KiB on consecutive daemons, not 8 of 16 KiB (each chunk
    costs the client and the daemon CPU whatever its size); from 8 x 64 KiB
    on, every daemon gets a share again."""
    from reducer_wire.layout import pipelined_chunk_bytes

    small = plan_chunks(1 << 16, 2, 8, pipelined_chunk_bytes(128 << 10, 8), "b")
    first = zlib.crc32(b"b") % 8
    assert [(c.numel, c.daemon) for c in small] == [(1 << 15, first), (1 << 15, (first + 1) % 8)]
    three = plan_chunks(100_000, 2, 8, 1 << 20, "c")  # 200 kB: three chunks of >= 64 KiB
    assert len(three) == 3 and min(c.numel for c in three) * 2 >= MIN_CHUNK_BYTES
    spread = plan_chunks(1 << 18, 2, 8, pipelined_chunk_bytes(512 << 10, 8), "d")
    assert len(spread) == 8 and {c.daemon for c in spread} == set(range(8))


def test_chunk_count_is_multiple_of_daemons():
    chunks = plan_chunks(3 << 20, 2, 3, 1 << 20, "k")  # 6 MiB of float16
    assert len(chunks) == 6
    assert [c.daemon for c in chunks] == [(chunks[0].daemon + i) % 3 for i in range(6)]


@pytest.mark.parametrize("args", [(-1, 2, 1, 8), (10, 2, 0, 8), (10, 4, 1, 2)])
def test_bad_arguments_are_named(args):
    with pytest.raises(ValueError):
        plan_chunks(*args)


def test_default_chunks_weigh_the_pipelines_ends_against_the_cost_per_chunk():
    """Rule v4: sqrt(cost x bytes per daemon / 2), at most 32 chunks per
    daemon, within [64 KiB, the 1 MiB ceiling]; the cost is the daemon's
    whole fixed cost per chunk on a fast network, less on a slower link."""
    from reducer_wire.layout import (
        CHUNK_COST_BYTES,
        DAEMON_BYTES_PER_S,
        chunk_cost_bytes,
        pipelined_chunk_bytes,
    )

    mib = 1 << 20
    assert chunk_cost_bytes() == chunk_cost_bytes(12.5e9) == CHUNK_COST_BYTES == 128 << 10
    assert chunk_cost_bytes(DAEMON_BYTES_PER_S / 4) == CHUNK_COST_BYTES // 4
    slow = chunk_cost_bytes(25e6)  # 200 Mbit/s
    assert slow == round(CHUNK_COST_BYTES * 25e6 / DAEMON_BYTES_PER_S) == 2185
    # A fast network: 16 MiB per daemon gives sqrt(2^17 x 2^24 / 2) = 1 MiB.
    assert pipelined_chunk_bytes(32 * mib, 2) == mib
    assert pipelined_chunk_bytes(64 * mib, 2) == mib  # 1.41 MiB wanted: the ceiling
    assert pipelined_chunk_bytes(8 * mib, 4) == math.isqrt((128 << 10) * mib)  # 362 KiB
    assert pipelined_chunk_bytes(1000, 4) == MIN_CHUNK_BYTES  # small keys: one chunk
    assert pipelined_chunk_bytes(8 * mib, 4, max_chunk_bytes=1024) == 1024
    # Never more than 32 per daemon, whatever the cost.
    assert pipelined_chunk_bytes(64 * mib, 4, cost_bytes=1) == mib // 2
    chunks = plan_chunks(16 * mib, 2, 4, pipelined_chunk_bytes(32 * mib, 4, cost_bytes=1), "k")
    assert len(chunks) == 128 and {c.numel for c in chunks} == {mib // 8}
    with pytest.raises(ValueError, match="cost_bytes"):
        pipelined_chunk_bytes(mib, 1, cost_bytes=0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="link rate"):
            chunk_cost_bytes(bad)


TOTALS = [1, 1000, 16 << 10, 64 << 10, 512 << 10, 1 << 20, 3 << 20, 4_325_376, 8 << 20,
          16 << 20, 100_000_007, 1 << 30, *range(1 << 16, 64 << 20, 999_983)]


@pytest.mark.parametrize("daemons", [1, 2, 3, 4, 8])
def test_where_a_chunks_fixed_cost_is_64_kib_or_more_rule_v5_cuts_as_v4(daemons):
    """A fast network (or a link of 10 Gbit/s and up, where the daemon's CPU
    sets the pace): the floor stays 64 KiB, so every key is cut as before."""
    from reducer_wire.layout import CHUNK_COST_BYTES, chunk_cost_bytes, pipelined_chunk_bytes

    for cost in (CHUNK_COST_BYTES, chunk_cost_bytes(1.25e9), MIN_CHUNK_BYTES):
        for total in TOTALS:
            per_daemon = -(-total // daemons)
            wanted = max(math.isqrt(cost * per_daemon // 2), -(-per_daemon // 32))
            v4 = max(MIN_CHUNK_BYTES, min(DEFAULT_CHUNK_BYTES, wanted))
            assert pipelined_chunk_bytes(total, daemons, cost_bytes=cost) == v4, (cost, total)


@pytest.mark.parametrize("daemons", [1, 2, 3, 4, 8])
def test_on_a_slow_link_the_floor_is_a_chunks_fixed_cost_but_16_kib_at_least(daemons):
    """At 200 Mbit/s (a fixed cost of 2,185 bytes) rule v5's floor is 16 KiB
    for a key of 64 KiB per daemon or more: where v3 and v4 gave 32 chunks
    per daemon of 64 KiB or more, the same; below, the cost model's size, 16
    KiB at least (v4: 64 KiB). A smaller key keeps v4's 64 KiB chunks, at
    most one per daemon (the training bench's buckets: 4x the chunks cost
    its 2 cores 3.7 % of a step)."""
    from reducer_wire.layout import (
        SLOW_LINK_MIN_CHUNK_BYTES,
        chunk_cost_bytes,
        pipelined_chunk_bytes,
    )

    slow = chunk_cost_bytes(25e6)
    for total in TOTALS:
        per_daemon = -(-total // daemons)
        v3 = max(MIN_CHUNK_BYTES, min(DEFAULT_CHUNK_BYTES, -(-per_daemon // 32)))
        got = pipelined_chunk_bytes(total, daemons, cost_bytes=slow)
        if v3 > MIN_CHUNK_BYTES or per_daemon < MIN_CHUNK_BYTES:
            assert got == v3, total
        else:
            wanted = max(math.isqrt(slow * per_daemon // 2), -(-per_daemon // 32))
            assert got == max(SLOW_LINK_MIN_CHUNK_BYTES, wanted) <= MIN_CHUNK_BYTES, total
    # The emulated cluster's keys (N = D = 4): float16 1 MiB and 16 MiB, int8 16 MiB.
    assert pipelined_chunk_bytes(512 << 10, 4, cost_bytes=slow) == 16 << 10
    assert pipelined_chunk_bytes(8 << 20, 4, cost_bytes=slow) == 64 << 10
    assert pipelined_chunk_bytes(4_325_376, 4, cost_bytes=slow) == 34_371
    assert pipelined_chunk_bytes(128 << 10, 8, cost_bytes=slow) == 64 << 10  # a small key
    assert len(plan_chunks(1 << 16, 2, 8, 64 << 10)) == 2
    # 1 Gbit/s: a fixed cost of 10,923 bytes, so the floor is 16 KiB too.
    assert pipelined_chunk_bytes(1 << 20, 4, cost_bytes=chunk_cost_bytes(125e6)) == 37_837


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(1, 1 << 22), daemons=st.integers(1, 8),
       dtype_name=st.sampled_from(["float16", "float32", "int8", "fp8_e4m3"]),
       key=st.text(max_size=8), default=st.booleans(),
       cost=st.sampled_from([1, 2185, 128 << 10]))
def test_wire_layout_covers_in_whole_blocks_within_bounds(numel, daemons, dtype_name, key,
                                                          default, cost):
    """What every worker computes alone from (length, key, daemons, chunk_bytes):
    the same chunks, each element in exactly one, whole 128-element blocks for
    int8, no chunk over its bytes, at most 32 per daemon (one more for int8's
    rounding to whole blocks) by default."""
    from reducer_wire import dtypes
    from reducer_wire.layout import (
        MIN_CHUNK_BYTES,
        PIPELINE_CHUNKS_PER_DAEMON,
        pipelined_chunk_bytes,
        plan_wire_chunks,
    )

    dtype = dtypes.WIRE_DTYPES[dtype_name]
    block = dtypes.wire_block(dtype)
    total = dtypes.wire_nbytes(dtype, numel)
    chunk_bytes = pipelined_chunk_bytes(total, daemons, cost_bytes=cost) if default else 200_000
    chunks = plan_wire_chunks(numel, dtype, daemons, chunk_bytes, key)
    _check_cover(chunks, numel)
    assert chunks == plan_wire_chunks(numel, dtype, daemons, chunk_bytes, key)
    assert all(c.offset % block == 0 for c in chunks)
    assert all(c.numel % block == 0 for c in chunks[:-1])
    assert all(dtypes.wire_nbytes(dtype, c.numel) <= chunk_bytes for c in chunks)
    blocks = [-(-c.numel // block) for c in chunks]
    assert max(blocks) - min(blocks) <= 1
    first = zlib.crc32(key.encode()) % daemons
    assert [c.daemon for c in chunks] == [(first + i) % daemons for i in range(len(chunks))]
    if default and chunk_bytes > MIN_CHUNK_BYTES:
        assert len(chunks) <= (PIPELINE_CHUNKS_PER_DAEMON + 1) * daemons


def test_fingerprint_names_rule_daemons_place_chunk_bytes_and_sizing():
    import hashlib

    from reducer_wire.layout import LAYOUT_RULE, KeyLayout, layout_fingerprint

    def v1(num_daemons, daemon, chunk_bytes, rule="v1"):  # what older clients send
        text = f"reducer-layout/{rule} {num_daemons} {daemon} {chunk_bytes}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") or 1

    def v4(num_daemons, daemon, chunk_bytes, cost):  # a v4 client: the same sizing words
        text = f"reducer-layout/v4 {num_daemons} {daemon} {chunk_bytes} cost={cost}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") or 1

    assert LAYOUT_RULE == "reducer-layout/v5"
    base = layout_fingerprint(4, 1, 1 << 20, 128 << 10)
    assert base == layout_fingerprint(4, 1, 1 << 20, 128 << 10) and 0 < base < 1 << 64
    others = {layout_fingerprint(5, 1, 1 << 20, 128 << 10),
              layout_fingerprint(4, 2, 1 << 20, 128 << 10),
              layout_fingerprint(4, 1, 1 << 19, 128 << 10),
              layout_fingerprint(4, 1, 1 << 20, 2185),  # sized for a 200 Mbit/s link
              layout_fingerprint(4, 1, 1 << 20, None),  # fixed 1 MiB chunks
              v1(4, 1, 1 << 20), v1(4, 1, 1 << 20, "v2"), v1(4, 1, 1 << 20, "v3"),
              v4(4, 1, 1 << 20, 128 << 10)}
    assert base not in others and len(others) == 9
    # Links the daemon cannot keep up with anyway size chunks alike: they agree.
    assert KeyLayout.for_link(4, None, 12.5e9).fingerprint(1) == base
    assert KeyLayout.for_link(4, None, None).fingerprint(1) == base
    assert KeyLayout.for_link(4, 1 << 20, 12.5e9).fingerprint(1) == layout_fingerprint(
        4, 1, 1 << 20, None)


def test_a_key_layout_cuts_keys_by_its_rule():
    from reducer_wire import dtypes
    from reducer_wire.layout import KeyLayout, pipelined_chunk_bytes, plan_wire_chunks

    f16, int8 = dtypes.WIRE_DTYPES["float16"], dtypes.WIRE_DTYPES["int8"]
    fast, slow = KeyLayout.for_link(2), KeyLayout.for_link(2, None, 25e6)
    numel = 16 << 20  # 32 MiB of float16
    assert fast.chunk_bytes_of(numel, f16) == 1 << 20
    assert slow.chunk_bytes_of(numel, f16) == 512 << 10  # 32 per daemon, as v3
    assert fast.plan(numel, f16, "k") == plan_wire_chunks(numel, f16, 2, 1 << 20, "k")
    assert len(slow.plan(numel, f16, "k")) == 64
    fixed = KeyLayout.for_link(2, 200_000)
    assert fixed.chunk_bytes_of(10, f16) == fixed.chunk_bytes_of(numel, int8) == 200_000
    assert fast.chunk_bytes_of(numel, int8) == pipelined_chunk_bytes(
        dtypes.wire_nbytes(int8, numel), 2)


def test_daemon_refuses_a_job_whose_clients_cut_by_different_rules():
    """An old (v1) and a new client in one job: the daemon fails the chunk
    with INVALID_ARGUMENT naming the layout, instead of summing mismatched chunks."""
    import hashlib

    from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
    from reducer_wire.layout import layout_fingerprint

    from reducerd.core.chunks import ChunkId, Contribution
    from reducerd.core.reduction import ReductionTable

    old = int.from_bytes(hashlib.blake2b(b"reducer-layout/v1 2 0 1048576",
                                         digest_size=8).digest(), "little") or 1
    table = ReductionTable(round_timeout_s=5, max_inflight_bytes=1 << 20)
    cid = ChunkId("job", "k", 0, 0)
    data = np.ones(4, dtype="<f2").tobytes()
    new = layout_fingerprint(2, 0, 1 << 20, 128 << 10)
    assert table.contribute(cid, Contribution(0, 2, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, data,
                                              new), "rank0") == []
    failed = table.contribute(cid, Contribution(1, 2, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM,
                                                data, old), "rank1")
    assert failed and all(d.error_code == "INVALID_ARGUMENT" for d in failed)
    assert "disagree on the chunk layout" in failed[0].error_message
    assert {s for d in failed for s in d.sinks} == {"rank0", "rank1"}


def test_a_bert_large_step_of_small_buckets_stays_balanced_over_the_daemons():
    """Layout v3 spreads small keys by their CRC alone: the DistributedOptimizer's
    50 buckets of BERT-large at the bench's byte scale 100 (128 KiB each on a
    float16 wire) put at most 1.15x the mean bytes on the busiest daemon, in
    2-3 chunks a bucket instead of one per daemon (docs/benchmarks/training.md)."""
    torch = pytest.importorskip("torch")
    from reducer_client.torch.optimizer import _plan_buckets
    from reducer_wire import dtypes
    from reducer_wire.layout import pipelined_chunk_bytes, plan_wire_chunks

    from reducerd.bench.train.specs import bert_large

    named = [(p.name, torch.empty(-(-p.numel // 100), device="meta"))
             for p in bert_large().params]
    buckets = _plan_buckets(named, 262_144, "optimizer.0")
    assert len(buckets) == 50
    f16 = dtypes.WIRE_DTYPES["float16"]
    for daemons in (4, 8):
        load, chunks = [0] * daemons, 0
        for bucket in buckets:
            numel = sum(p.numel() for p in bucket.params)
            size = pipelined_chunk_bytes(dtypes.wire_nbytes(f16, numel), daemons)
            for chunk in plan_wire_chunks(numel, f16, daemons, size, bucket.key):
                load[chunk.daemon] += chunk.numel
                chunks += 1
        assert max(load) <= 1.15 * sum(load) / daemons, (daemons, load)
        assert chunks <= 3 * len(buckets)


def test_the_old_import_path_is_the_same_rule():
    """Scripts that import reducer_client.layout get reducer_wire.layout's objects."""
    import reducer_client.layout as old
    import reducer_wire.layout as rule

    assert all(getattr(old, name) is getattr(rule, name) for name in old.__all__)
