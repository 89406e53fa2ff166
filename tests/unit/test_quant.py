"""The 8-bit wire formats (reducer_wire.quant, reducer_wire._quant).

FP8 against ml_dtypes (where installed) and against an independent nearest-
value oracle built from the 256 decoded codes (everywhere); int8 against its
definition; the C kernels (AVX2 and portable loops) against NumPy bit for
bit; and the reduction the daemon performs (each contribution dequantized
into a float32 accumulator, summed, the result quantized once) against a
float64 reference with the bound of quant.ERROR_BOUND_DOC, for 2, 8 and 64
contributors.
"""

import numpy as np
import pytest
from reducer_wire import dtypes, quant
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

pytestmark = pytest.mark.timeout(120)

E4M3, E5M2, B = quant.E4M3, quant.E5M2, quant.INT8_BLOCK
U32 = 2.0 ** -24
FP8_UNIT = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}  # half an ulp, relative
FP8_SPACING = {"e4m3": 2.0 ** -9, "e5m2": 2.0 ** -16}  # subnormal step
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def set_c_path(name):
    """Choose the C loops: "best" (AVX-512 where there is one), "avx2" or "portable"."""
    kernels = quant.kernels()
    kernels.set_simd(name != "portable")
    if name == "avx2":
        kernels.set_avx512(False)


C_PATHS = ("best", "avx2", "portable")


@pytest.fixture(params=["numpy", "c-best", "c-avx2", "c-portable"])
def impl(request):
    """Each implementation: yields use_c for the quant functions."""
    if request.param == "numpy":
        yield False
        return
    if quant.kernels() is None:
        pytest.skip("reducer_wire._quant not built")
    set_c_path(request.param.removeprefix("c-"))
    yield True
    set_c_path("best")


def f32(values):
    return np.asarray(values, dtype=np.float32)


def bits_of(values):
    return f32(values).view(np.uint32)


def encode8(x, fmt, use_c=True):
    out = np.empty(x.size, np.uint8)
    quant.encode_fp8(f32(x), out, fmt, use_c)
    return out


def decode8(codes, fmt, use_c=True):
    out = np.empty(codes.size, np.float32)
    quant.decode_fp8(codes, out, fmt, use_c)
    return out


def encode_q8(x, use_c=True, block=B):
    out = np.empty(quant.int8_nbytes(x.size, block), np.uint8)
    quant.encode_int8(f32(x), out, block, use_c)
    return out


def decode_q8(data, numel, use_c=True, block=B):
    out = np.empty(numel, np.float32)
    quant.decode_int8(data, out, block, use_c)
    return out


def same_bits_or_both_nan(a, b):
    a, b = f32(a), f32(b)
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


# -- sizes -------------------------------------------------------------------

