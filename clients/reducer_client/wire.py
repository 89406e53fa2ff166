"""Wire dtypes and their conversion to and from float32, with NumPy only.

NumPy has no bfloat16, so bfloat16 travels as uint16 bit patterns: the upper
half of a float32. Widening is exact (shift left by 16); narrowing rounds to
nearest, ties to even, and keeps NaN a NaN. float16 uses NumPy's own casts,
which also round to nearest even.
"""

from __future__ import annotations

import numpy as np

from reducer_client._proto.reducer.v1 import reducer_pb2 as pb

__all__ = [
    "WIRE_DTYPES",
    "WIRE_OPS",
    "wire_itemsize",
    "wire_numpy_dtype",
    "to_wire",
    "from_wire",
    "add_wire_into",
    "copy_wire_into",
    "bfloat16_bits_from_float32",
]

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


def bfloat16_bits_from_float32(values: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16, nearest-even; returns the uint16 bits.

    NaN stays a quiet NaN (a plain rounding add could carry a NaN's low
    mantissa bits into the exponent and make it infinity); overflow rounds to
    +-inf like any IEEE narrowing.
    """
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    bits = f32.view(np.uint32).astype(np.uint32)  # a copy we may modify
    lsb = (bits >> 16) & 1
    bits += np.uint32(0x7FFF)
    bits += lsb
    bits >>= 16
    out = bits.astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = (f32.view(np.uint32)[nan] >> 16).astype(np.uint16) | np.uint16(0x0040)
    return out


def to_wire(values: np.ndarray, dtype: int) -> np.ndarray:
    """Convert a flat float array to its wire representation (a new array)."""
    if dtype == pb.DTYPE_BFLOAT16:
        return bfloat16_bits_from_float32(values)
    return np.asarray(values, dtype=wire_numpy_dtype(dtype)).copy()


def from_wire(data: bytes | memoryview | np.ndarray, dtype: int, out: np.ndarray) -> None:
    """Write wire elements into `out` (any float dtype), converting exactly.

    bfloat16 and float16 both widen exactly to float32 and so to float64.
    """
    raw = np.frombuffer(data, dtype=wire_numpy_dtype(dtype)) if not isinstance(
        data, np.ndarray) else data
    if dtype == pb.DTYPE_BFLOAT16:
        if out.dtype == np.float32:
            # Widen in place through the output's own bits: no temporary.
            bits = out.view(np.uint32)
            np.copyto(bits, raw, casting="unsafe")
            bits <<= 16
        else:
            widened = raw.astype(np.uint32) << 16
            np.copyto(out, widened.view(np.float32), casting="unsafe")
    else:
        np.copyto(out, raw, casting="unsafe")


def copy_wire_into(acc: np.ndarray, data: bytes | memoryview, dtype: int) -> None:
    """Set the float32 accumulator to one contribution (the first of a chunk)."""
    from_wire(data, dtype, acc)


def add_wire_into(acc: np.ndarray, data: bytes | memoryview, dtype: int,
                  scratch: np.ndarray | None = None) -> None:
    """Add one contribution to the float32 accumulator, in place.

    float16 and float32 add straight from the wire buffer (NumPy's ufunc
    buffering widens float16 in small blocks, no full-size temporary).
    bfloat16 is widened into `scratch` (a reusable float32 buffer of at least
    acc.size elements) when given, else into a temporary.
    """
    raw = np.frombuffer(data, dtype=wire_numpy_dtype(dtype))
    if dtype == pb.DTYPE_BFLOAT16:
        tmp = scratch[: acc.size] if scratch is not None else np.empty_like(acc)
        from_wire(raw, dtype, tmp)
        np.add(acc, tmp, out=acc)
    else:
        np.add(acc, raw, out=acc, casting="unsafe")
