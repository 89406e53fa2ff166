"""Any NumPy array as float32 values that survive a sum with zeros bit for bit.

Broadcast and allgather go through summing daemons: the ranks that do not
own a value send zeros, and x + 0 is x in float32. float32 travels as it is
and float16 widens exactly; every other dtype travels as its bytes, cut into
16-bit limbs (8-bit for one-byte dtypes), each an exact float32 integer.
Cost per element: 4 bytes (float16, float32, one-byte dtypes), 2 per 16 bits
otherwise (8 bytes for float64 and int64).
"""

from __future__ import annotations

import numpy as np

__all__ = ["encode_exact", "decode_exact", "encoded_per_element"]

_AS_IS = (np.dtype(np.float32), np.dtype(np.float16))


def encoded_per_element(dtype: np.dtype) -> int:
    """float32 values per element of `dtype` in encode_exact's output."""
    dtype = np.dtype(dtype)
    if dtype in _AS_IS or dtype.itemsize == 1:
        return 1
    if dtype.itemsize % 2:
        raise TypeError(f"dtype {dtype} cannot be sent exactly")
    return dtype.itemsize // 2


def encode_exact(array: np.ndarray) -> np.ndarray:
    """A 1-D float32 array holding `array` exactly (decode_exact undoes it)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype in _AS_IS:
        return flat.astype(np.float32)
    if flat.dtype.itemsize == 1:
        return flat.view(np.uint8).astype(np.float32)
    encoded_per_element(flat.dtype)  # TypeError for odd item sizes
    return flat.view("<u2").astype(np.float32)


def decode_exact(values: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The array of `dtype` and `shape` that encode_exact turned into `values`."""
    dtype = np.dtype(dtype)
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    if dtype in _AS_IS:
        return values.astype(dtype).reshape(shape)
    if dtype.itemsize == 1:
        return values.astype(np.uint8).view(dtype).reshape(shape)
    return values.astype("<u2").view(dtype).reshape(shape)
