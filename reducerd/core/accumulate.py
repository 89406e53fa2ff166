"""Summing contributions into a chunk's accumulator.

Numerics: the accumulator is float32 for every floating-point wire; float16,
bfloat16 and the 8-bit wires (reducer_wire.quant) widen exactly, so the only
rounding is float32 addition's (and the one narrowing of the result,
reducer_wire.convert.to_wire). The integer wires (reducer_wire.dtypes) sum
exactly into an int64 accumulator; narrowing the sum to the wire's width
wraps around, as the dtype's own addition does (and int64 itself wraps as
NumPy's int64 addition does).
"""

from __future__ import annotations

import numpy as np
from reducer_wire import convert, quant
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.convert import from_wire
from reducer_wire.dtypes import INTEGER_WIRES, QUANTIZED_DTYPES, wire_numpy_dtype

__all__ = ["copy_wire_into", "add_wire_into", "WideningBuffer", "new_accumulator",
           "accumulator_nbytes"]


def accumulator_dtype(dtype: int) -> np.dtype:
    """int64 for the integer wires, float32 for every other."""
    return np.dtype(np.int64) if dtype in INTEGER_WIRES else np.dtype(np.float32)


def accumulator_nbytes(dtype: int, numel: int) -> int:
    """Bytes of a chunk's accumulator of `numel` elements of wire `dtype`."""
    return numel * accumulator_dtype(dtype).itemsize


def new_accumulator(dtype: int, numel: int) -> np.ndarray:
    """An uninitialised accumulator for a chunk of wire `dtype` (copy_wire_into sets it)."""
    return np.empty(numel, dtype=accumulator_dtype(dtype))


class WideningBuffer:
    """One reusable float32 buffer for NumPy's widening of float16 and bfloat16
    contributions (the C kernels widen as they add and need none)."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.float32)

    def for_part(self, dtype: int, numel: int) -> np.ndarray | None:
        """A buffer of at least `numel` float32 elements, or None for float32
        and integer data (added straight from the wire buffer)."""
        if dtype == pb.DTYPE_FLOAT32 or dtype in INTEGER_WIRES:
            return None
        if self._buffer.size < numel:
            self._buffer = np.empty(numel, dtype=np.float32)
        return self._buffer


def copy_wire_into(acc: np.ndarray, data: bytes | memoryview, dtype: int) -> None:
    """Set the accumulator to one contribution (the first of a chunk)."""
    from_wire(data, dtype, acc)


def add_wire_into(acc: np.ndarray, data: bytes | memoryview, dtype: int,
                  scratch: np.ndarray | None = None) -> None:
    """Add one contribution to the accumulator, in place.

    An integer wire adds into the int64 accumulator exactly.
    float32 adds straight from the wire buffer. float16 and bfloat16 are
    widened into `scratch` (a reusable float32 buffer of at least acc.size
    elements) when given, else into a temporary, then added.
    """
    if dtype in QUANTIZED_DTYPES:  # decoded exactly and added, no temporary in C
        quant.add(acc, data, dtype, convert.accelerated())
        return
    raw = np.frombuffer(data, dtype=wire_numpy_dtype(dtype))
    if dtype in INTEGER_WIRES:
        np.add(acc, raw, out=acc)
        return
    fast = convert.kernels()
    if (fast is not None and dtype != pb.DTYPE_FLOAT32 and acc.dtype == np.float32
            and acc.flags.c_contiguous and acc.flags.aligned):
        if dtype == pb.DTYPE_BFLOAT16:
            fast.bf16_add(acc, raw)
        else:
            fast.f16_add(acc, raw)
        return
    if dtype != pb.DTYPE_FLOAT32:
        tmp = scratch[: acc.size] if scratch is not None else np.empty_like(acc)
        from_wire(raw, dtype, tmp)
        np.add(acc, tmp, out=acc)
    else:
        np.add(acc, raw, out=acc, casting="unsafe")
