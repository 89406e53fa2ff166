"""The seam between the core and the framework shims.

A shim (reducer_client.torch, .tensorflow, .mxnet) needs only this: a rank,
a world size, and asynchronous allreduce / broadcast of flat NumPy arrays.
ReducerClient implements it over gRPC; reducer_client.testing.LocalGroup
implements it in-process, so shim tests can run without daemons.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["Reducer"]


@runtime_checkable
class Reducer(Protocol):
    """What a framework shim may call.

    Contract for implementations:
    - Calls for one key must be made in the same order on every rank; each
      call is one round of that key.
    - Inputs are float16, float32 or float64 arrays of any shape; the result
      has the input's dtype and shape and is a new array. The input is copied
      before the call returns, so the caller may reuse it at once.
    - op is "sum" or "mean" (mean divides by world_size).
    - broadcast returns root_rank's values exactly for float32 data.
    - Failures surface as reducer_client.ReducerError (from the future's
      result() for the async forms); nothing waits longer than `timeout`.
    - rank and world_size count workers, never nodes: ReducerClient may
      reduce within a host first (node-local aggregation, on by default when
      several workers share one), which changes what the daemons see but not
      results, op semantics or call order. A shim only passes the launcher's
      local rank and size through (ReducerClient(local_rank=, local_size=) or
      REDUCER_LOCAL_RANK / REDUCER_LOCAL_SIZE; torchrun's are read already).
    """

    rank: int
    world_size: int
    timeout: float

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum",
                        ) -> Future[np.ndarray]: ...

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum") -> np.ndarray: ...

    def broadcast_async(self, array: np.ndarray, key: str, root_rank: int = 0,
                        ) -> Future[np.ndarray]: ...

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray: ...

    def close(self) -> None: ...
