"""The 8-bit wire formats: int8 with a scale per block, FP8 E4M3 and E5M2.

NumPy here is the reference and the fallback; reducer_wire._quant (C, no GIL)
gives the same bits and is used when built (`use_c`). docs/explanation/numerics.md
derives the error bound that ERROR_BOUND_DOC states.

int8 (DTYPE_INT8): a chunk of n float32 elements is cut into blocks of
INT8_BLOCK elements from the chunk's first element; the last block holds the
n % INT8_BLOCK left over, if any. The chunk's bytes are

    [ceil(n / B) float32 scales, little-endian][n int8 codes, two's complement]

so wire_nbytes = 4 * ceil(n / B) + n. Element i decodes to
codes[i] * scales[i // B], exactly in float32: every scale has its 7 lowest
mantissa bits zero, so the product of a code (at most 127) and a scale has
at most 24 significant bits. A block's scale is the smallest such float32 at
least fl(absmax / 127) (and at least 2^-142, the smallest such one above 0),
its codes rint(x / scale) (float32 division, ties to even), so
|code| <= 127 and |x - decoded| <= (1/2 + 2^-17) * scale. Special blocks:
all zeros give scale 0; a block holding any NaN or +-Inf gives the scale NaN
(0x7FC00000) and codes 0, so all its elements decode to NaN: int8 cannot
carry an infinity, and a non-finite gradient stays non-finite. A decoded
finite value can overflow to +-Inf only if |x| > 3.40277e38 (within 2^-16
of float32's maximum).

FP8 (DTYPE_FP8_E4M3, DTYPE_FP8_E5M2): one byte per element, no scale, the
OCP 8-bit floating point formats. float32 rounds to nearest, ties to even.
A value that rounds beyond the largest finite (E4M3: |x| > 464, the midpoint
above 448, whose tie rounds down to 448's even mantissa; E5M2: |x| >= 61440,
the midpoint above 57344) overflows, as in the specification's
non-saturating mode; it is never clipped, so a loss scaler sees it: to
E5M2 +-Inf (0x7C/0xFC) and, E4M3 having no infinity, to E4M3 NaN (0x7F).
+-Inf does the same; NaN -> the format's NaN (E4M3 0x7F, E5M2 0x7E). Every
NaN is written positive, so the daemon's sum of NaNs of both signs does not
depend on the order its contributions came in. The daemon's sum is encoded
alike: a sum beyond the format's range reaches every worker non-finite.
Decoding is exact (a NaN code with the sign bit decodes to a negative NaN).
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np

from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

__all__ = ["encode", "decode", "add", "INT8_BLOCK", "Fp8Format", "E4M3", "E5M2",
           "int8_nbytes", "int8_numel", "encode_int8", "decode_int8", "add_int8",
           "encode_fp8", "decode_fp8", "add_fp8", "fp8_table", "fp8_overflow", "kernels",
           "ERROR_BOUND_DOC"]

# Elements per int8 block. 128: the four scale bytes cost 3.1 % over one byte
# per element (64: 6.3 %, 256: 1.6 %); on gradient-like data the RMS error is
# 9-21 % above block 64's and 8-21 % below block 256's, and encoding is no
# slower than with 256 (docs/explanation/numerics.md has the measurements). The C kernels
# take any block size; the wire (DTYPE_INT8_BLOCK128) fixes this one.
INT8_BLOCK = 128
_SCALE_BYTES = 4
_SCALE_LOW_BITS = np.uint32(0x7F)  # cleared in every scale: exact decoding
_SCALE_MIN_BITS = np.uint32(0x80)  # 2^-142, the smallest scale above 0
_NAN_BITS = np.uint32(0x7FC00000)

ERROR_BOUND_DOC = """\
Per element, against the exact sum S = sum_r x_r of the float32 inputs x_r
of N contributors (docs/explanation/numerics.md derives it):

    SUM:  |got - S|     <= E_in + g * (M + E_in) + e_out
    MEAN: |got - S / N| <= (E_in + g * (M + E_in)) / N
                           + 2^-24 * (1 + g) * (M + E_in) / N + e_out

