"""The result cache alone: rounds replaced, room made oldest first, each job's share.

Every job name here is 4 characters and every key 3, so every entry of a
reply of n bytes counts n + 7 + ENTRY_BYTES.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

from reducerd.core.chunks import CachedResult, ChunkId
from reducerd.core.results import ENTRY_BYTES, JOB_CACHE_SHARE, ResultCache

NAMES = 7


def result(nbytes: int) -> CachedResult:
    return CachedResult(0, 0, 2, nbytes, SimpleNamespace(held_bytes=nbytes), 60.0)


def entry(nbytes: int) -> int:
    return nbytes + NAMES + ENTRY_BYTES


def test_a_later_round_replaces_the_earlier_one_and_a_put_again_counts_once():
    cache = ResultCache(10 * entry(100))
    cache.put(ChunkId("jjjj", "kkk", 0, 0), result(100))
    cache.put(ChunkId("jjjj", "kkk", 1, 0), result(100))
    assert ChunkId("jjjj", "kkk", 0, 0) not in cache and cache.bytes == entry(100)
    cache.put(ChunkId("jjjj", "kkk", 1, 0), result(100))
    assert cache.bytes == entry(100)
    cache.clear()
    assert cache.bytes == 0 and list(cache) == [] and cache._jobs == {}


def test_a_job_that_completes_chunk_after_chunk_keeps_to_its_share():
    cache = ResultCache(10 * entry(100))
    assert JOB_CACHE_SHARE == 2
    good = [ChunkId("good", f"k{i:02d}", 0, 0) for i in range(4)]
    for cid in good:
        cache.put(cid, result(100))
    greedy = [ChunkId("grdy", f"k{i:02d}", 0, 0) for i in range(50)]
    for cid in greedy:  # before the share: the good job's results went first
        cache.put(cid, result(100))
    assert all(cid in cache for cid in good)
    kept = [cid for cid in greedy if cid in cache]
    assert kept == greedy[-5:]  # its newest, half the cache
    assert cache.bytes == 9 * entry(100)
    # The whole cache still makes room oldest first once both are in it.
    cache.put(ChunkId("thrd", "k00", 0, 0), result(300))
    assert cache.bytes <= 10 * entry(100) and ChunkId("thrd", "k00", 0, 0) in cache
    assert good[0] not in cache and good[1] in cache
    # A result over a job's share is not kept at all.
    cache.put(ChunkId("bigg", "k00", 0, 0), result(5 * entry(100) - NAMES - ENTRY_BYTES + 1))
    assert ChunkId("bigg", "k00", 0, 0) not in cache


_TINY_RESULTS_RSS_SCRIPT = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducerd.bench.procs import proc_status
from reducerd.core.reduction import ChunkId, Contribution, ReductionTable

table = ReductionTable(60.0, 64 << 20)  # results kept: 32 MiB, one job's 16 MiB
one = np.ones(1, np.float16).tobytes()
def results(first, count):  # one element each, every key new and 1,024 characters long
    for i in range(first, first + count):
        cid = ChunkId("job", f"{i:08d}".ljust(1024, "k"), 0, 0)
        part = Contribution(0, 1, pb.DTYPE_FLOAT16, pb.REDUCE_OP_SUM, one)
        [done] = table.contribute(cid, part, 0)
        assert not done.error_code, done
before = proc_status(os.getpid())["VmRSS"]
results(0, int(sys.argv[1]))
print(json.dumps({"before": before, "after": proc_status(os.getpid())["VmRSS"],
                  "cached": table.cached_bytes}))
"""


def test_tiny_results_hold_what_the_cache_counts_measured_in_vmrss():
    """The cache counted reply bytes alone: a 1-element result of a 1 KiB key
    counted 1.1 KiB and held 3.7, so many tiny results held 3.5x what it
    counted (+56 MiB for one job's 16 MiB here). Each entry now counts its
    records and names too (ENTRY_BYTES): +17 MiB."""
    done = subprocess.run([sys.executable, "-c", _TINY_RESULTS_RSS_SCRIPT, "60000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["cached"] <= 16 << 20
    assert figures["after"] - figures["before"] < (16 << 20) * 1.25 + (4 << 20), figures
