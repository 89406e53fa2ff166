"""Wire dtypes and reduce ops: the names users give, the enum values on the wire.

Elements travel little-endian (contract section 2). NumPy has no bfloat16, so
bfloat16 is held as its uint16 bit patterns: the upper half of a float32.
"""

from __future__ import annotations

import numpy as np

from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

__all__ = ["WIRE_DTYPES", "WIRE_OPS", "DTYPE_NAMES", "OP_NAMES", "wire_itemsize",
           "wire_numpy_dtype", "op_value"]

# Name used in the client API -> protobuf enum value.
WIRE_DTYPES: dict[str, int] = {
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "float32": pb.DTYPE_FLOAT32,
}
WIRE_OPS: dict[str, int] = {"sum": pb.REDUCE_OP_SUM, "mean": pb.REDUCE_OP_MEAN}

# Storage dtype of each wire dtype, little-endian as the contract says.
_STORAGE: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
}


def wire_numpy_dtype(dtype: int) -> np.dtype:
    """NumPy dtype that holds the wire bytes of `dtype` (uint16 for bfloat16)."""
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise ValueError(f"unknown wire dtype {dtype}") from None


def wire_itemsize(dtype: int) -> int:
    return wire_numpy_dtype(dtype).itemsize

DTYPE_NAMES: dict[int, str] = {value: name for name, value in WIRE_DTYPES.items()}
OP_NAMES: dict[int, str] = {pb.REDUCE_OP_UNSPECIFIED: "sum", pb.REDUCE_OP_SUM: "sum",
                            pb.REDUCE_OP_MEAN: "mean"}


def op_value(op: str) -> int:
    """The wire enum of a reduce op name; ValueError naming the choices otherwise."""
    try:
        return WIRE_OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op {op!r}: one of {', '.join(WIRE_OPS)}") from None
