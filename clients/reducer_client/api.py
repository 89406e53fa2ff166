"""The seam between the core and the framework shims.

A shim (reducer_client.torch, .tensorflow, .mxnet) needs only this: a rank,
a world size, the worker's place on its host, and asynchronous allreduce /
broadcast of flat NumPy arrays. ReducerClient implements it over the
daemons; reducer_client.testing.LocalGroup implements it in-process, with
the same numerics, so shim tests can run without daemons.
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
      call is one round of that key. Rounds of one key may differ in length
      (a key may carry a different tensor each round), so a shim can give
      all its unnamed calls of one kind a single key and let the round
      counter order them: the number of keys stays fixed however long the
      run.
    - Inputs are float16, float32 or float64 arrays of any shape; the result
      has the input's dtype and shape. The input is converted to the wire
      dtype before the call returns, so the caller may reuse it at once.
    - out: None (the result is a new array), or a writable C-contiguous
      array of the input's shape and dtype, which may be the input itself:
      the result is written there and the future's result is `out`, so a
      shim that reduces into its own buffer allocates nothing per call. Its
      contents are unspecified while the call runs and after a failure.
    - wire_dtype (a name of reducer_wire.dtypes.WIRE_DTYPES: "float16",
      "bfloat16", "float32", or an 8-bit wire "int8", "fp8_e4m3",
      "fp8_e5m2"): what allreduce values travel as. Each contribution is
      rounded to it once (float16 and bfloat16: nearest even), the daemons
      add the contributions in float32, "mean" divides the float32 sum by
      world_size, and the result is rounded to the wire dtype once more,
      then widened exactly to the output's dtype. allreduce's wire_dtype=
      keyword overrides it for one call (every rank gives the same for a
      key's round): what the shims' compression= chooses. A Reducer
      without that keyword still serves the shims at its own wire dtype.
    - op is "sum" or "mean".
    - broadcast returns root_rank's values exactly for float16, bfloat16-
      representable and float32 data (it travels as float32, whatever
      wire_dtype says; float64 input is rounded to float32).
    - Failures surface as reducer_client.ReducerError (from the future's
      result() for the async forms); nothing waits longer than `timeout`
      seconds.
    - rank and world_size count workers, never nodes: ReducerClient may
      reduce within a host first (node-local aggregation, on by default when
      several workers share one), which changes what the daemons see but not
      results, op semantics or call order. local_rank and local_size are the
      worker's place on its host (the launcher's, passed through
      ReducerClient(local_rank=, local_size=) or REDUCER_LOCAL_RANK /
      REDUCER_LOCAL_SIZE; torchrun's are read already); 0 and 1 when unknown.
    """

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    timeout: float
    wire_dtype: str

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum", *,
                        out: np.ndarray | None = None, wire_dtype: str | None = None,
                        priority: int = 0) -> Future[np.ndarray]: ...

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum", *,
                  out: np.ndarray | None = None, wire_dtype: str | None = None,
                  priority: int = 0) -> np.ndarray: ...

    def broadcast_async(self, array: np.ndarray, key: str, root_rank: int = 0,
                        ) -> Future[np.ndarray]: ...

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray: ...

    def close(self) -> None: ...