def test_wire_sizes_invert_and_reject_lengths_no_chunk_has():
    i8 = dtypes.EIGHT_BIT_DTYPES["int8"]
    seen = {}
    for numel in range(0, 5 * B + 3):
        nbytes = dtypes.wire_nbytes(i8, numel)
        assert nbytes == 4 * -(-numel // B) + numel
        assert dtypes.wire_numel(i8, nbytes) == numel
        seen[nbytes] = numel
    for nbytes in range(0, max(seen)):
        if nbytes not in seen:  # a scale with no code after it, or part of a scale
            assert dtypes.wire_numel(i8, nbytes) is None, nbytes
    assert [dtypes.wire_numel(i8, n) for n in (1, 4, 5, B + 4, B + 5, B + 8, B + 9)] == \
        [None, None, 1, B, None, None, B + 1]
    for name, size in (("fp8_e4m3", 1), ("fp8_e5m2", 1), ("float16", 2), ("float32", 4)):
        dtype = {**dtypes.WIRE_DTYPES, **dtypes.EIGHT_BIT_DTYPES}[name]
        assert dtypes.wire_block(dtype) == 1 and dtypes.wire_itemsize(dtype) == size
        assert dtypes.wire_nbytes(dtype, 7) == 7 * size
        assert dtypes.wire_numel(dtype, 7 * size) == 7
        assert dtypes.wire_numel(dtype, 7 * size + 1) is (None if size > 1 else 7 * size + 1)
    assert dtypes.wire_block(i8) == B
    with pytest.raises(ValueError, match="no item size"):
        dtypes.wire_itemsize(i8)
    with pytest.raises(ValueError, match="unknown wire dtype"):
        dtypes.wire_nbytes(99, 1)
    assert dtypes.DTYPE_NAMES[pb.DTYPE_FP8_E5M2] == "fp8_e5m2"


# -- FP8 ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_table_known_values_and_ml_dtypes(fmt):
    table = quant.fp8_table(fmt)
    one = 0x38 if fmt is E4M3 else 0x3C
    assert table[one] == 1.0 and table[one | 0x80] == -1.0
    assert table[fmt.max_code] == FP8_MAX[fmt.name] and table[1] == FP8_SPACING[fmt.name]
    assert table[0] == 0 and np.signbit(table[0x80])
    assert np.isnan(table[fmt.nan_code]) and np.isnan(table[fmt.nan_code | 0x80])
    if fmt is E5M2:
        assert table[0x7C] == np.inf and table[0xFC] == -np.inf
        assert np.isnan(table[[0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]]).all()
    else:
        assert np.isfinite(np.delete(table, [0x7F, 0xFF])).all()  # no infinity in E4M3
    ml_dtypes = pytest.importorskip("ml_dtypes")
    oracle = np.arange(256, dtype=np.uint8).view(
        ml_dtypes.float8_e4m3fn if fmt is E4M3 else ml_dtypes.float8_e5m2).astype(np.float32)
    assert same_bits_or_both_nan(table, oracle)


def _fp8_cases(fmt, rng):
    """Every code's value, every midpoint (ties) and its float32 neighbours,
    random magnitudes over the whole range, subnormals of both formats, specials."""
    table = quant.fp8_table(fmt).astype(np.float64)
    finite = np.unique(table[np.isfinite(table)])
    mid = (finite[:-1] + finite[1:]) / 2  # exact in float32
    mid32 = f32(mid)
    up, down = np.nextafter(mid32, np.float32(np.inf)), np.nextafter(mid32, np.float32(-np.inf))
    spread = rng.standard_normal(200_000) * 2.0 ** rng.uniform(-30, 20, 200_000)
    tiny = rng.integers(1, 1 << 23, 1000).astype(np.uint32).view(np.float32)  # f32 subnormal
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3e38, -3e38]
    return np.concatenate([f32(finite), mid32, up, down, f32(spread), tiny, f32(specials)])


