"""The result cache alone: rounds replaced, room made oldest first, each job's share."""

from types import SimpleNamespace

from reducerd.chunks import CachedResult, ChunkId
from reducerd.results import JOB_CACHE_SHARE, ResultCache


def result(nbytes: int) -> CachedResult:
    return CachedResult(0, 0, 2, nbytes, SimpleNamespace(held_bytes=nbytes), 60.0)


def test_a_later_round_replaces_the_earlier_one_and_a_put_again_counts_once():
    cache = ResultCache(1000)
    cache.put(ChunkId("j", "k", 0, 0), result(100))
    cache.put(ChunkId("j", "k", 1, 0), result(100))
    assert ChunkId("j", "k", 0, 0) not in cache and cache.bytes == 100
    cache.put(ChunkId("j", "k", 1, 0), result(100))
    assert cache.bytes == 100
    cache.clear()
    assert cache.bytes == 0 and list(cache) == [] and cache._jobs == {}


def test_a_job_that_completes_chunk_after_chunk_keeps_to_its_share():
    cache = ResultCache(1000)
    assert JOB_CACHE_SHARE == 2
    good = [ChunkId("good", f"k{i}", 0, 0) for i in range(4)]
    for cid in good:
        cache.put(cid, result(100))
    greedy = [ChunkId("greedy", f"k{i}", 0, 0) for i in range(50)]
    for cid in greedy:  # before the share: the good job's results went first
        cache.put(cid, result(100))
    assert all(cid in cache for cid in good)
    kept = [cid for cid in greedy if cid in cache]
    assert kept == greedy[-5:]  # its newest 500 bytes, half the cache
    assert cache.bytes == 900
    # The whole cache still makes room oldest first once both are in it.
    cache.put(ChunkId("third", "k", 0, 0), result(300))
    assert cache.bytes <= 1000 and ChunkId("third", "k", 0, 0) in cache
    assert good[0] not in cache and good[1] not in cache
    # A result over a job's share is not kept at all.
    cache.put(ChunkId("big", "k", 0, 0), result(501))
    assert ChunkId("big", "k", 0, 0) not in cache
