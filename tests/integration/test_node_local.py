"""Node-local aggregation: real daemons, real worker processes, simulated nodes.

Nodes are simulated on loopback by giving each group of workers its own local
ranks (rank r is local rank r % L of node r // L). Tolerance: core_cases.
error_bound, the flat path's bound. It also bounds the node path: a value goes
through L-1 float32 additions on the node and N-1 on the daemons (plus one
division by L for MEAN) instead of W-1, and is rounded to the wire dtype once
per node instead of once per worker; since L + N - 1 <= L N = W, every term of
the node path's error is covered (see reducer_client/node.py).
"""

import os
import signal
import time

import grpc
import pytest
from node_cases import SIZES, kill_worker, matrix_worker, straggler_worker
from reducer_client import ReducerClient
from reducer_client.env import local_settings_from_env
from reducer_client.node.shm import SHM_DIR, segment_prefix
from reducer_client.node.topology import MIN_SLICE_BYTES, node_slice, node_topology, slice_bounds
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire._proto.reducer.v1 import reducer_pb2_grpc as pb_grpc
from support import run_workers

# Job names are per host: two test runs at once on one host must not meet.
RUN = os.getpid()


def _world_sizes(addresses: list[str]) -> dict[str, set[int]]:
    """job -> the world sizes the daemons saw in its shards (GetStatus)."""
    seen: dict[str, set[int]] = {}
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.ReducerStub(channel).GetStatus(pb.StatusRequest(), timeout=5)
        for job in reply.jobs:
            seen.setdefault(job.job, set()).update(job.world_sizes)
    return seen