def _nearest_even(x, fmt):
    """Oracle without ml_dtypes: the nearest code (ties: even mantissa) among
    the finite ones and the first step beyond the largest finite, which the
    format cannot hold: that one overflows, as Inf does, to E5M2 Inf or E4M3
    NaN; NaN -> NaN; sign kept, but every NaN is positive."""
    table = quant.fp8_table(fmt).astype(np.float64)
    largest = table[fmt.max_code]
    beyond = largest + (largest - table[fmt.max_code - 1])  # the next step: 480, 65536
    values = np.append(table[np.arange(fmt.max_code + 1)], beyond)  # increasing
    magnitude = np.minimum(np.abs(x.astype(np.float64)), beyond)
    hi = np.clip(np.searchsorted(values, magnitude), 0, fmt.max_code + 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = magnitude - values[lo], values[hi] - magnitude
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    codes = np.where(pick_hi, hi, lo).astype(np.uint32)
    codes = np.where((codes > fmt.max_code) | np.isinf(x), fmt.inf_code, codes)
    codes = np.where(np.isnan(x), fmt.nan_code, codes)
    sign = np.where(np.signbit(x) & (codes != fmt.nan_code), 0x80, 0)
    return (codes | sign).astype(np.uint8)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_encoding_is_nearest_even_and_overflows_never_saturates(impl, fmt):
    x = _fp8_cases(fmt, np.random.default_rng(7))
    got = encode8(x, fmt, impl)
    assert np.array_equal(got, _nearest_even(x, fmt))
    # Known codes: ties to even, overflow, specials.
    expected = {"e4m3": {1.0625: 0x38, 1.1875: 0x3A, 448.0: 0x7E, 463.0: 0x7E, 464.0: 0x7E,
                         464.00003: 0x7F, 1e6: 0x7F, -1e30: 0x7F, 2.0 ** -10: 0x00,
                         3 * 2.0 ** -11: 0x01},
                "e5m2": {1.125: 0x3C, 1.375: 0x3E, 57344.0: 0x7B, 61439.996: 0x7B,
                         61440.0: 0x7C, 1e9: 0x7C, -1e9: 0xFC, 2.0 ** -17: 0x00,
                         3 * 2.0 ** -18: 0x01}}[fmt.name]
    assert encode8(f32(list(expected)), fmt, impl).tolist() == list(expected.values())
    # Every NaN written is positive (E4M3's overflow and Inf among them).
    specials = encode8(f32([np.inf, -np.inf, np.nan, -np.nan, -0.0]), fmt, impl)
    assert specials.tolist() == ([0x7F, 0x7F, 0x7F, 0x7F, 0x80] if fmt is E4M3
                                 else [0x7C, 0xFC, 0x7E, 0x7E, 0x80])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_encoding_matches_ml_dtypes_overflow_included(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = _fp8_cases(fmt, np.random.default_rng(8))
    # ml_dtypes does not saturate either (E4M3 overflow -> NaN, E5M2 -> Inf).
    oracle = x.astype(ml_dtypes.float8_e4m3fn if fmt is E4M3 else ml_dtypes.float8_e5m2)
    oracle_bits = oracle.view(np.uint8).copy()
    if fmt is E4M3:  # no E4M3 infinity: ml_dtypes gives NaN, sign kept
        assert np.array_equal(oracle_bits[np.isinf(x)], np.where(x[np.isinf(x)] > 0, 0x7F, 0xFF))
    # Ours writes every NaN positive, the format's one NaN code.
    oracle_bits[np.isnan(oracle.astype(np.float32))] = fmt.nan_code
    assert np.array_equal(encode8(x, fmt), oracle_bits)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_every_code_decodes_and_adds_exactly(impl, fmt):
    codes = np.tile(np.arange(256, dtype=np.uint8), 3)
    message = bytearray(1) + codes.tobytes()  # shard data sits anywhere in a message
    data = memoryview(message)[1:]
    decoded = decode8(np.frombuffer(data, np.uint8), fmt, impl)
    assert same_bits_or_both_nan(decoded, quant.fp8_table(fmt)[codes])
    # Every value keeps its code's sign, a NaN's too (C and NumPy: the same bits).
    assert np.array_equal(bits_of(decoded) >> 31, codes >> 7)
    acc = np.random.default_rng(1).standard_normal(codes.size).astype(np.float32)
    with np.errstate(all="ignore"):
        want = acc + quant.fp8_table(fmt)[codes]
        quant.add_fp8(acc, data, fmt, impl)
    assert same_bits_or_both_nan(acc, want)
    # Every code encodes back to itself (NaNs to the canonical NaN).
    again = encode8(quant.fp8_table(fmt), fmt, impl)
    finite = np.isfinite(quant.fp8_table(fmt)) | np.isinf(quant.fp8_table(fmt))
    assert np.array_equal(again[finite], np.arange(256)[finite])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_c_matches_numpy_on_a_spread_of_all_bit_patterns(fmt):
    if quant.kernels() is None:
        pytest.skip("reducer_wire._quant not built")
    patterns = np.arange(0, 1 << 32, 4093, dtype=np.uint64).astype(np.uint32).view(np.float32)
    reference = encode8(patterns, fmt, use_c=False)
    for path in C_PATHS:
        set_c_path(path)
        assert np.array_equal(encode8(patterns, fmt), reference), path
    set_c_path("best")


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_every_length_and_alignment_and_streamed_decoding(fmt):
    """The C loops (16 or 32 codes at a time for encoding, 8 for decoding and adding
    through F16C, then a scalar tail; streaming stores after a scalar
    prologue up to a 32-byte line) give NumPy's bits at every length and
    source and output alignment, and write nothing outside the output."""
    if quant.kernels() is None:
        pytest.skip("reducer_wire._quant not built")
    rng = np.random.default_rng(fmt.kind)
    table = quant.fp8_table(fmt)
    for n in (*range(0, 41), 63, 64, 65, 255, 257, 4099):
        codes = rng.integers(0, 256, n).astype(np.uint8)
        values = table[codes]
        for simd in C_PATHS:
            set_c_path(simd)
            for offset in (0, 1, 3, 5):  # elements past a 32-byte line
                space = np.full(n + 16, 7.0, np.float32)
                start = offset + (-space.ctypes.data // 4) % 8
                message = bytearray(offset) + codes.tobytes()
                for stream in (False, True):
                    out = space[start:start + n]
                    quant.decode_fp8(memoryview(message)[offset:], out, fmt, stream=stream)
                    assert same_bits_or_both_nan(out, values), (n, simd, offset, stream)
                    assert (space[:start] == 7.0).all() and (space[start + n:] == 7.0).all()
                acc = space[start:start + n]
                acc[:] = rng.standard_normal(n)
                with np.errstate(all="ignore"):
                    want = acc + values
                    quant.add_fp8(acc, memoryview(message)[offset:], fmt)
                assert same_bits_or_both_nan(acc, want), (n, simd, offset)
                x = f32(rng.standard_normal(n) * 10.0 ** rng.integers(-12, 4, n))
                source = np.full(n + 8, 7.0, np.float32)[offset:offset + n]
                source[:] = x
                assert np.array_equal(encode8(source, fmt), encode8(x, fmt, use_c=False)), n
            # A float32 output off its 4-byte alignment (a view of a byte buffer).
            raw = bytearray(4 * n + 1)
            odd = np.frombuffer(raw, np.float32, count=n, offset=1)
            for stream in (False, True):
                quant.decode_fp8(codes, odd, fmt, stream=stream)
                assert same_bits_or_both_nan(odd, values), (n, simd, stream)
    set_c_path("best")


# -- int8 with block scales -----------------------------------------------------

def _scales_and_codes(data, numel, block=B):
    nblocks = -(-numel // block)
    return (np.frombuffer(data[:4 * nblocks].tobytes(), "<f4"),
            np.frombuffer(data[4 * nblocks:].tobytes(), np.int8))


def _block_amax(x, block=B):
    """Each element's block's largest magnitude (float64)."""
    a = np.abs(f32(x).astype(np.float64))
    padded = np.zeros(-(-a.size // block) * block)
    padded[:a.size] = a
    return np.repeat(padded.reshape(-1, block).max(axis=1), block)[:a.size]


def _e_in_int8(x, block=B):
    """Per-element bound of one int8 quantization: A / 254 (1 + 2^-14) + 2^-142."""
    return _block_amax(x, block) / 254 * (1 + 2.0 ** -14) + 2.0 ** -142


def test_int8_layout_scales_then_codes_and_exact_decoding(impl):
    x = f32(np.concatenate([np.linspace(-1, 1, B), [127.0, -3.0, 0.5]]))  # one partial block
    data = encode_q8(x, impl)
    assert data.size == 4 * 2 + x.size
    scales, codes = _scales_and_codes(data, x.size)
    assert np.float32(1 / 127) <= scales[0] <= np.float32(1 / 127) * (1 + 2.0 ** -16)
    assert scales[1] == 1.0 and codes[B:].tolist() == [127, -3, 0]  # 0.5 -> 0 (ties to even)
    assert codes[0] == -127 and codes[B - 1] == 127
    assert (scales.view(np.uint32) & 0x7F == 0).all()  # every scale: 7 low bits clear
    # Decoding is exact: code * scale in float32 equals the float64 product.
    got = decode_q8(data, x.size, impl)
    exact = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), B)[:x.size]
    assert np.array_equal(got.astype(np.float64), exact)


@pytest.mark.parametrize("numel", [1, 5, B - 1, B, B + 1, 10 * B + 17])
def test_int8_round_trip_within_the_bound(impl, numel):
    rng = np.random.default_rng(numel)
    x = f32(rng.standard_normal(numel) * 10.0 ** rng.uniform(-6, 3, numel))
    got = decode_q8(encode_q8(x, impl), numel, impl).astype(np.float64)
    err = np.abs(got - x)
    assert (err <= _e_in_int8(x)).all()
    assert err.max() > 0  # the format is lossy: the bound is not vacuous


def test_int8_outlier_zeros_subnormals_and_extremes(impl):
    small = np.full(B, 1e-3)
    small[5] = 1e4  # one outlier: the block's small elements fall below half a step
    zeros = np.zeros(B)
    tiny = np.arange(1, B + 1) * 2.0 ** -149  # float32 subnormals
    huge = np.linspace(-3.4e38, 3.4e38, B)
    x = f32(np.concatenate([small, zeros, tiny, huge]))
    data = encode_q8(x, impl)
    scales, codes = _scales_and_codes(data, x.size)
    assert scales[1] == 0 and (codes[B:2 * B] == 0).all()
    got = decode_q8(data, x.size, impl).astype(np.float64)
    assert (np.abs(got - x) <= _e_in_int8(x)).all()
    assert got[5] == pytest.approx(1e4, rel=1 / 254) and (got[:5] == 0).all()
    assert (got[B:2 * B] == 0).all() and np.isfinite(got).all()
    # subnormals: the smallest scale, 2^-142, rounds them to a multiple of it
    assert scales[2] == 2.0 ** -142 and np.abs(got - x)[2 * B:3 * B].max() <= 2.0 ** -143


def test_int8_nan_or_inf_poisons_its_block_only(impl):
    x = f32(np.ones(3 * B + 7))
    x[3], x[B + 9], x[3 * B + 2] = np.nan, np.inf, -np.inf
    got = decode_q8(encode_q8(x, impl), x.size, impl)
    assert np.isnan(got[:B]).all() and np.isnan(got[B:2 * B]).all()
    assert np.isnan(got[3 * B:]).all()
    # The clean block: 127 * scale, the scale rounded up to 17 significant bits.
    assert np.abs(got[2 * B:3 * B] - 1).max() <= 2.0 ** -16


@pytest.mark.parametrize("block", [1, 3, 32, 64, 128, 256])
def test_int8_c_matches_numpy_bit_for_bit(block):
    if quant.kernels() is None:
        pytest.skip("reducer_wire._quant not built")
    rng = np.random.default_rng(block)
    n = 40 * block + 13
    exponents = rng.integers(-40, 38, n // block + 1).repeat(block)[:n]
    x = f32(rng.standard_normal(n) * 10.0 ** exponents)
    x[rng.integers(0, n, 3)] = [np.nan, np.inf, 0.0]
    x[:block] = 0
    x[block:block + 2] = [2.5 * 2.0 ** -140, -2.0 ** -149]  # ties and subnormals
    message = bytearray(3) + x.tobytes()  # unaligned source
    src = np.frombuffer(memoryview(message)[3:], np.float32)
    reference = encode_q8(x, use_c=False, block=block)
    acc0 = rng.standard_normal(n).astype(np.float32)
    for simd in (True, False):
        quant.kernels().set_simd(simd)
        got = encode_q8(src, block=block)
        assert np.array_equal(got, reference), simd
        wire = bytearray(1) + got.tobytes()  # unaligned wire bytes
        view = memoryview(wire)[1:]
        assert same_bits_or_both_nan(decode_q8(view, n, block=block),
                                     decode_q8(reference, n, use_c=False, block=block))
        acc, want = acc0.copy(), acc0.copy()
        with np.errstate(all="ignore"):
            quant.add_int8(acc, view, block)
            quant.add_int8(want, reference, block, use_c=False)
        assert same_bits_or_both_nan(acc, want)
    quant.kernels().set_simd(True)


@pytest.mark.parametrize("block", [1, 3, 128, 4096, 5000])
def test_int8_streamed_decoding_gives_the_same_bits_and_writes_nothing_else(block):
    """decode_int8(stream=True) (convert.from_wire's hint for a large output)
    decodes piece by piece through a 16 KiB buffer and copies it out with
    streaming stores: the same bits at every length and output alignment,
    across pieces (blocks that fill a piece, that do not divide it, or that
    are larger than it), nothing written outside the output."""
    if quant.kernels() is None:
        pytest.skip("reducer_wire._quant not built")
    rng = np.random.default_rng(block)
    for n in (1, 17, 4095, 4096, 4097, 3 * 4096 + 5, 70_001):
        x = f32(rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n))
        x[rng.integers(0, n, 2)] = [np.nan, 0.0]
        wire = encode_q8(x, block=block)
        for simd in (True, False):
            quant.kernels().set_simd(simd)
            want = decode_q8(wire, n, block=block)
            for offset in (0, 1, 3):  # float32 elements past a 16-byte boundary
                space = np.full(n + 8, 7.0, np.float32)
                start = offset + (-space.ctypes.data // 4) % 4
                quant.decode_int8(wire, space[start:start + n], block, stream=True)
                assert same_bits_or_both_nan(space[start:start + n], want), (n, simd, offset)
                assert (space[:start] == 7.0).all() and (space[start + n:] == 7.0).all()
        quant.kernels().set_simd(True)


def test_bad_sizes_are_refused_with_the_sizes_named():
    with pytest.raises(ValueError, match="3 elements take 15 bytes"):
        quant.encode_int8(f32([1, 2, 3]), np.empty(14, np.uint8), block=1)
    with pytest.raises(ValueError, match="buffer has 2"):
        quant.decode_fp8(b"ab", np.empty(3, np.float32), E4M3)
    kernels = quant.kernels()
    if kernels is None:
        return
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        kernels.q8_add(np.frombuffer(bytearray(9), np.uint8)[1:], bytes(9), 128)
    with pytest.raises(ValueError, match="format 2"):
        kernels.fp8_encode(f32([1]), bytearray(1), 2)
    # quant's own add falls back to NumPy for an unaligned accumulator.
    acc = np.frombuffer(bytearray(4 * B + 1), np.float32, count=B, offset=1)
    quant.add_int8(acc, encode_q8(np.full(B, 127.0)))  # scale 1: exact
    assert (acc == 127).all()


# -- the edge of each format's range (docs/explanation/numerics.md, scripts/wire8_edges.py) -

NAN = float("nan")
EDGE_INPUTS = [448.0, 449.0, 464.0, 464.00003, 57344.0, 61439.996, 61440.0, 65504.0, 1e5,
               3.4028235e38, np.inf, -np.inf, NAN, -0.0,
               2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17, 1e-40]
# What each input decodes to, from the formats' definitions: nearest even; a
# value rounding beyond the largest finite overflows (E4M3: above 464, whose
# tie rounds to 448's even mantissa; E5M2: from 61440, whose tie rounds up).
EDGE_DECODED = {
    "e4m3": [448.0, 448.0, 448.0, NAN, NAN, NAN, NAN, NAN, NAN,
             NAN, NAN, NAN, NAN, -0.0,
             2.0 ** -9, 0.0, 2.0 ** -9, 0.0, 0.0, 0.0],
    "e5m2": [448.0, 448.0, 448.0, 448.0, 57344.0, 57344.0, np.inf, np.inf, np.inf,
             np.inf, np.inf, -np.inf, NAN, -0.0,
             2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -16, 0.0, 0.0],
}


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_at_the_edge_of_its_range_overflows_never_clips(impl, fmt):
    x = f32(EDGE_INPUTS)
    got = decode8(encode8(x, fmt, impl), fmt, impl)
    assert same_bits_or_both_nan(got, EDGE_DECODED[fmt.name])
    # The sign is kept but for NaN, always positive (E4M3: -Inf -> NaN).
    assert np.array_equal(np.signbit(got), np.signbit(x) & ~np.isnan(got))
    assert quant.fp8_overflow(fmt) == float(f32(464.00003 if fmt is E4M3 else 61440.0))


def test_int8_at_the_edge_of_float32s_range(impl):
    """int8 has float32's range: every finite input decodes within its bound
    but float32's largest, whose code 127 times its scale overflows to Inf;
    a block with Inf or NaN decodes to NaN, every element of it."""
    x = np.zeros(len(EDGE_INPUTS) * B, np.float32)
    x[::B] = EDGE_INPUTS  # each value alone in its block, with zeros
    x[1::B] = 1.0
    got = decode_q8(encode_q8(x, impl), x.size, impl).reshape(-1, B)
    first = got[:, 0]
    finite = np.isfinite(f32(EDGE_INPUTS)) & (np.abs(f32(EDGE_INPUTS)) < 3e38)
    amax = np.maximum(np.abs(f32(EDGE_INPUTS)[finite]), 1.0).astype(np.float64)
    error = np.abs(first[finite] - f32(EDGE_INPUTS)[finite])
    assert (error <= amax / 254 * (1 + 2.0 ** -14) + 2.0 ** -142).all()
    assert first[EDGE_INPUTS.index(3.4028235e38)] == np.inf
    for special in (np.inf, -np.inf):
        assert np.isnan(got[EDGE_INPUTS.index(special)]).all()
    assert np.isnan(got[12]).all()  # the NaN's block


# -- the reduction: N contributors, one quantization each and one of the result ---

def _gamma(n):
    return n * U32 / (1 - n * U32)


def _reduce(inputs, encode, decode, add, mean):
    """What the workers and the daemon do: encode each, decode the first into a
    float32 accumulator, add the rest, MEAN divides in float32, encode once."""
    wires = [encode(x) for x in inputs]
    acc = decode(wires[0])
    for wire in wires[1:]:
        add(acc, wire)
    if mean:
        np.divide(acc, np.float32(len(inputs)), out=acc)
    return decode(encode(acc)).astype(np.float64), acc


def _inputs(kind, n_ranks, numel, rng):
    x = rng.standard_normal((n_ranks, numel)) * 10.0 ** rng.uniform(-4, 1, (n_ranks, 1))
    x[:, 3] = 1e3  # outlier in block 0 on every rank
    x[0, B:2 * B] = 0  # a zero block on one rank
    x[:, 2 * B:2 * B + 4] = np.arange(1, 5) * 2.0 ** -140  # float32 subnormals
    if kind != "int8":  # FP8 has no scale: keep inputs and sums inside its range
        x *= FP8_MAX[kind] / 2 / np.abs(x).sum(axis=0).max()
    return x.astype(np.float32)


@pytest.mark.parametrize("n_ranks", [2, 8, 64])
@pytest.mark.parametrize("kind", ["int8", "e4m3", "e5m2"])
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_reduction_against_float64_with_the_derived_bound(n_ranks, kind, mean):
    numel = 6 * B + 50
    inputs = _inputs(kind, n_ranks, numel, np.random.default_rng(n_ranks))
    if kind == "int8":
        def encode(x):
            return encode_q8(x)
        def decode(w):
            return decode_q8(w, numel)
        def add(acc, w):
            quant.add_int8(acc, w)
        e_in = sum(_e_in_int8(x) for x in inputs)
    else:
        fmt = E4M3 if kind == "e4m3" else E5M2
        u, a = FP8_UNIT[kind], FP8_SPACING[kind]
        def encode(x):
            return encode8(x, fmt)
        def decode(w):
            return decode8(w, fmt)
        def add(acc, w):
            quant.add_fp8(acc, w, fmt)
        e_in = sum(u * np.abs(x.astype(np.float64)) + a / 2 for x in inputs)
    got, acc = _reduce(inputs, encode, decode, add, mean)
    wide = inputs.astype(np.float64)
    exact = wide.sum(axis=0)
    magnitude = np.abs(wide).sum(axis=0)
    summation = _gamma(n_ranks - 1) * (magnitude + e_in)
    if kind == "int8":
        e_out = _e_in_int8(acc)
    else:
        e_out = u * np.abs(acc.astype(np.float64)) + a / 2
    if mean:
        division = U32 * (1 + _gamma(n_ranks - 1)) * (magnitude + e_in) / n_ranks
        bound = (e_in + summation) / n_ranks + division + e_out
        exact /= n_ranks
    else:
        bound = e_in + summation + e_out
    bound += n_ranks * 2.0 ** -53 * magnitude  # the float64 reference's own rounding
    err = np.abs(got - exact)
    assert (err <= bound).all(), f"worst excess {np.max(err - bound):.3g}"
    assert err.max() > 0
    # Relative to the magnitudes the bound does not grow with N: each element is
    # quantized once per contribution and once as a result.
    if kind == "int8" and not mean:
        amax_sum = sum(_block_amax(x) for x in inputs)
        relative = bound / amax_sum
        assert relative.max() <= 2 / 254 * (1 + 1 / 250) + 2 * _gamma(n_ranks)


def test_a_ring_requantizing_per_hop_grows_with_n_the_reducer_does_not():
    """Same data, int8: one quantization per contribution and one of the
    result, against a ring that quantizes its partial sum at every hop."""
    worst = {}
    for n_ranks in (2, 8, 64):
        rng = np.random.default_rng(100 + n_ranks)
        inputs = (rng.standard_normal((n_ranks, 4 * B)) + 1.0).astype(np.float32)
        exact = inputs.astype(np.float64).sum(axis=0)
        scale = np.abs(inputs.astype(np.float64)).sum(axis=0).max()
        ours, _ = _reduce(inputs, encode_q8, lambda w: decode_q8(w, 4 * B),
                          quant.add_int8, mean=False)
        partial = decode_q8(encode_q8(inputs[0]), 4 * B)
        for x in inputs[1:]:  # each hop: decode, add own, quantize again
            partial = decode_q8(encode_q8(partial + decode_q8(encode_q8(x), 4 * B)), 4 * B)
        worst[n_ranks] = (np.abs(ours - exact).max() / scale,
                          np.abs(partial - exact).max() / scale)
    assert all(ours < 2 / 254 for ours, _ in worst.values())
    assert worst[64][0] < 1.5 * worst[2][0] + 1e-3  # flat in N
    assert worst[64][1] > 4 * worst[64][0]  # the ring's error grew with its hops


def test_reduction_of_non_finite_values_and_fp8_overflow():
    ones = np.ones(2 * B, np.float32)
    poisoned = ones.copy()
    poisoned[7] = np.inf
    got, _ = _reduce([ones, poisoned], encode_q8, lambda w: decode_q8(w, 2 * B),
                     quant.add_int8, mean=False)
    assert np.isnan(got[:B]).all()  # int8: the block is NaN, the next one is not
    assert np.abs(got[B:] - 2).max() <= 2 * 2.0 ** -16
    for fmt, big in ((E4M3, 300.0), (E5M2, 40000.0)):
        x = f32([big, -big, 1.0, np.inf])
        got, _ = _reduce([x] * 4, lambda v, f=fmt: encode8(v, f), lambda w, f=fmt: decode8(w, f),
                         lambda acc, w, f=fmt: quant.add_fp8(acc, w, f), mean=False)
        # Each contribution is in range, their sum is not: it overflows, with its sign.
        assert got[2] == 4.0
        if fmt is E5M2:
            assert got[[0, 1, 3]].tolist() == [np.inf, -np.inf, np.inf]
        else:
            assert np.isnan(got[[0, 1, 3]]).all()
            assert not np.signbit(got[[0, 1, 3]]).any()  # every NaN positive


def test_c_quant_kernels_are_built_and_current_where_a_compiler_is():
    """setup.py builds reducer_wire._quant optionally: a failed or stale build
    would only make the 8-bit wires slower, so fail here (`make build`)."""
    import shutil
    from pathlib import Path

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: NumPy does the 8-bit formats")
    kernels = quant.kernels()
    assert kernels is not None, "reducer_wire._quant is missing: run `make build`"
    built = Path(kernels.__file__)
    for name in ("_quant.c", "_quant_int8.c", "_quant_fp8.c", "_quant.h"):
        source = Path(quant.__file__).with_name(name)
        assert built.stat().st_mtime >= source.stat().st_mtime, (
            f"{built.name} is older than {name}: run `make build`")


# -- the daemon's table and shard checks, the client's layout, on the 8-bit wires -------

@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("op", [pb.REDUCE_OP_SUM, pb.REDUCE_OP_MEAN])
def test_daemon_table_reduces_8bit_contributions_as_the_kernels_do(name, op):
    """reducerd.core.reduction decodes, adds in float32, divides (MEAN) and encodes
    once: the same bytes as the kernels' reduction above."""
    from reducer_wire import convert

    from reducerd.core.reduction import ChunkId, Contribution, ReductionTable

    dtype = dtypes.WIRE_DTYPES[name]
    numel, world = 3 * B + 5, 5
    rng = np.random.default_rng(world)
    inputs = [f32(rng.standard_normal(numel) * 20) for _ in range(world)]
    wires = [convert.to_wire(x, dtype).tobytes() for x in inputs]
    table, cid = ReductionTable(60, 1 << 30), ChunkId("job", "k", 0, 0)
    deliveries = []
    for rank, data in enumerate(wires):
        deliveries += table.contribute(cid, Contribution(rank, world, dtype, op, data), rank)
    (done,) = deliveries
    acc = np.empty(numel, np.float32)
    convert.from_wire(wires[0], dtype, acc)
    for data in wires[1:]:
        quant.add(acc, data, dtype)
    if op == pb.REDUCE_OP_MEAN:
        acc /= np.float32(world)
    assert bytes(done.data) == convert.to_wire(acc, dtype).tobytes()
    assert len(done.data) == dtypes.wire_nbytes(dtype, numel)


def test_daemon_refuses_int8_lengths_no_chunk_has():
    from reducer_wire.codec import ShardView

    from reducerd.service.session import check_shard

    def shard(nbytes, dtype=pb.DTYPE_INT8_BLOCK128):
        return ShardView(job="j", key="k", world_size=2, dtype=dtype,
                         data=memoryview(bytes(nbytes)))

    assert check_shard(shard(B + 4)) == "" and check_shard(shard(5)) == ""
    assert "not a whole number of int8 elements" in check_shard(shard(B + 6))
    assert "not a whole number" in check_shard(shard(3))
    assert check_shard(shard(7, pb.DTYPE_FP8_E4M3)) == ""


@pytest.mark.parametrize("numel", [1, B - 1, B + 1, 1000 * B + 77])
@pytest.mark.parametrize("daemons", [1, 3])
def test_client_chunks_hold_whole_blocks(numel, daemons):
    from reducer_wire.layout import plan_wire_chunks

    dtype = pb.DTYPE_INT8_BLOCK128
    chunk_bytes = 64 << 10
    chunks = plan_wire_chunks(numel, dtype, daemons, chunk_bytes, key="grad")
    assert sum(c.numel for c in chunks) == numel
    assert [c.offset for c in chunks] == [sum(c.numel for c in chunks[:i])
                                          for i in range(len(chunks))]
    assert all(c.offset % B == 0 for c in chunks)  # blocks line up with the key's
    assert all(c.numel % B == 0 for c in chunks[:-1])
    assert all(dtypes.wire_nbytes(dtype, c.numel) <= chunk_bytes for c in chunks)
    sizes = [-(-c.numel // B) for c in chunks]
    assert max(sizes) - min(sizes) <= 1  # balanced to within one block
    fp8 = plan_wire_chunks(numel, pb.DTYPE_FP8_E4M3, daemons, chunk_bytes, key="grad")
    assert sum(c.numel for c in fp8) == numel and all(c.numel <= chunk_bytes for c in fp8)


def test_bench_offers_every_wire_dtype_and_counts_scales():
    from reducerd.bench.config import WIRE_DTYPE_NAMES, wire_nbytes

    assert set(WIRE_DTYPE_NAMES) == set(dtypes.WIRE_DTYPES)
    numel = (16 << 20) // 4  # 16 MiB of float32
    assert wire_nbytes("int8", numel) == numel + 4 * numel // B  # 1.031 bytes per element
    assert wire_nbytes("fp8_e5m2", numel) == numel and wire_nbytes("float16", numel) == 2 * numel
