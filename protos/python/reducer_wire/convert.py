"""Conversion of wire dtypes to and from float32 (and float64, float16 arrays).

Integer wires copy as they are (reducer_wire.dtypes: the integer wires).

The conversions run in C (reducer_wire._kernels: AVX-512 or F16C instructions
where the CPU has them, no GIL) when the extension was built, which setup.py does
wherever a C compiler is at hand; else in NumPy, as described below. Both
give the same bits (NaN payloads aside, which stay NaN): which end has the
extension never changes a result. use_accelerator(False) selects the NumPy code
(the client's REDUCER_WIRE_NUMPY=1, the daemon's REDUCER_WIRE_NUMPY=1 do that).

NumPy has no bfloat16, so bfloat16 travels as uint16 bit patterns: the upper
half of a float32. Widening is exact (shift left by 16); narrowing rounds to
nearest, ties to even, and keeps NaN a NaN.

float16 between float32 arrays is converted here with whole-array integer and
float32 operations too: NumPy's own float16 casts run a scalar loop, 3x
slower to widen and 1.7x slower to narrow (512 Ki elements: 0.9 ms and 1.3 ms
against 0.3 ms and 0.75 ms on this project's machines). Both give NumPy's
results bit for bit (tests/unit/test_wire.py checks every float16 value and
millions of float32 patterns), rounding to nearest, ties to even.

A thread's floating-point mode: the C kernels clear flush-to-zero and
denormals-are-zero while they run (TensorFlow's graph threads set both), and
the NumPy float16, bfloat16 and FP8 code forms no float32 denormal, so every
path gives the same bits in such a thread (tests/tf_shim/test_tf_fpmode.py).
The one exception is int8's NumPy fallback: a block whose largest value is
itself a float32 denormal (below 2^-126) is scaled in float32 arithmetic,
which such a thread flushes to zero.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from reducer_wire import quant
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb
from reducer_wire.dtypes import INTEGER_WIRES, QUANTIZED_DTYPES, wire_nbytes, wire_numpy_dtype

__all__ = [
    "to_wire",
    "from_wire",
    "bfloat16_bits_from_float32",
    "float16_bits_to_float32",
    "float32_to_float16_bits",
    "accelerated",
    "use_accelerator",
    "kernels",
]

try:
    import reducer_wire._kernels as _built
except ImportError:  # built without a C compiler: NumPy does it all
    _built = None  # type: ignore[assignment]
# The kernels in use: the C extension unless a side's settings (the daemon's
# Config, the client's REDUCER_WIRE_NUMPY) chose NumPy. Nothing is read at import.
_fast: ModuleType | None = _built


def accelerated() -> bool:
    """Whether the conversions run in C (reducer_wire._kernels)."""
    return _fast is not None


def use_accelerator(on: bool) -> bool:
    """Use the C conversions (if built) or NumPy's; returns the previous choice."""
    global _fast
    previous = _fast is not None
    _fast = _built if on else None
    return previous


def kernels() -> ModuleType | None:
    """The C kernels module in use, or None when NumPy does the work."""
    return _fast


_F16_REBIAS = np.uint32(112 << 23)  # f32 exponent bias 127 - f16 bias 15
_F16_SUBNORMAL_STEP = np.float32(2.0 ** -24)  # the value of a float16 subnormal's unit
_DENORM_MAGIC_BITS = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)
_DENORM_MAGIC = np.array(_DENORM_MAGIC_BITS, dtype=np.uint32).view(np.float32)[()]


def _float16_bits_to_float32(bits: np.ndarray, out: np.ndarray) -> None:
    """Widen float16 bit patterns (uint16) into float32 `out`, exactly.

    Integer arithmetic for the normal numbers: shift the 15 exponent+mantissa
    bits into float32 position and add the bias difference (112) to the
    exponent, twice for inf/NaN (exponent 31 -> 255). A subnormal's value is
    its mantissa times 2^-24, a product of two normal float32s: no float32
    denormal is ever formed, so the bits are the same under a thread's
    flush-to-zero / denormals-are-zero mode (TensorFlow's graph threads), as
    the C kernels' are (_fpmode.h).
    """
    u = out.view(np.uint32)
    np.copyto(u, bits, casting="unsafe")
    sign = u & np.uint32(0x8000)
    u &= np.uint32(0x7FFF)
    u <<= np.uint32(13)
    small = u < np.uint32(1 << 23)  # exponent 0: subnormal or zero
    subnormals = u[small] if small.any() else None
    special = u >= np.uint32(31 << 23)  # exponent 31: inf or NaN
    u += _F16_REBIAS
    if special.any():
        u[special] += _F16_REBIAS
    if subnormals is not None:
        subnormals >>= np.uint32(13)
        out[small] = subnormals.astype(np.float32) * _F16_SUBNORMAL_STEP
    sign <<= np.uint32(16)
    u |= sign


