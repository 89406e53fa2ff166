"""An in-process Reducer for fast shim tests: N ranks as threads, no daemon.

    group = LocalGroup(world_size=2)
    clients = [group.client(rank) for rank in range(2)]   # hand one to each thread

Sums in float64 and rounds once to the input dtype, so it is exact where
the real daemon is exact and close elsewhere; tests of numerics against the
wire dtypes belong with the real daemons.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future

import grpc
import numpy as np

from reducer_client.errors import ReducerError

__all__ = ["LocalGroup", "LocalClient"]


class LocalGroup:
    """Shared state of the fake ranks."""

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        # _lock guards _slots: (key, round) -> contributions and waiting futures.
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], dict] = {}

    def client(self, rank: int) -> LocalClient:
        return LocalClient(self, rank)

    def _contribute(self, key: str, round_: int, rank: int, array: np.ndarray, op: str,
                    future: Future) -> None:
        with self._lock:
            slot = self._slots.setdefault((key, round_), {"parts": {}, "futures": []})
            if slot["parts"] and next(iter(slot["parts"].values()))[0].shape != array.shape:
                error = ReducerError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"key {key!r} round {round_}: rank {rank} sent shape "
                                     f"{array.shape}, others differ")
                future.set_exception(error)
                return
            slot["parts"][rank] = (array, op)
            slot["futures"].append((future, array.dtype, array.shape))
            if len(slot["parts"]) < self.world_size:
                return
            del self._slots[(key, round_)]
        parts = [p.astype(np.float64) for p, _ in slot["parts"].values()]
        total = functools.reduce(np.add, parts)  # no 0 start: keeps -0.0
        if op == "mean":
            total = total / self.world_size
        for fut, dtype, shape in slot["futures"]:
            fut.set_result(np.asarray(total, dtype=dtype).reshape(shape))


def _expire(future: Future, key: str, round_: int, rank: int, timeout: float) -> None:
    try:
        future.set_exception(ReducerError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"key {key!r} round {round_}: no result within {timeout:g} s (rank {rank})"))
    except Exception:  # completed meanwhile (InvalidStateError)
        pass


class LocalClient:
    """One fake rank; implements reducer_client.api.Reducer."""

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self.timeout = group.timeout
        self.wire_dtype = "float32"  # LocalGroup sums in float64, rounds once
        self._rounds: dict[str, int] = {}

    def _next_round(self, key: str) -> int:
        round_ = self._rounds.get(key, 0)
        self._rounds[key] = round_ + 1
        return round_

    def allreduce_async(self, array, key, op="sum") -> Future:
        future: Future = Future()
        array = np.array(array, copy=True)
        round_ = self._next_round(key)
        self.group._contribute(key, round_, self.rank, array, op, future)
        if not future.done():  # as the real client: nothing waits past the timeout
            timer = threading.Timer(self.timeout, _expire, (future, key, round_, self.rank,
                                                            self.timeout))
            timer.daemon = True
            timer.start()
            future.add_done_callback(lambda _: timer.cancel())
        return future

    def allreduce(self, array, key, op="sum"):
        return self.allreduce_async(array, key, op).result(self.timeout)

    def broadcast_async(self, array, key, root_rank=0) -> Future:
        array = np.asarray(array)
        data = array if self.rank == root_rank else np.full_like(array, -0.0)
        return self.allreduce_async(data, key, "sum")

    def broadcast(self, array, key, root_rank=0):
        return self.broadcast_async(array, key, root_rank).result(self.timeout)

    def close(self) -> None:
        pass