with M = sum_r |x_r|, E_in = sum_r e_in(r), g = (N-1) 2^-24 / (1 - (N-1) 2^-24)
(float32 summation; the daemon decodes each contribution exactly), and

int8:  e_in(r) = A_r / 254 * (1 + 2^-14) + 2^-142, A_r the largest |x_r| in
       the element's block on rank r; e_out the same with A_out, the largest
       |value| in the element's block of the daemon's float32 result.
FP8:   e_in(r) = u |x_r| + a / 2, e_out = u |y| + a / 2 (y the float32
       result), u = 2^-4 (E4M3) or 2^-3 (E5M2), a = 2^-9 (E4M3) or 2^-16
       (E5M2) the subnormal spacing; while every |x_r| and |y| round to
       finite codes (E4M3: at most 464; E5M2: below 61440): beyond, the
       result is non-finite.

Relative to sum_r A_r (int8) or M (FP8) the SUM bound is about 2/254 (int8)
or 2u (FP8), plus 2g: each contribution is rounded once and the result once,
whatever N. In absolute terms E_in grows with N as the magnitudes summed do;
what does not grow is the number of roundings an element goes through (a
ring quantizes its partial sum again at each of its N - 1 hops).
float64 inputs are first rounded to float32: add 2^-24 |x_r| to each e_in(r).
"""

_built: ModuleType | None
try:
    import reducer_wire._quant as _built
except ImportError:  # built without a C compiler: NumPy does it all
    _built = None


def kernels() -> ModuleType | None:
    """The C module reducer_wire._quant, or None where it was not built."""
    return _built


# -- int8 with a scale per block ----------------------------------------------

def int8_nbytes(numel: int, block: int = INT8_BLOCK) -> int:
    """Wire bytes of `numel` elements: the scales, then one byte per element."""
    return _SCALE_BYTES * (-(-numel // block)) + numel


def int8_numel(nbytes: int, block: int = INT8_BLOCK) -> int | None:
    """Elements in `nbytes` wire bytes, or None if no element count has that size."""
    whole, rest = divmod(nbytes, block + _SCALE_BYTES)
    if rest == 0:
        return whole * block
    if rest <= _SCALE_BYTES:
        return None  # a scale with no element, or part of a scale
    return whole * block + rest - _SCALE_BYTES


def _split(data: np.ndarray, numel: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The scales (float32) and codes (int8) of a chunk's wire bytes."""
    nblocks = -(-numel // block)
    scales = data[:_SCALE_BYTES * nblocks].view("<f4")
    codes = data[_SCALE_BYTES * nblocks:].view(np.int8)
    return scales, codes


def _bytes(buffer: bytes | memoryview | bytearray | np.ndarray,
           written: bool = False) -> np.ndarray:
    if isinstance(buffer, np.ndarray):
        if written and not buffer.flags.c_contiguous:  # reshape would copy: writes lost
            raise ValueError(f"an 8-bit wire buffer must be C-contiguous, got an array of "
                             f"shape {buffer.shape} and strides {buffer.strides}")
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8)


def _check_int8(numel: int, nbytes: int, block: int, name: str) -> None:
    if block < 1:
        raise ValueError(f"{name}: block must be >= 1, got {block}")
    if nbytes != int8_nbytes(numel, block):
        raise ValueError(f"{name}: {numel} elements take {int8_nbytes(numel, block)} "
                         f"bytes in blocks of {block}, the buffer has {nbytes}")