def _wait_gone(pid_file, timeout_s: float = 10.0) -> None:
    """Wait for the victim's forked child (not ours to reap) to exit; kill it if late."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _leftovers(job: str, nodes: int) -> list[str]:
    prefixes = tuple(segment_prefix(job, n) for n in range(nodes))
    return [name for name in os.listdir(SHM_DIR) if name.startswith(prefixes)]


@pytest.mark.parametrize("nodes,local_size,via_env", [(2, 2, False), (1, 4, True)],
                         ids=["2x2-args", "1x4-env"])
def test_node_local_matches_float64_like_flat(daemons, nodes, local_size, via_env):
    """SUM and MEAN, float16 and float32 wire: node-local and flat results both
    lie within the error bound of the float64 reference; every rank gets the
    same bytes; the daemons see one contribution per node (world_size = nodes)
    for node-local jobs and one per worker for flat ones; nothing stays in
    /dev/shm."""
    world = nodes * local_size
    tag = f"nl{nodes}x{local_size}-{RUN}"
    with daemons(2) as d:
        results = run_workers(matrix_worker, world,
                              (d.addresses, local_size, tag, via_env), timeout=120)
        seen = _world_sizes(d.addresses)
    for wire in ("float16", "float32"):
        assert seen[f"{tag}-node-{wire}"] == {nodes}
        assert seen[f"{tag}-flat-{wire}"] == {world}
    for result in results:
        assert result["local_size"] == local_size
        assert len(result["cases"]) == 2 * 2 * (2 * len(SIZES) + 2)
        for case in result["cases"]:
            assert case["ratio"] <= 1.0, case
        assert max(result["async"]) <= 1.0 and len(result["async"]) == 8
        assert result["broadcast"] == {"float32": True, "float16": True}
        code, message = result["mismatch"]["error"]
        assert code == "INVALID_ARGUMENT" and "local ranks disagree" in message
        assert result["mismatch"]["good"] == [world * (world + 1) / 2] * 10
    for i in range(len(results[0]["cases"])):  # every rank of a job got the same bytes
        assert len({r["cases"][i]["digest"] for r in results}) == 1, results[0]["cases"][i]
    assert _leftovers(f"{tag}-node-float16", nodes) == []


@pytest.mark.parametrize("victim", [1, 0], ids=["local-rank-1", "local-rank-0"])
def test_killed_local_worker_fails_the_others_fast_and_leaks_nothing(daemons, victim,
                                                                   tmp_path):
    """Three workers on one node (uneven slices, MEAN over L = 3 checked first);
    one forks a child that lingers 2 s after it, then is SIGKILLed after
    writing its input for step 1. The others get a clear ReducerError
    (ABORTED, naming the lost local worker) well before the child exits (it
    does not hold the dead worker's socket open), far from the 30 s timeout;
    later calls fail at once; /dev/shm holds nothing of the job afterwards.
    Local rank 0 hosts the coordinator, so both roles die."""
    job = f"nl-kill-{victim}-{RUN}"
    pid_file = tmp_path / "child.pid"
    try:
        with daemons(2) as d:
            results = run_workers(kill_worker, 3, (d.addresses, job, victim, str(pid_file)),
                                  timeout=90, allow_errors=True)
    finally:
        _wait_gone(pid_file)
    assert isinstance(results[victim], Exception)
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert not isinstance(result, Exception), result
        assert result["step0"] <= 1.0
        code, message = result["error"]
        assert code == "ABORTED", result
        assert ("local rank 1" in message) if victim == 1 else ("coordinator" in message)
        assert result["elapsed"] < 1.5, result
        assert result["later"] == "ABORTED"
    assert _leftovers(job, 1) == []


def test_straggler_is_named_within_the_timeout(daemons):
    """Local rank 1 never reaches the key: local rank 0 fails after ~timeout (2 s)
    with DEADLINE_EXCEEDED naming local rank 1."""
    with daemons(1) as d:
        results = run_workers(straggler_worker, 2, (d.addresses, f"nl-straggler-{RUN}"),
                              timeout=60)
    code, message = results[0]["error"]
    assert code == "DEADLINE_EXCEEDED" and "local rank(s) [1]" in message, message
    assert 1.5 < results[0]["elapsed"] < 5


def test_one_worker_per_node_uses_no_shared_memory(daemons, monkeypatch):
    """L = 1 (the default) and node_local=False: no node group, no segment."""
    for var in ("REDUCER_LOCAL_RANK", "REDUCER_LOCAL_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "REDUCER_NODE_LOCAL", "REDUCER_NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    import numpy as np

    with daemons(1) as d:
        with ReducerClient(d.addresses, job=f"nl-single-{RUN}", rank=0, world_size=1) as client:
            assert client.local_size == 1 and client._node is None
            out = client.allreduce(np.arange(1000, dtype=np.float32), key="k")
            assert out[-1] == 999
            assert _leftovers(f"nl-single-{RUN}", 1) == []
        monkeypatch.setenv("REDUCER_LOCAL_RANK", "0")
        monkeypatch.setenv("REDUCER_LOCAL_SIZE", "2")
        monkeypatch.setenv("REDUCER_NODE_LOCAL", "0")
        with ReducerClient(d.addresses, job=f"nl-off-{RUN}", rank=0, world_size=2) as client:
            assert client.local_size == 2 and client._node is None


def test_local_settings_and_topology():
    assert local_settings_from_env({}) == {}
    assert local_settings_from_env({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}) == {
        "local_rank": 1, "local_size": 4}
    assert local_settings_from_env({"REDUCER_LOCAL_RANK": "0", "REDUCER_LOCAL_SIZE": "2",
                                    "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                    "REDUCER_NODE_RANK": "3", "REDUCER_NODE_LOCAL": "off"}
                                   ) == {"local_rank": 0, "local_size": 2, "node_rank": 3,
                                         "node_local": False}
    with pytest.raises(ValueError, match="REDUCER_NODE_LOCAL"):
        local_settings_from_env({"REDUCER_NODE_LOCAL": "maybe"})
    topo = node_topology(rank=5, world_size=8, local_rank=1, local_size=4)
    assert (topo.node, topo.nodes) == (1, 2)
    with pytest.raises(ValueError, match="multiple of local_size"):
        node_topology(rank=0, world_size=6, local_rank=0, local_size=4)
    with pytest.raises(ValueError, match="REDUCER_NODE_RANK"):
        node_topology(rank=1, world_size=4, local_rank=0, local_size=2)
    assert node_topology(1, 4, 0, 2, node_rank=1).node == 1
    for numel in (0, 1, 3, 1001):
        for parts in (1, 3, 4, 8):
            bounds = [slice_bounds(numel, parts, i) for i in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1
    # Small tensors: one local rank sends it all; big ones: every local rank a slice.
    assert [node_slice(1000, 2, 4, i) for i in range(4)] == [(0, 1000)] + [(1000, 1000)] * 3
    numel = 3 * MIN_SLICE_BYTES // 4 + 1
    assert [node_slice(numel, 4, 4, i)[1] - node_slice(numel, 4, 4, i)[0]
            for i in range(4)] == [numel // 3 + 1, numel // 3, numel // 3, 0]
