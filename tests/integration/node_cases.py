"""Worker functions for the node-local aggregation tests (spawned processes).

A "node" is simulated on one host by giving a group of workers its own local
ranks: with L workers per node, rank r is local rank r % L of node r // L
(node-major, as torchrun lays them out). Inputs come from core_cases, so each
worker checks its result against the float64 reference of all ranks itself.
"""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
from core_cases import check_allreduce, error_bound, make_input
from reducer_client import ReducerClient, ReducerError

# Small tensors go to fewer local ranks (node.topology.MIN_SLICE_BYTES), leaving the
# others an empty slice; 300_001 is cut into L uneven slices for L = 2, 3, 4.
SIZES = (1, 3, 1001, 300_001)


def _client(addresses, job, rank, world_size, local_size, wire_dtype, via_env,
            node_local=True, timeout=60.0) -> ReducerClient:
    if via_env:  # as a launcher would: the client reads REDUCER_LOCAL_RANK/SIZE itself
        os.environ["REDUCER_LOCAL_RANK"] = str(rank % local_size)
        os.environ["REDUCER_LOCAL_SIZE"] = str(local_size)
        return ReducerClient(addresses, job=job, rank=rank, world_size=world_size,
                             wire_dtype=wire_dtype, timeout=timeout, node_local=node_local)
    return ReducerClient(addresses, job=job, rank=rank, world_size=world_size,
                         wire_dtype=wire_dtype, timeout=timeout, node_local=node_local,
                         local_rank=rank % local_size, local_size=local_size)


def matrix_worker(rank: int, world_size: int, addresses: list[str], local_size: int,
                  tag: str, via_env: bool) -> dict:
    """SUM and MEAN, float16 and float32 wire, node-local and flat; plus broadcast,
    float16/float64 inputs, keys in flight in a different order per rank, and a
    size mismatch between local ranks followed by a good round."""
    results: dict = {"cases": [], "async": [], "local_size": None}
    for wire_dtype in ("float16", "float32"):
        for mode in ("node", "flat"):
            job = f"{tag}-{mode}-{wire_dtype}"
            with _client(addresses, job, rank, world_size, local_size, wire_dtype, via_env,
                         node_local=mode == "node") as client:
                results["local_size"] = client.local_size
                case = 0
                for op in ("sum", "mean"):
                    for numel in SIZES:
                        r = check_allreduce(client, 99, case, numel, op)
                        results["cases"].append(r | {"mode": mode, "wire": wire_dtype,
                                                     "op": op, "numel": numel})
                        case += 1
                for dtype in (np.float16, np.float64):
                    r = check_allreduce(client, 99, case, 1001, "mean", np.dtype(dtype))
                    results["cases"].append(r | {"mode": mode, "wire": wire_dtype,
                                                 "op": "mean", "dtype": np.dtype(dtype).name})
                    case += 1
                if mode == "node" and wire_dtype == "float16":
                    results["async"] = _async_keys(client)
                    results["broadcast"] = _broadcast(client)
                    results["mismatch"] = _mismatch(client)
    return results


def _async_keys(client: ReducerClient) -> list[float]:
    """Eight keys in flight at once, issued in a different order on every rank."""
    sizes = [1, 100, 4097, 65_536, 7, 250_000, 33, 1000]
    order = list(range(len(sizes)))
    random.Random(client.rank).shuffle(order)
    futures = {i: client.allreduce_async(make_input(5, client.rank, i, sizes[i]),
                                         key=f"async/{i}", op="sum") for i in order}
    ratios = []
    for i, future in futures.items():
        inputs = [make_input(5, r, i, sizes[i]) for r in range(client.world_size)]
        reference = sum(x.astype(np.float64) for x in inputs)
        bound = error_bound(inputs, reference, client.wire_dtype, "sum")
        ratios.append(float(np.max(np.abs(future.result() - reference) / bound)))
    return ratios


def _broadcast(client: ReducerClient) -> dict:
    """From the last rank (local rank L-1 of the last node): exact despite a float16 wire."""
    root = client.world_size - 1
    values = {d: make_input(8, client.rank, 0, 10_001, d) for d in (np.float32, np.float16)}
    got = {d: client.broadcast(v, key=f"bcast/{np.dtype(d).name}", root_rank=root)
           for d, v in values.items()}
    return {np.dtype(d).name: bool(np.array_equal(got[d], make_input(8, root, 0, 10_001, d)))
            for d in values}


def _mismatch(client: ReducerClient) -> dict:
    """Local rank 1 gives one more element: every local rank fails; then all goes on."""
    x = np.ones(100 + (client.local_rank == 1), dtype=np.float32)
    try:
        client.allreduce(x, key="mismatch")
        error = None
    except ReducerError as exc:
        error = (exc.code.name, str(exc))
    good = client.allreduce(np.full(10, client.rank + 1.0, dtype=np.float32), key="good")
    return {"error": error, "good": good.tolist()}


def _fork_lingering_child(pid_file: str) -> None:
    """A forked child (a DataLoader worker, say) that outlives its parent by 2 s.

    It inherits the parent's sockets; unless the client closes them in the
    child, the parent's death would go unnoticed until the child exits.
    """
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        while os.getppid() == parent:
            time.sleep(0.05)
        time.sleep(2)
        os._exit(0)
    with open(pid_file, "w") as f:
        f.write(str(pid))


def kill_worker(rank: int, world_size: int, addresses: list[str], job: str,
                victim: int, pid_file: str) -> dict:
    """One node of `world_size` workers; `victim` dies (SIGKILL) in the middle of step 1,
    leaving a forked child behind.

    Before that, step 0 checks MEAN over a non-power-of-two L (uneven slices).
    """
    client = ReducerClient(addresses, job=job, rank=rank, world_size=world_size,
                           wire_dtype="float16", timeout=30, local_rank=rank,
                           local_size=world_size)
    step0 = check_allreduce(client, 3, 0, 300_001, "mean")["ratio"]
    x = np.ones(1 << 20, dtype=np.float32)
    if rank == victim:
        _fork_lingering_child(pid_file)
        client.allreduce_async(x, key="step1")  # input written, slice not yet reduced
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        client.allreduce(x, key="step1")
        error = None
    except ReducerError as exc:
        error = (exc.code.name, str(exc))
    elapsed = time.monotonic() - start
    try:
        client.allreduce(x, key="step2")
        later = None
    except ReducerError as exc:
        later = exc.code.name
    client.close()
    return {"step0": step0, "error": error, "elapsed": elapsed, "later": later}


def straggler_worker(rank: int, world_size: int, addresses: list[str], job: str) -> dict:
    """Local rank 1 never reaches key "a": local rank 0 is told so within the timeout."""
    with ReducerClient(addresses, job=job, rank=rank, world_size=world_size, timeout=2,
                       local_rank=rank, local_size=world_size) as client:
        if rank == 1:
            time.sleep(3)
            return {}
        start = time.monotonic()
        try:
            client.allreduce(np.ones(10, dtype=np.float32), key="a")
            return {"error": None}
        except ReducerError as exc:
            return {"error": (exc.code.name, str(exc)), "elapsed": time.monotonic() - start}