def _block_scales(values: np.ndarray, block: int) -> np.ndarray:
    """Each block's scale as float32 bits (uint32), NaN for non-finite blocks."""
    magnitude = values.view(np.uint32) & np.uint32(0x7FFFFFFF)
    nblocks = -(-values.size // block)
    padded = np.zeros(nblocks * block, dtype=np.uint32)
    padded[:values.size] = magnitude
    amax = padded.reshape(nblocks, block).max(axis=1)
    special = amax >= np.uint32(0x7F800000)
    with np.errstate(all="ignore"):
        wanted = amax.view(np.float32) / np.float32(127.0)
    bits = (wanted.view(np.uint32) + _SCALE_LOW_BITS) & ~_SCALE_LOW_BITS
    bits = np.maximum(bits, _SCALE_MIN_BITS)
    bits[amax == 0] = 0
    bits[special] = _NAN_BITS
    return bits


def encode_int8(values: np.ndarray, out: np.ndarray | memoryview | bytearray,
                block: int = INT8_BLOCK, use_c: bool = True) -> None:
    """Quantize float32 `values` (1-D) into `out`, int8_nbytes(values.size) bytes."""
    target = _bytes(out, written=True)
    _check_int8(values.size, target.size, block, "encode_int8")
    if use_c and _built is not None:
        _built.q8_encode(np.ascontiguousarray(values, dtype=np.float32), target, block)
        return
    x = np.ascontiguousarray(values, dtype=np.float32)
    scale_bits = _block_scales(x, block)
    scales, codes = _split(target, x.size, block)
    scales[...] = scale_bits.view(np.float32)
    per_element = np.repeat(scale_bits.view(np.float32), block)[:x.size]
    usable = np.isfinite(per_element) & (per_element > 0)
    with np.errstate(all="ignore"):
        q = np.rint(x / per_element)
    np.clip(q, -127, 127, out=q)
    q[~usable] = 0
    codes[...] = q.astype(np.int8)


def _decoded_int8(data: np.ndarray, numel: int, block: int) -> np.ndarray:
    scales, codes = _split(data, numel, block)
    per_element = np.repeat(scales.astype(np.float32), block)[:numel]
    with np.errstate(over="ignore"):  # 127 times the scale of float32's largest: Inf
        return codes.astype(np.float32) * per_element  # exact: see the module docstring


def decode_int8(data: bytes | memoryview | np.ndarray, out: np.ndarray,
                block: int = INT8_BLOCK, use_c: bool = True, stream: bool = False) -> None:
    """Write the float32 values of int8 wire bytes into `out` (any float dtype);
    stream: convert.from_wire's hint (streaming stores in C)."""
    raw = _bytes(data)
    _check_int8(out.size, raw.size, block, "decode_int8")
    if (use_c and _built is not None and out.dtype == np.float32
            and out.flags.c_contiguous):
        _built.q8_decode(raw, out, block, stream)
        return
    np.copyto(out, _decoded_int8(raw, out.size, block).reshape(out.shape), casting="unsafe")


def add_int8(acc: np.ndarray, data: bytes | memoryview | np.ndarray,
             block: int = INT8_BLOCK, use_c: bool = True) -> None:
    """acc += the decoded int8 wire bytes (float32 acc, 1-D): one rounding each."""
    raw = _bytes(data)
    _check_int8(acc.size, raw.size, block, "add_int8")
    if (use_c and _built is not None and acc.dtype == np.float32
            and acc.flags.c_contiguous and acc.flags.aligned):
        _built.q8_add(acc, raw, block)
        return
    np.add(acc, _decoded_int8(raw, acc.size, block), out=acc)


# -- FP8 (OCP E4M3 and E5M2) ---------------------------------------------------

class Fp8Format(NamedTuple):
    """An OCP 8-bit float: its field widths and special codes (sign bit clear)."""

    name: str
    mantissa_bits: int
    bias: int
    max_code: int  # largest finite magnitude
    nan_code: int
    inf_code: int  # what +Inf and every overflow become (E4M3 has no infinity: its NaN)
    kind: int  # the C kernels' format number


E4M3 = Fp8Format("e4m3", 3, 7, 0x7E, 0x7F, 0x7F, 0)
E5M2 = Fp8Format("e5m2", 2, 15, 0x7B, 0x7E, 0x7C, 1)


def fp8_table(fmt: Fp8Format) -> np.ndarray:
    """The float32 value of each of the 256 codes (exact), built from the fields."""
    codes = np.arange(256, dtype=np.int64)
    exponent = (codes & 0x7F) >> fmt.mantissa_bits
    mantissa = codes & ((1 << fmt.mantissa_bits) - 1)
    scale = 2.0 ** (np.maximum(exponent, 1) - fmt.bias - fmt.mantissa_bits)
    significand = np.where(exponent > 0, mantissa + (1 << fmt.mantissa_bits), mantissa)
    values = significand * scale
    values = np.where(codes & 0x80, -values, values)
    magnitude = codes & 0x7F
    if fmt.inf_code != fmt.nan_code:  # E5M2: IEEE-like, exponent all ones
        values = np.where(magnitude == fmt.inf_code, np.copysign(np.inf, values), values)
        values = np.where(magnitude > fmt.inf_code, np.nan, values)
    else:  # E4M3: S.1111.111 alone is NaN
        values = np.where(magnitude == fmt.nan_code, np.nan, values)
    # A NaN keeps its code's sign, as the C decode's does (the same bits either way).
    values = np.where(codes & 0x80, -np.abs(values), values)
    return values.astype(np.float32)


_TABLES = {fmt.kind: fp8_table(fmt) for fmt in (E4M3, E5M2)}


def fp8_overflow(fmt: Fp8Format) -> float:
    """The smallest float32 magnitude that rounds beyond the format's largest
    finite: E4M3 the float32 just above 464, E5M2 61440. It and all above it
    (Inf too) encode to fmt.inf_code with their sign."""
    largest = float(fp8_table(fmt)[fmt.max_code])
    half_ulp = 2.0 ** (np.floor(np.log2(largest)) - fmt.mantissa_bits - 1)
    midpoint = np.float32(largest + half_ulp)
    # A tie rounds to the even mantissa: down to the largest finite if its
    # mantissa is even (E4M3), up beyond it if odd (E5M2).
    if fmt.max_code % 2 == 0:
        midpoint = np.nextafter(midpoint, np.float32(np.inf))
    return float(midpoint)


_OVERFLOW_BITS = {fmt.kind: np.float32(fp8_overflow(fmt)).view(np.uint32)
                  for fmt in (E4M3, E5M2)}


def _fp8_codes(values: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """Round float32 to the format (nearest even, overflow non-finite): uint8 codes."""
    bits = values.view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    shift = np.uint32(23 - fmt.mantissa_bits)
    # Normal: rebias the exponent, add just under half an ulp plus the kept
    # lowest bit (ties to even), shift the dropped mantissa bits out.
    rebias = np.uint32(((fmt.bias - 127) << 23) & 0xFFFFFFFF)
    rounding = np.uint32((1 << (22 - fmt.mantissa_bits)) - 1)
    odd = (magnitude >> shift) & np.uint32(1)
    with np.errstate(over="ignore"):
        normal = (magnitude + rebias + rounding + odd) >> shift
    # Subnormal: adding 2^k whose ulp is the format's smallest subnormal
    # aligns the value there; float32 addition itself rounds to nearest even.
    magic_bits = np.uint32((127 - fmt.bias + 23 - fmt.mantissa_bits + 1) << 23)
    magic = np.array(magic_bits, dtype=np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        tiny = (magnitude.view(np.float32) + magic).view(np.uint32) - magic_bits
    min_normal_bits = np.uint32((127 - fmt.bias + 1) << 23)
    codes = np.where(magnitude < min_normal_bits, tiny, normal)
    codes = np.where(magnitude >= _OVERFLOW_BITS[fmt.kind], np.uint32(fmt.inf_code), codes)
    codes = np.where(magnitude > np.uint32(0x7F800000), np.uint32(fmt.nan_code), codes)
    # NaN codes positive: a sum of NaNs of both signs would otherwise take the
    # sign of whichever contribution the daemon added first.
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    codes |= np.where(codes == np.uint32(fmt.nan_code), np.uint32(0), sign)
    return codes.astype(np.uint8)


def _check_fp8(numel: int, nbytes: int, name: str) -> None:
    if numel != nbytes:
        raise ValueError(f"{name}: {numel} elements take {numel} bytes, the buffer has "
                         f"{nbytes}")


# NumPy works on blocks of this many elements: temporaries stay in cache and
# under glibc's mmap threshold (as in convert.py).
_SPAN = 1 << 14


def encode_fp8(values: np.ndarray, out: np.ndarray | memoryview | bytearray,
               fmt: Fp8Format, use_c: bool = True) -> None:
    """Round float32 `values` (1-D) to FP8 codes in `out` (values.size bytes)."""
    target = _bytes(out, written=True)
    _check_fp8(values.size, target.size, f"encode_fp8 ({fmt.name})")
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if use_c and _built is not None:
        _built.fp8_encode(x, target, fmt.kind)
        return
    for start in range(0, x.size, _SPAN):
        target[start:start + _SPAN] = _fp8_codes(x[start:start + _SPAN], fmt)


def decode_fp8(data: bytes | memoryview | np.ndarray, out: np.ndarray,
               fmt: Fp8Format, use_c: bool = True, stream: bool = False) -> None:
    """Write the values of FP8 codes into `out` (any float dtype), exactly.

    stream: a hint for a large float32 output that is not read again soon
    (convert.from_wire's replies): the C path then writes it with streaming
    stores where the CPU has F16C; the same bits either way."""
    raw = _bytes(data)
    _check_fp8(out.size, raw.size, f"decode_fp8 ({fmt.name})")
    if (use_c and _built is not None and out.dtype == np.float32
            and out.flags.c_contiguous):
        _built.fp8_decode(raw, out, fmt.kind, stream)
        return
    np.copyto(out, _TABLES[fmt.kind][raw].reshape(out.shape), casting="unsafe")


def add_fp8(acc: np.ndarray, data: bytes | memoryview | np.ndarray, fmt: Fp8Format,
            use_c: bool = True) -> None:
    """acc += the values of FP8 codes (float32 acc, 1-D): one rounding each."""
    raw = _bytes(data)
    _check_fp8(acc.size, raw.size, f"add_fp8 ({fmt.name})")
    if (use_c and _built is not None and acc.dtype == np.float32
            and acc.flags.c_contiguous and acc.flags.aligned):
        _built.fp8_add(acc, raw, fmt.kind)
        return
    table = _TABLES[fmt.kind]
    for start in range(0, raw.size, _SPAN):
        part = acc[start:start + _SPAN]
        np.add(part, table[raw[start:start + _SPAN]], out=part)


# -- by wire dtype (reducer.v1.DType): what convert and the daemon call -------------

_FP8_BY_DTYPE: dict[int, Fp8Format] = {pb.DTYPE_FP8_E4M3: E4M3, pb.DTYPE_FP8_E5M2: E5M2}


def encode(values: np.ndarray, dtype: int, out: np.ndarray | memoryview | bytearray,
           use_c: bool = True) -> None:
    """Quantize float32 `values` (1-D) into `out`, the wire bytes of `dtype`."""
    if dtype == pb.DTYPE_INT8_BLOCK128:
        encode_int8(values, out, INT8_BLOCK, use_c)
    else:
        encode_fp8(values, out, _FP8_BY_DTYPE[dtype], use_c)


def decode(data: bytes | memoryview | np.ndarray, dtype: int, out: np.ndarray,
           use_c: bool = True, stream: bool = False) -> None:
    """Write the values of `dtype` wire bytes into `out` (any float dtype), exactly."""
    if dtype == pb.DTYPE_INT8_BLOCK128:
        decode_int8(data, out, INT8_BLOCK, use_c, stream)
    else:
        decode_fp8(data, out, _FP8_BY_DTYPE[dtype], use_c, stream)


def add(acc: np.ndarray, data: bytes | memoryview | np.ndarray, dtype: int,
        use_c: bool = True) -> None:
    """acc += the values of `dtype` wire bytes (float32 acc, 1-D): the daemon's sum."""
    if dtype == pb.DTYPE_INT8_BLOCK128:
        add_int8(acc, data, INT8_BLOCK, use_c)
    else:
        add_fp8(acc, data, _FP8_BY_DTYPE[dtype], use_c)