def _float32_to_float16_bits(values: np.ndarray, out: np.ndarray) -> None:
    """Round float32 to float16 (nearest, ties to even) into uint16 `out`."""
    bits = values.view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    odd = magnitude >> np.uint32(13)
    odd &= np.uint32(1)
    rounded = magnitude + np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)
    rounded += odd
    rounded >>= np.uint32(13)
    np.copyto(out, rounded, casting="unsafe")
    small = magnitude < np.uint32(113 << 23)  # float16 subnormal or zero
    if small.any():
        # Adding a magic float aligns the 10 mantissa bits at the bottom; the
        # float32 addition itself rounds to nearest even.
        with np.errstate(all="ignore"):  # NaN bit patterns among the rest
            tiny = magnitude.view(np.float32) + _DENORM_MAGIC
        tiny_bits = tiny.view(np.uint32)
        tiny_bits -= _DENORM_MAGIC_BITS
        np.copyto(out, tiny_bits, casting="unsafe", where=small)
    large = magnitude >= np.uint32((127 + 16) << 23)  # overflow, inf, NaN
    if large.any():
        nan = magnitude > np.uint32(0x7F800000)
        np.copyto(out, np.uint16(0x7C00), where=large)
        np.copyto(out, np.uint16(0x7E00), where=nan)
    sign = bits >> np.uint32(16)
    sign &= np.uint32(0x8000)
    out |= sign.astype(np.uint16)


# Whole-array passes over large arrays are bound by memory bandwidth, and
# their temporaries, as large as the input, are mmapped and page-faulted anew
# by glibc's malloc (128 KiB threshold). Blocks of 16 Ki elements keep every
# temporary under that threshold and in cache: 16 Mi elements encode in 38 ms
# and decode in 18 ms here, against 90 ms and 32 ms whole-array.
_BLOCK = 1 << 14


def float16_bits_to_float32(bits: np.ndarray, out: np.ndarray) -> None:
    """Widen float16 bit patterns (uint16) into float32 `out`, exactly (1-D arrays)."""
    for start in range(0, bits.size, _BLOCK):
        _float16_bits_to_float32(bits[start:start + _BLOCK], out[start:start + _BLOCK])


def float32_to_float16_bits(values: np.ndarray, out: np.ndarray) -> None:
    """Round float32 to float16 (nearest, ties to even) into uint16 `out` (1-D arrays)."""
    for start in range(0, values.size, _BLOCK):
        _float32_to_float16_bits(values[start:start + _BLOCK], out[start:start + _BLOCK])


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


