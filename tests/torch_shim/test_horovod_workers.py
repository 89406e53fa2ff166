"""Horovod's torch cases with real worker processes on real daemons (loopback).

One worker function runs the cases in order on 2 ranks (one process start
for all): each result is checked in the test process against a float64
reference; each error must reach every rank within a round trip of the
call (not the client's timeout) and name the ranks.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from support import run_workers

torch = pytest.importorskip("torch")

WORLD_SIZE = 2
TIMEOUT_S = 30.0  # the client's; errors must come far sooner
PROMPT_S = 5.0  # a few round trips on a loaded machine


def _timed_error(action) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "no error", time.monotonic() - start


def horovod_cases(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    import reducer_client.torch as hvd

    torch.set_num_threads(1)
    hvd.init(addresses=addresses, job=job, rank=rank, world_size=world_size,
             wire_dtype="float16", timeout=TIMEOUT_S)
    out: dict = {"basics": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                            hvd.cross_rank(), hvd.cross_size())}
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-100, 100, (17, 17), generator=g).float()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.none).numpy()
    out["mean_fp16"] = hvd.allreduce(x / 7, compression=hvd.Compression.fp16).numpy()
    handles = [hvd.allreduce_async(x * i, name=f"h{i}", op=hvd.Sum,
                                   compression=hvd.Compression.none) for i in range(3)]
    out["async"] = [hvd.synchronize(h).numpy() for h in handles]
    out["gathered"] = hvd.allgather(torch.full((rank + 1, 3), rank, dtype=torch.int64)).numpy()
    out["broadcast"] = hvd.broadcast(torch.arange(5, dtype=torch.float64) * (rank + 1),
                                     root_rank=1).numpy()
    leaf = torch.ones(4, requires_grad=True)
    hvd.allreduce(leaf, op=hvd.Sum).sum().backward()
    out["grad"] = leaf.grad.numpy()
    out["shape"] = _timed_error(lambda: hvd.allreduce(
        torch.zeros((17, 23 * 57) if rank == 0 else (17, 23, 57))))
    out["dtype"] = _timed_error(lambda: hvd.allreduce(
        torch.ones(17, dtype=torch.int32 if rank == 0 else torch.float32)))
    out["root"] = _timed_error(lambda: hvd.broadcast(torch.ones(3), root_rank=rank))
    out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).numpy()  # still in step
    hvd.shutdown()
    return out


def test_horovod_cases_on_real_daemons(daemons):
    with daemons(2) as d:
        results = run_workers(horovod_cases, WORLD_SIZE, (d.addresses, uuid.uuid4().hex),
                              timeout=120)
    xs = [
        torch.randint(-100, 100, (17, 17), generator=torch.Generator().manual_seed(r)).double()
        .numpy() for r in range(WORLD_SIZE)]
    total = xs[0] + xs[1]
    for rank, out in enumerate(results):
        assert out["basics"] == (rank, 2, 0, 1, rank, 2)
        np.testing.assert_array_equal(out["sum"], total)  # integers: exact on float32
        # float16 wire: each contribution and the mean rounded once (2^-11 relative
        # each), the float32 mean of 2 exact otherwise.
        reference = (xs[0] / 7 + xs[1] / 7) / 2
        assert np.abs(out["mean_fp16"] - reference).max() <= 2 * 2 ** -11 * 100 / 7 + 1e-6
        for i, result in enumerate(out["async"]):
            np.testing.assert_array_equal(result, total * i)
        assert out["gathered"].tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 1]]
        np.testing.assert_array_equal(out["broadcast"], np.arange(5) * 2)
        np.testing.assert_array_equal(out["grad"], np.full(4, 2.0))
        for case, words in (("shape", ["shape", "rank 0: (17, 1311)", "rank 1: (17, 23, 57)"]),
                            ("dtype", ["dtype", "rank 0: int32", "rank 1: float32"]),
                            ("root", ["root_rank", "rank 0: 0", "rank 1: 1"])):
            kind, message, seconds = out[case]
            assert kind == "ReducerError" and all(w in message for w in words), out[case]
            assert seconds < PROMPT_S, f"{case}: {seconds:.1f} s"
        np.testing.assert_array_equal(out["after"], [2.0, 2.0])
