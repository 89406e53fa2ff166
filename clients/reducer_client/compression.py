"""Horovod's Compression for every shim: a choice of wire dtype per call.

    opt = rt.DistributedOptimizer(opt, compression=rt.Compression.fp16)
    t = rt.allreduce(t, compression=rt.Compression.none)

Horovod compresses a tensor in the framework (fp16: a cast before the
allreduce) and decompresses the result. Here the core converts every
contribution to a wire dtype anyway, so a Compressor only names that wire
dtype: the conversion happens once, in the core, with its rounding (nearest
even), the daemons add in float32, and the result comes back in the
tensor's own dtype. What each one means on the wire:

    Compression.none   float32   Horovod's default: no compression
    Compression.fp16   float16
    Compression.bf16   bfloat16
    Compression.int8   int8 with a float32 scale per 128 elements (reducerd's own)
    Compression.fp8_e4m3, Compression.fp8_e5m2   OCP FP8 (reducerd's own)

compression=None (the shims' default where Horovod's is Compression.none)
means the client's wire dtype (REDUCER_WIRE_DTYPE, float16 by default: half
Horovod's bytes, and different numerics; say Compression.none for Horovod's).

CompressedReducer is the Reducer a shim hands to its optimizers: the
process-wide client (looked up at each call, so a later init() counts) with
this wire dtype and Horovod's gradient_predivide_factor applied.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import numpy as np
from reducer_wire import dtypes

from reducer_client.api import Reducer

__all__ = ["Compressor", "Compression", "wire_dtype_of", "allreduce_async_on_wire",
           "CompressedReducer", "wire_scale"]


class Compressor:
    """A wire dtype for allreduce (None: the client's own).

    compress / decompress are Horovod's hooks; they leave the tensor as it
    is here, since the core converts to the wire dtype itself.
    """

    def __init__(self, name: str, wire_dtype: str | None) -> None:
        self.name, self.wire_dtype = name, wire_dtype

    def __repr__(self) -> str:
        return f"Compression.{self.name}"

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class Compression:
    """Horovod's Compression namespace (see the module docstring for the wires)."""

    none = Compressor("none", "float32")
    fp16 = Compressor("fp16", "float16")
    bf16 = Compressor("bf16", "bfloat16")
    int8 = Compressor("int8", "int8")
    fp8_e4m3 = Compressor("fp8_e4m3", "fp8_e4m3")
    fp8_e5m2 = Compressor("fp8_e5m2", "fp8_e5m2")


def wire_dtype_of(compression: Compressor | str | None) -> str | None:
    """The wire dtype a compression= argument names; None keeps the client's.

    Accepts a Compressor, a wire dtype name ("float16", ...) or None.
    """
    if compression is None:
        return None
    wire = compression.wire_dtype if isinstance(compression, Compressor) else compression
    if wire is None or (isinstance(wire, str) and wire in dtypes.WIRE_DTYPES):
        return wire
    raise TypeError(f"compression {compression!r}: use one of Compression.none, .fp16, "
                    f".bf16, .int8, .fp8_e4m3, .fp8_e5m2 or a wire dtype name "
                    f"({', '.join(dtypes.WIRE_DTYPES)}); custom Horovod compressors "
                    "are not supported (the core converts to the wire dtype itself)")


def allreduce_async_on_wire(reducer: Reducer, array: np.ndarray, key: str, op: str,
                            wire_dtype: str | None, out: np.ndarray | None = None,
                            priority: int = 0) -> Future[np.ndarray]:
    """reducer.allreduce_async on `wire_dtype` (None: the reducer's own).

    The keywords are passed only when they change something, so a Reducer
    without them still serves calls at its own wire dtype (and no priority).
    """
    extra: dict[str, Any] = {"priority": priority} if priority else {}
    if wire_dtype is not None and wire_dtype != reducer.wire_dtype:
        extra["wire_dtype"] = wire_dtype
    return reducer.allreduce_async(array, key, op, out=out, **extra)


def wire_scale(reducer: Reducer, op: str) -> float:
    """What `reducer` multiplies a contribution to `op` by before it goes on the
    wire (1/f for a CompressedReducer's gradient_predivide_factor f, else 1):
    error feedback must round what is sent (ErrorFeedback.apply's scale)."""
    return reducer.wire_scale(op) if isinstance(reducer, CompressedReducer) else 1.0


def _then(source: Future, finish: Callable[[Any], Any]) -> Future:
    """A future with finish(source's result), or source's error."""
    target: Future = Future()

    def done(f: Future) -> None:
        error = f.exception()
        if error is not None:
            target.set_exception(error)
            return
        try:
            target.set_result(finish(f.result()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            target.set_exception(exc)
    source.add_done_callback(done)
    return target


class CompressedReducer:
    """A Reducer that sends at `wire_dtype` and applies gradient_predivide_factor.

    base: a Reducer, or a function returning one (the shim's basics.client,
    called at each operation). predivide_factor f (Horovod's
    gradient_predivide_factor, for op "mean" only): each contribution is
    multiplied by 1/f before it is sent, the daemons sum, and the sum is
    multiplied by f / world_size: the same average, rounded to the wire at
    another scale (f = world_size sends averages, never overflowing
    float16). Everything else (rank, broadcast, ...) is the base's.
    """

    def __init__(self, base: Reducer | Callable[[], Reducer], wire_dtype: str | None = None,
                 predivide_factor: float = 1.0) -> None:
        if wire_dtype is not None and wire_dtype not in dtypes.WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire_dtype!r}: one of "
                             f"{', '.join(dtypes.WIRE_DTYPES)}")
        if not predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide_factor}")
        # A Reducer, or a function that returns one (looked up per call).
        if hasattr(base, "allreduce_async"):
            fixed = cast(Reducer, base)
            self._get: Callable[[], Reducer] = lambda: fixed
        else:
            self._get = cast(Callable[[], Reducer], base)
        self._wire = wire_dtype
        self.predivide_factor = float(predivide_factor)

    @property
    def base(self) -> Reducer:
        return self._get()

    @property
    def wire_dtype(self) -> str:
        return self._wire if self._wire is not None else self.base.wire_dtype

    def __getattr__(self, name: str) -> Any:
        # rank, world_size, local_rank, local_size, timeout, _node (for error
        # feedback's check) ... are the base's.
        if name.startswith("__") or name in ("_get", "_wire"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def wire_scale(self, op: str) -> float:
        """What a contribution to `op` is multiplied by before it is sent."""
        return 1.0 / self.predivide_factor if op == "mean" else 1.0

    def allreduce_async(self, array: np.ndarray, key: str, op: str = "sum", *,
                        out: np.ndarray | None = None, wire_dtype: str | None = None,
                        priority: int = 0) -> Future[np.ndarray]:
        base = self.base
        wire = wire_dtype if wire_dtype is not None else self._wire
        factor = self.predivide_factor
        if op != "mean" or factor == 1.0:
            return allreduce_async_on_wire(base, array, key, op, wire, out, priority)
        # Scale a copy unless the result goes into the input anyway (the
        # shims' staging buffers): the caller's array stays as it was.
        scaled = array if out is array else np.array(array, copy=True)
        np.multiply(scaled, 1.0 / factor, out=scaled, casting="unsafe")
        post = factor / base.world_size

        def rescale(result: np.ndarray) -> np.ndarray:
            np.multiply(result, post, out=result, casting="unsafe")
            return result
        return _then(allreduce_async_on_wire(base, scaled, key, "sum", wire, out, priority),
                     rescale)

    def allreduce(self, array: np.ndarray, key: str, op: str = "sum", *,
                  out: np.ndarray | None = None, wire_dtype: str | None = None,
                  priority: int = 0) -> np.ndarray:
        return self.allreduce_async(array, key, op, out=out, wire_dtype=wire_dtype,
                                    priority=priority).result()

    def broadcast_async(self, array: np.ndarray, key: str, root_rank: int = 0,
                        ) -> Future[np.ndarray]:
        return self.base.broadcast_async(array, key, root_rank)

    def broadcast(self, array: np.ndarray, key: str, root_rank: int = 0) -> np.ndarray:
        return self.base.broadcast(array, key, root_rank)

    def close(self) -> None:
        """Nothing of its own to close: the base belongs to whoever made it."""