def to_wire(values: np.ndarray, dtype: int,
            out: np.ndarray | memoryview | bytearray | None = None) -> np.ndarray:
    """Convert a flat float array to its wire representation.

    Without `out`, into a new array. With `out`, a writable buffer of exactly
    wire_nbytes(dtype, values.size) bytes (a message's payload, say), the elements
    are written there and the returned array is a view of it: no allocation.
    The result is flat; its dtype is the wire's storage dtype (uint16 for
    bfloat16, bytes for the 8-bit wires of reducer_wire.quant).
    """
    storage = wire_numpy_dtype(dtype)
    flat = np.ascontiguousarray(values).reshape(-1)
    nbytes = wire_nbytes(dtype, flat.size)  # scales included (the 8-bit wires)
    if out is None:
        target = np.empty(nbytes // storage.itemsize, dtype=storage)
    else:
        if isinstance(out, np.ndarray) and not out.flags.c_contiguous:
            # reshape would copy, and the elements would be written to the copy
            raise ValueError(f"to_wire: out must be C-contiguous, got an array of shape "
                             f"{out.shape} and strides {out.strides}")
        target = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) \
            else out.reshape(-1).view(np.uint8)
        if target.nbytes != nbytes or not target.flags.writeable:
            raise ValueError(f"to_wire: out must be a writable buffer of "
                             f"{nbytes} bytes, got {target.nbytes}")
        target = target.view(storage)
    fast = _fast
    if dtype in QUANTIZED_DTYPES:  # float64 input is rounded to float32 first
        quant.encode(flat.astype(np.float32, copy=False), dtype, target, fast is not None)
    elif dtype == pb.DTYPE_FLOAT32:
        np.copyto(target, flat, casting="unsafe")
    elif dtype in INTEGER_WIRES:  # C's integer cast: wider values wrap around
        np.copyto(target, flat, casting="unsafe")
    elif fast is not None and flat.dtype == np.float32:
        bits = target.view(np.uint16)
        (fast.f32_to_bf16 if dtype == pb.DTYPE_BFLOAT16 else fast.f32_to_f16)(flat, bits)
    elif dtype == pb.DTYPE_BFLOAT16:
        target[...] = bfloat16_bits_from_float32(flat)
    elif flat.dtype == np.float32:
        float32_to_float16_bits(flat, target.view(np.uint16))
    else:  # float64 or float16 input: NumPy's own cast rounds once, nearest even
        np.copyto(target, flat, casting="unsafe")
    return target


def from_wire(data: bytes | memoryview | np.ndarray, dtype: int, out: np.ndarray, *,
              stream: bool = False) -> None:
    """Write wire elements into `out` (any float dtype), converting exactly.

    bfloat16 and float16 both widen exactly to float32 and so to float64, as
    the 8-bit wires do (reducer_wire.quant). `stream`: `out` is part of a
    large output that is not read again soon (a reply widened into the
    caller's gradient), so the C kernels write it with streaming stores,
    which do not read the lines first (the same bits; a hint, ignored where
    there is no such path).
    """
    if dtype in QUANTIZED_DTYPES:
        quant.decode(data, dtype, out, _fast is not None, stream)
        return
    raw = np.frombuffer(data, dtype=wire_numpy_dtype(dtype)) if not isinstance(
        data, np.ndarray) else data
    if raw.size != out.size:  # NumPy would broadcast a single element over `out`
        raise ValueError(f"from_wire: {raw.size} wire elements for an output of {out.size}")
    if dtype in INTEGER_WIRES:  # exact into any integer output at least as wide
        np.copyto(out, raw, casting="unsafe")
        return
    fast = _fast
    if (fast is not None and dtype != pb.DTYPE_FLOAT32 and raw.flags.c_contiguous
            and not (dtype == pb.DTYPE_FLOAT16 and out.dtype == np.float16)):
        # Widen in C, straight into a float32 output, else through a float32
        # temporary (exact either way: both wire types fit float32).
        direct = out.dtype == np.float32 and out.flags.c_contiguous
        target = out if direct else np.empty(raw.size, dtype=np.float32)
        if dtype == pb.DTYPE_BFLOAT16:
            (fast.bf16_to_f32_stream if stream and direct else fast.bf16_to_f32)(raw, target)
        else:
            (fast.f16_to_f32_stream if stream and direct else fast.f16_to_f32)(raw, target)
        if not direct:
            np.copyto(out, target, casting="unsafe")
        return
    if dtype == pb.DTYPE_BFLOAT16:
        if out.dtype == np.float32:
            # Widen in place through the output's own bits: no temporary.
            bits = out.view(np.uint32)
            np.copyto(bits, raw, casting="unsafe")
            bits <<= 16
        else:
            widened = raw.astype(np.uint32) << 16
            np.copyto(out, widened.view(np.float32), casting="unsafe")
    elif dtype == pb.DTYPE_FLOAT16 and out.dtype != np.float16:
        if out.dtype == np.float32 and out.flags.c_contiguous:
            float16_bits_to_float32(raw.view(np.uint16), out)
        else:
            widened = np.empty(raw.size, dtype=np.float32)
            float16_bits_to_float32(raw.view(np.uint16), widened)
            np.copyto(out, widened, casting="unsafe")
    else:
        np.copyto(out, raw, casting="unsafe")
