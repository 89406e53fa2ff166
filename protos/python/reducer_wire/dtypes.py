"""Wire dtypes and reduce ops: the names users give, the enum values on the wire.

Elements travel little-endian (contract section 2). NumPy has no bfloat16, so
bfloat16 is held as its uint16 bit patterns: the upper half of a float32.

The 8-bit wires (reducer_wire.quant, docs/explanation/numerics.md) are held as bytes
(uint8). FP8 is one byte per element; int8 is not a whole number of bytes per
element (a float32 scale per block of wire_block elements rides along), so
every size is computed with wire_nbytes / wire_numel, never an item size, and
chunks are cut at whole blocks.

The integer wires carry integer tensors exactly: a tensor travels as its own
dtype (never chosen by name, so "int8" above stays the 8-bit float wire), the
daemon sums in int64 and narrows the sum to that width, wrapping around on
overflow as the dtype's own addition does. They take op "sum" only.
"""

from __future__ import annotations

import numpy as np

from reducer_wire import quant
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

__all__ = ["WIRE_DTYPES", "EIGHT_BIT_DTYPES", "WIRE_OPS", "DTYPE_NAMES", "OP_NAMES",
           "QUANTIZED_DTYPES", "INTEGER_WIRES", "integer_wire", "wire_itemsize",
           "wire_numpy_dtype", "wire_block", "wire_nbytes", "wire_numel", "op_value"]

# Name used in the client API -> protobuf enum value.
# The 8-bit wires (reducer_wire.quant).
EIGHT_BIT_DTYPES: dict[str, int] = {
    "int8": pb.DTYPE_INT8_BLOCK128,
    "fp8_e4m3": pb.DTYPE_FP8_E4M3,
    "fp8_e5m2": pb.DTYPE_FP8_E5M2,
}
WIRE_DTYPES: dict[str, int] = {
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "float32": pb.DTYPE_FLOAT32,
    **EIGHT_BIT_DTYPES,
}
# Their enum values: lossy beyond float16's rounding (quant.ERROR_BOUND_DOC).
QUANTIZED_DTYPES: frozenset[int] = frozenset(EIGHT_BIT_DTYPES.values())
WIRE_OPS: dict[str, int] = {"sum": pb.REDUCE_OP_SUM, "mean": pb.REDUCE_OP_MEAN}

# NumPy integer dtype -> its integer wire (the tensor's own width).
_INTEGER_WIRE: dict[np.dtype, int] = {
    np.dtype(np.uint8): pb.DTYPE_UINT8,
    np.dtype(np.int8): pb.DTYPE_INT8,
    np.dtype(np.int16): pb.DTYPE_INT16,
    np.dtype(np.int32): pb.DTYPE_INT32,
    np.dtype(np.int64): pb.DTYPE_INT64,
}
INTEGER_WIRES: frozenset[int] = frozenset(_INTEGER_WIRE.values())

# Storage dtype of each wire dtype, little-endian as the contract says.
_STORAGE: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT8_BLOCK128: np.dtype(np.uint8),
    pb.DTYPE_FP8_E4M3: np.dtype(np.uint8),
    pb.DTYPE_FP8_E5M2: np.dtype(np.uint8),
    **{wire: dtype.newbyteorder("<") for dtype, wire in _INTEGER_WIRE.items()},
}
_BLOCK: dict[int, int] = {pb.DTYPE_INT8_BLOCK128: quant.INT8_BLOCK}


def wire_numpy_dtype(dtype: int) -> np.dtype:
    """NumPy dtype that holds the wire bytes of `dtype` (uint16 for bfloat16,
    uint8 for the 8-bit wires: for int8 a byte, not an element)."""
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise ValueError(f"unknown wire dtype {dtype}") from None


def integer_wire(dtype: np.dtype) -> int | None:
    """The integer wire that carries arrays of NumPy `dtype` exactly; None for
    a dtype without one (floats, bool, unsigned wider than a byte)."""
    return _INTEGER_WIRE.get(np.dtype(dtype))


def wire_itemsize(dtype: int) -> int:
    """Bytes per element; ValueError for int8, whose size is wire_nbytes's."""
    if dtype in _BLOCK:
        raise ValueError(f"wire dtype {DTYPE_NAMES[dtype]} has no item size (a scale per "
                         f"{_BLOCK[dtype]} elements): use wire_nbytes / wire_numel")
    return wire_numpy_dtype(dtype).itemsize


def wire_block(dtype: int) -> int:
    """Elements per block: chunks hold whole blocks (except a key's last); 1 for
    the dtypes without a scale."""
    wire_numpy_dtype(dtype)  # ValueError for an unknown dtype
    return _BLOCK.get(dtype, 1)


def wire_nbytes(dtype: int, numel: int) -> int:
    """Bytes that `numel` elements of `dtype` take on the wire, scales included."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if dtype == pb.DTYPE_INT8_BLOCK128:
        return quant.int8_nbytes(numel, quant.INT8_BLOCK)
    return numel * wire_numpy_dtype(dtype).itemsize


def wire_numel(dtype: int, nbytes: int) -> int | None:
    """Elements held by `nbytes` wire bytes of `dtype`; None when no element
    count takes exactly that many bytes (a malformed shard)."""
    if nbytes < 0:
        return None
    if dtype == pb.DTYPE_INT8_BLOCK128:
        return quant.int8_numel(nbytes, quant.INT8_BLOCK)
    numel, rest = divmod(nbytes, wire_numpy_dtype(dtype).itemsize)
    return None if rest else numel


DTYPE_NAMES: dict[int, str] = {
    **{value: name for name, value in WIRE_DTYPES.items()},
    **{wire: f"integer {dtype}" for dtype, wire in _INTEGER_WIRE.items()}}
OP_NAMES: dict[int, str] = {pb.REDUCE_OP_UNSPECIFIED: "sum", pb.REDUCE_OP_SUM: "sum",
                            pb.REDUCE_OP_MEAN: "mean"}


def op_value(op: str) -> int:
    """The wire enum of a reduce op name; ValueError naming the choices otherwise."""
    try:
        return WIRE_OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op {op!r}: one of {', '.join(WIRE_OPS)}") from None
