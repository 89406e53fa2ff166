import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reducer_client.layout import plan_chunks


def _check_cover(chunks, numel):
    """Every element in exactly one chunk, chunks contiguous and in order."""
    offset = 0
    for chunk in chunks:
        assert chunk.offset == offset and chunk.numel > 0
        offset += chunk.numel
    assert offset == numel


@settings(max_examples=300, deadline=None)
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
    if numel >= daemons:
        # Chunk sizes differ by <= 1 element and chunks go round-robin, so the
        # daemons' shares differ by at most one element per chunk they hold.
        per_daemon = [sum(c.numel for c in chunks if c.daemon == d) for d in range(daemons)]
        sizes = {c.numel for c in chunks}
        assert max(sizes) - min(sizes) <= 1
        assert max(per_daemon) - min(per_daemon) <= -(-len(chunks) // daemons)


def test_small_keys_spread_over_daemons():
    firsts = {plan_chunks(1, 2, 4, 1 << 20, f"grad/{i}")[0].daemon for i in range(64)}
    assert firsts == {0, 1, 2, 3}


def test_chunk_count_is_multiple_of_daemons():
    chunks = plan_chunks(3 << 20, 2, 3, 1 << 20, "k")  # 6 MiB of float16
    assert len(chunks) == 6
    assert [c.daemon for c in chunks] == [(chunks[0].daemon + i) % 3 for i in range(6)]


@pytest.mark.parametrize("args", [(-1, 2, 1, 8), (10, 2, 0, 8), (10, 4, 1, 2)])
def test_bad_arguments_are_named(args):
    with pytest.raises(ValueError):
        plan_chunks(*args)


def test_default_chunks_leave_every_daemon_several_to_pipeline():
    from reducer_client.layout import MIN_CHUNK_BYTES, pipelined_chunk_bytes

    mib = 1 << 20
    assert pipelined_chunk_bytes(64 * mib, 2) == mib  # large keys: the 1 MiB ceiling
    assert pipelined_chunk_bytes(8 * mib, 4) == mib // 8  # 16 chunks per daemon
    assert pipelined_chunk_bytes(1000, 4) == MIN_CHUNK_BYTES  # small keys: one chunk
    assert pipelined_chunk_bytes(8 * mib, 4, max_chunk_bytes=1024) == 1024
    chunks = plan_chunks(4 * mib, 2, 4, pipelined_chunk_bytes(8 * mib, 4), "k")
    assert len(chunks) == 64
