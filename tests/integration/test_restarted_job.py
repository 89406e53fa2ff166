"""A plain job restarted under the same job id never gets an earlier incarnation's sums.

Contract section 2 (**new**): torchrun's elastic agent restarts every worker
under the same job id; the daemons still hold each chunk's last result for
resends (contract section 2), keyed by job, key, round and offset, and the
new processes count their rounds from 0 again. Shard.incarnation (a random
id per client instance) tells the daemons that these are new instances.

Scenario 1: job J runs 2 workers for STEPS steps summing values v, the
processes exit, and a new pair starts under J summing w: every step must
give the sum of w (today's main answered the last round from its cache
with the sum of v).

Scenario 2: as 1, but the first pair dies in the middle of a step: rank 1
has sent its contribution, rank 0 never does, so the daemons hold that
round open with the old rank 1's values (checked with GetStatus). The new
pair must get the sums of w at that round too, never old + new.

Scenario 3: as 1 with node-local aggregation (2 workers on one node, so
the daemons see one contributor): both local ranks send the node's slices
with one incarnation, the node's, so the daemons see one instance per node
and no false restart; the new pair still gets w.

Values are small integers, so every sum is exact in float32 (below 2^24):
the float64 reference must match exactly.
"""

from __future__ import annotations

import time
import uuid

import grpc
import numpy as np
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from support import run_workers

STEPS = 3
NUMEL = 5000  # 20 kB of float32: several chunks of CHUNK_BYTES over both daemons
CHUNK_BYTES = 4096
CLIENT_TIMEOUT_S = 20.0
ROUND_TIMEOUT_S = 30  # keeps the dead pair's open round open while the new pair runs


def _values(rank: int, step: int, scale: float) -> np.ndarray:
    return (scale * (rank + 1) * (step + 1) + np.arange(NUMEL) % 7).astype(np.float32)


def _expected(world_size: int, step: int, scale: float) -> np.ndarray:
    return sum(_values(r, step, scale).astype(np.float64) for r in range(world_size))


def steps_worker(rank: int, world_size: int, addresses: list[str], job: str, scale: float,
                 vanish_at: int | None = None, node_local: bool = False) -> list[np.ndarray]:
    """Sum _values for STEPS steps; at step vanish_at, rank 1 sends and the pair exits."""
    from reducer_client import ReducerClient

    node = (dict(local_rank=rank, local_size=world_size) if node_local
            else dict(node_local=False))
    sums = []
    with ReducerClient(addresses, job, rank, world_size, wire_dtype="float32",
                       timeout=CLIENT_TIMEOUT_S, chunk_bytes=CHUNK_BYTES, **node) as client:
        for step in range(STEPS):
            values = _values(rank, step, scale)
            if step == vanish_at:
                if rank == 1:
                    client.allreduce_async(values, key="grad")
                    time.sleep(1.0)  # its shards reach the daemons; rank 0 sends none
                return sums
            sums.append(client.allreduce(values, key="grad"))
    return sums


def _job_status(addresses: list[str], job: str) -> list[pb.JobStatus]:
    rows = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.ReducerStub(channel).GetStatus(pb.StatusRequest(job=job),
                                                           timeout=5)
        rows += [j for j in reply.jobs if j.job == job]
    return rows


def _open_chunks(addresses: list[str], job: str) -> int:
    return sum(j.open_chunks for j in _job_status(addresses, job))


def _check(results: list[list[np.ndarray]], scale: float, steps: int = STEPS) -> None:
    for rank, sums in enumerate(results):
        assert len(sums) == steps
        for step, got in enumerate(sums):
            want = _expected(2, step, scale)
            assert np.array_equal(got.astype(np.float64), want), (
                f"rank {rank} step {step}: got {got[:3]}, want {want[:3]} (the earlier "
                f"incarnation's would be {_expected(2, step, 1.0)[:3]})")


def test_restarted_pair_gets_the_new_sums(daemons):
    job = uuid.uuid4().hex
    with daemons(2, round_timeout=ROUND_TIMEOUT_S) as d:
        _check(run_workers(steps_worker, 2, (d.addresses, job, 1.0), timeout=60), 1.0)
        _check(run_workers(steps_worker, 2, (d.addresses, job, 10.0), timeout=60), 10.0)
        assert all(f"job {job!r} restarted" in daemon.log() for daemon in d.processes)


def test_restart_with_a_round_left_open_by_the_dead_pair(daemons):
    job = uuid.uuid4().hex
    with daemons(2, round_timeout=ROUND_TIMEOUT_S) as d:
        first = run_workers(steps_worker, 2, (d.addresses, job, 1.0, STEPS - 1), timeout=60)
        _check(first, 1.0, steps=STEPS - 1)
        assert _open_chunks(d.addresses, job) > 0, "the dead pair left no round open"
        _check(run_workers(steps_worker, 2, (d.addresses, job, 10.0), timeout=60), 10.0)
        assert _open_chunks(d.addresses, job) == 0  # the dead pair's round failed, not left


def test_restarted_node_local_pair_gets_the_new_sums(daemons):
    job = uuid.uuid4().hex
    with daemons(2, round_timeout=ROUND_TIMEOUT_S) as d:
        args = (d.addresses, job)
        _check(run_workers(steps_worker, 2, (*args, 1.0, None, True), timeout=60), 1.0)
        _check(run_workers(steps_worker, 2, (*args, 10.0, None, True), timeout=60), 10.0)
        # One contributor (the node) per chunk, and one instance per node: no false restart
        # between the local ranks' slices, one real one between the pairs.
        assert {w for j in _job_status(d.addresses, job) for w in j.world_sizes} == {1}
        assert all(daemon.log().count(f"job {job!r} restarted") == 1
                   for daemon in d.processes)
