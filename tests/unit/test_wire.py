"""Wire conversions: bfloat16 bit tricks against an independent oracle."""

import numpy as np
import pytest
from reducer_wire import convert
from reducer_wire._proto.reducer.v1 import reducer_pb2 as pb

from reducerd.core import accumulate

BF16 = pb.DTYPE_BFLOAT16


def _bits(values):
    return np.array(values, dtype=np.float32).view(np.uint32)


def _bf16_reference(values):
    """Round float32 to bfloat16 in exact integer arithmetic (Python ints)."""
    out = []
    for bits in _bits(values).tolist():
        if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
            out.append(((bits >> 16) | 0x40) & 0xFFFF)  # NaN stays NaN
            continue
        upper, lower = bits >> 16, bits & 0xFFFF
        if lower > 0x8000 or (lower == 0x8000 and upper & 1):
            upper += 1
        out.append(upper & 0xFFFF)
    return np.array(out, dtype=np.uint16)


def test_bfloat16_rounds_to_nearest_even():
    one = 0x3F800000
    cases = np.array([one, one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001,
                      0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80008000],
                     dtype=np.uint32).view(np.float32)
    got = convert.bfloat16_bits_from_float32(cases)
    assert got.tolist() == _bf16_reference(cases).tolist()
    # ties: 1 + 2^-8 (exactly half an ulp) rounds down to even 1.0, 1 + 3*2^-8 up
    assert got[1] == 0x3F80 and got[2] == 0x3F82
    assert got[5] == 0x7F80 and got[6] == 0xFF80  # overflow to +-inf


def test_bfloat16_specials():
    values = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0], dtype=np.float32)
    nan_low = np.array([0x7F800001], dtype=np.uint32).view(np.float32)  # NaN with low bits only
    got = convert.bfloat16_bits_from_float32(np.concatenate([values, nan_low]))
    back = np.empty(got.size, dtype=np.float32)
    convert.from_wire(got.tobytes(), BF16, back)
    assert back[0] == np.inf and back[1] == -np.inf
    assert np.isnan(back[2]) and np.isnan(back[5])
    assert np.signbit(back[3]) and back[4] == 0


def test_bfloat16_random_matches_reference_and_ml_dtypes():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(20_000) * 10.0 ** rng.integers(-30, 30, 20_000)
              ).astype(np.float32)
    got = convert.bfloat16_bits_from_float32(values)
    assert np.array_equal(got, _bf16_reference(values))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert np.array_equal(got, values.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, BF16, pb.DTYPE_FLOAT32])
@pytest.mark.parametrize("out_dtype", [np.float16, np.float32, np.float64])
def test_round_trip_of_representable_values_is_exact(dtype, out_dtype):
    # Small integers are exact in every wire dtype and output dtype.
    values = np.arange(-100, 100, dtype=np.float32)
    encoded = convert.to_wire(values, dtype)
    out = np.empty(values.size, dtype=out_dtype)
    convert.from_wire(encoded.tobytes(), dtype, out)
    assert np.array_equal(out, values.astype(out_dtype))


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, BF16, pb.DTYPE_FLOAT32])
def test_add_accumulates_in_float32(dtype):
    # 2048 + 1 + 1 ... : float16 alone would stall at 2048 (ulp 2 there).
    acc = np.empty(4, dtype=np.float32)
    accumulate.copy_wire_into(acc, convert.to_wire(np.full(4, 2048.0), dtype).tobytes(), dtype)
    one = convert.to_wire(np.ones(4), dtype).tobytes()
    scratch = np.empty(16, dtype=np.float32)
    for _ in range(10):
        accumulate.add_wire_into(acc, one, dtype, scratch)
    assert acc.tolist() == [2058.0] * 4
    assert np.float16(2048) + np.float16(1) == np.float16(2048)  # what a float16 ring does


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, BF16])
def test_add_into_an_unaligned_accumulator_takes_numpy_and_sums_right(dtype):
    """The C kernels need a 4-byte aligned accumulator (they refuse another);
    add_wire_into checks the array's alignment and sums an odd one in NumPy."""
    acc = np.frombuffer(bytearray(4 * 8 + 1), np.float32, count=8, offset=1)
    assert not acc.flags.aligned
    acc[...] = 1.5
    accumulate.add_wire_into(acc, convert.to_wire(np.arange(8.0), dtype).tobytes(), dtype)
    assert acc.tolist() == [1.5 + i for i in range(8)]


def test_float16_widening_matches_numpy_for_every_value():
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(bits.size, dtype=np.float32)
    convert.float16_bits_to_float32(bits, got)
    expected = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()


def test_float16_narrowing_matches_numpy_bit_for_bit():
    rng = np.random.default_rng(5)
    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = every_half[np.isfinite(every_half)]
    halfway = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    cases = np.concatenate([
        rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        every_half, halfway, (rng.standard_normal(200_000) * 1e-5).astype(np.float32),
        np.array([65504, 65519.99, 65520, 65536, 1e9, -1e9, 2.98e-8, 2.9802322e-08],
                 dtype=np.float32)])
    got = np.empty(cases.size, dtype=np.uint16)
    convert.float32_to_float16_bits(cases, got)
    with np.errstate(all="ignore"):
        expected = cases.astype(np.float16).view(np.uint16)
    nan = np.isnan(cases)
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


# -- the C conversions (reducer_wire._kernels) against the NumPy ones ----------

ISAS = ["avx512", "f16c", "portable"]


def _use_isa(name):
    """Switch the C kernels to instruction set `name`; skip where the CPU lacks it."""
    kernels = pytest.importorskip("reducer_wire._kernels")
    if kernels.set_isa(name) != name:
        kernels.set_isa("best")
        pytest.skip(f"this CPU has no {name}")
    return kernels


@pytest.fixture(params=["numpy", *ISAS])
def codec(request):
    """Run a test with each implementation of to_wire / from_wire / add_wire_into:
    NumPy, and the C kernels with each instruction set the CPU has."""
    if request.param == "numpy":
        previous = convert.use_accelerator(False)
        yield request.param
        convert.use_accelerator(previous)
        return
    kernels = _use_isa(request.param)
    previous = convert.use_accelerator(True)
    yield request.param
    kernels.set_isa("best")
    convert.use_accelerator(previous)


def _awkward_float32(rng, count):
    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = every_half[np.isfinite(every_half)]
    halfway = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    return np.concatenate([
        rng.integers(0, 1 << 32, count, dtype=np.uint64).astype(np.uint32).view(np.float32),
        every_half, halfway, np.array([65504, 65520, 65536, 1e-8, 3e-8, -0.0],
                                      dtype=np.float32)])


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, BF16])
def test_every_codec_narrows_to_the_same_bits(codec, dtype):
    values = _awkward_float32(np.random.default_rng(11), 1_000_003)
    got = convert.to_wire(values, dtype).view(np.uint16)
    if dtype == BF16:
        expected = _bf16_reference(values[:50_000])
        assert np.array_equal(got[:50_000], expected)
        assert (got != (values.view(np.uint32) >> 16)).any()  # some values rounded up
    with np.errstate(all="ignore"):
        reference = (values.astype(np.float16).view(np.uint16) if dtype == pb.DTYPE_FLOAT16
                     else convert.bfloat16_bits_from_float32(values))
    nan = np.isnan(values)
    assert np.array_equal(got[~nan], reference[~nan])
    if dtype == pb.DTYPE_FLOAT16:  # one canonical quiet NaN, sign kept
        assert np.array_equal(got[nan], np.where(np.signbit(values[nan]), 0xFE00, 0x7E00))


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, BF16])
@pytest.mark.parametrize("misalign", [0, 1])
def test_every_codec_widens_and_adds_every_pattern_exactly(codec, dtype, misalign):
    bits = np.arange(1 << 16, dtype=np.uint16)
    message = bytes(misalign) + bits.tobytes()  # shard data sits anywhere in a message
    data = memoryview(message)[misalign:]
    got = np.empty(bits.size, dtype=np.float32)
    convert.from_wire(data, dtype, got)
    expected = (bits.view(np.float16).astype(np.float32) if dtype == pb.DTYPE_FLOAT16
                else (bits.astype(np.uint32) << 16).view(np.float32))
    nan = np.isnan(expected)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
    acc = np.random.default_rng(3).standard_normal(bits.size).astype(np.float32)
    want = acc.copy()
    with np.errstate(all="ignore"):
        want += expected
    with np.errstate(all="ignore"):
        accumulate.add_wire_into(acc, data, dtype, np.empty(bits.size, dtype=np.float32))
    assert np.array_equal(acc[~nan], want[~nan])
    assert np.isnan(acc[nan]).all()


def test_c_codec_rejects_buffers_of_different_lengths():
    fastwire = pytest.importorskip("reducer_wire._kernels")
    with pytest.raises(ValueError, match="same number"):
        fastwire.f32_to_f16(np.ones(4, np.float32), np.empty(3, np.uint16))
    with pytest.raises(ValueError, match="same number"):
        fastwire.f16_add(np.ones(4, np.float32), np.ones(5, np.float16))
    with pytest.raises(TypeError):
        fastwire.f16_to_f32(np.ones(4, np.float16), b"read-only destination")


def _numpy_f16_bits(values):
    """NumPy's float16 cast with the wire's NaN: 0x7E00 with the sign."""
    with np.errstate(all="ignore"):
        bits = values.astype(np.float16).view(np.uint16)
    nan = np.isnan(values)
    return np.where(nan, np.where(np.signbit(values), 0xFE00, 0x7E00), bits).astype(np.uint16)


def _nan_patterns(rng, count):
    """float32 NaNs of every kind: quiet and signalling, both signs, payloads
    in the bits vcvtps2ph keeps and in those it drops."""
    payload = rng.integers(1, 1 << 23, count, dtype=np.uint32)
    sign = rng.integers(0, 2, count, dtype=np.uint32) << np.uint32(31)
    bits = sign | np.uint32(0x7F800000) | payload
    special = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF802000], np.uint32)
    bits[:4] = special[:count]
    return bits.view(np.float32)


@pytest.mark.parametrize("isa", ISAS)
def test_narrowing_fixes_every_nan_lane_in_every_vector_group(isa):
    """A NaN in any lane of a 32-element group (the SIMD loops test a whole
    group at once and fix up only groups with a NaN) becomes 0x7E00 | sign,
    and the numbers in the same group are not disturbed; every length of tail."""
    kernels = _use_isa(isa)
    rng = np.random.default_rng(7)
    try:
        for n in (*range(0, 70), 95, 96, 97, 1000):
            values = (rng.standard_normal(n) * 1000).astype(np.float32)
            if n:
                lanes = rng.integers(0, n, max(1, n // 16))
                values[lanes] = _nan_patterns(rng, lanes.size)
            for offset in (0, 4, 2):  # aligned, 4-byte aligned, odd 2-byte offsets
                raw = bytearray(4 * n + 8)
                src = np.frombuffer(raw, np.float32, n, offset) if offset % 4 == 0 else \
                    np.frombuffer(memoryview(raw)[offset:offset + 4 * n], np.float32)
                src[...] = values
                out = bytearray(2 * n + 3)
                dst = memoryview(out)[1:1 + 2 * n]  # odd address
                kernels.f32_to_f16(src, dst)
                got = np.frombuffer(dst, np.uint16)
                assert np.array_equal(got, _numpy_f16_bits(values)), (n, offset)
        every_lane = np.ones((32, 32), np.float32)
        every_lane[np.arange(32), np.arange(32)] = np.float32("nan")  # NaN in lane i of row i
        flat = every_lane.reshape(-1)
        got = np.empty(flat.size, np.uint16)
        kernels.f32_to_f16(flat, got)
        assert np.array_equal(got, _numpy_f16_bits(flat))
    finally:
        kernels.set_isa("best")


@pytest.mark.parametrize("isa", ISAS)
def test_widening_and_adding_every_length_and_alignment(isa):
    kernels = _use_isa(isa)
    rng = np.random.default_rng(8)
    try:
        for n in (*range(0, 70), 95, 96, 97, 1000):
            bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
            expected = bits.view(np.float16).astype(np.float32)
            nan = np.isnan(expected)
            for offset in (0, 1, 2):
                message = bytearray(offset) + bits.tobytes()
                src = memoryview(message)[offset:]
                out = np.zeros(n + 1, np.float32)[1:]  # 4 bytes past a 64-byte boundary
                kernels.f16_to_f32(src, out)
                assert np.array_equal(out[~nan].view(np.uint32),
                                      expected[~nan].view(np.uint32)), (n, offset)
                assert np.isnan(out[nan]).all()
                acc = rng.standard_normal(n + 3).astype(np.float32)[3:]
                want = acc.copy()
                with np.errstate(all="ignore"):
                    want += expected
                kernels.f16_add(acc, src)
                assert np.array_equal(acc[~nan], want[~nan]), (n, offset)
                assert np.isnan(acc[nan]).all()
    finally:
        kernels.set_isa("best")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["f16_to_f32", "bf16_to_f32"])
def test_streaming_widening_writes_the_plain_widenings_bits_and_nothing_else(isa, name):
    """The streaming-store variants (a large output not read again soon) give
    the same bits for every pattern, at every length and output alignment
    (the head up to a cache line, the tail), and write nothing outside."""
    kernels = _use_isa(isa)
    plain, streaming = getattr(kernels, name), getattr(kernels, name + "_stream")
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    try:
        for n in (0, 1, 15, 31, 32, 33, 95, 1000, every.size):
            bits = every[:n] if n < every.size else every
            expected = np.empty(n, np.float32)
            plain(bits, expected)
            for offset in (0, 1, 5, 15, 16):  # elements past a 64-byte boundary
                space = np.full(n + 48, 7.0, np.float32)
                start = offset + (-space.ctypes.data // 4) % 16
                streaming(bits, space[start:start + n])
                assert np.array_equal(space[start:start + n].view(np.uint32),
                                      expected.view(np.uint32)), (n, offset)
                assert (space[:start] == 7.0).all() and (space[start + n:] == 7.0).all()
    finally:
        kernels.set_isa("best")


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, BF16])
def test_from_wire_streams_only_when_asked_and_gives_the_same_values(codec, dtype):
    bits = np.random.default_rng(5).integers(0, 1 << 16, 100_003, dtype=np.uint32)
    data = bits.astype(np.uint16).tobytes()
    plain, streamed = np.empty(bits.size, np.float32), np.empty(bits.size, np.float32)
    convert.from_wire(data, dtype, plain)
    convert.from_wire(data, dtype, streamed, stream=True)
    assert np.array_equal(plain.view(np.uint32), streamed.view(np.uint32))
    as_float64 = np.empty(bits.size, np.float64)  # not the C path's output: a hint only
    convert.from_wire(data, dtype, as_float64, stream=True)
    assert np.array_equal(as_float64, plain.astype(np.float64), equal_nan=True)


def test_kernels_use_the_widest_instructions_the_cpu_has():
    """Runtime dispatch: AVX-512 where the CPU has it, else F16C (never the
    portable loop on an x86-64 CPU with F16C)."""
    kernels = pytest.importorskip("reducer_wire._kernels")
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    expected = ("avx512" if "avx512f" in flags else
                "f16c" if {"avx", "f16c"} <= flags else "portable")
    assert kernels.set_isa("best") == expected == kernels.isa()
    with pytest.raises(ValueError, match="one of"):
        kernels.set_isa("sse9")


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16,
                                   pb.DTYPE_INT8_BLOCK128, pb.DTYPE_FP8_E4M3])
@pytest.mark.parametrize("accelerated", [True, False], ids=["c", "numpy"])
def test_a_non_contiguous_out_is_refused_not_silently_left_unwritten(dtype, accelerated):
    """to_wire(out=a strided view): reshaping it would copy, and the elements
    would be written into the copy (the caller's buffer kept its zeros). A
    strided input is fine: it is read, not written."""
    values = np.linspace(-1, 1, 300, dtype=np.float32)
    nbytes = convert.wire_nbytes(dtype, values.size)
    previous = convert.use_accelerator(accelerated)
    try:
        strided = np.zeros((nbytes, 2), np.uint8)[:, 0]
        with pytest.raises(ValueError, match="C-contiguous"):
            convert.to_wire(values, dtype, out=strided)
        assert not strided.any()
        out = np.zeros(nbytes, np.uint8)
        wide = np.repeat(values, 2)[::2]  # a strided input
        assert np.shares_memory(convert.to_wire(wide, dtype, out=out), out)
        assert np.array_equal(out, convert.to_wire(values, dtype).view(np.uint8))
    finally:
        convert.use_accelerator(previous)


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16])
@pytest.mark.parametrize("accelerated", [True, False], ids=["c", "numpy"])
def test_from_wire_refuses_a_payload_of_another_length(dtype, accelerated):
    """One wire element into an output of three was broadcast (float32, and the
    NumPy path of the 16-bit dtypes): a wrong length must be an error."""
    one = convert.to_wire(np.ones(1, np.float32), dtype)
    previous = convert.use_accelerator(accelerated)
    try:
        out = np.zeros(3, np.float32)
        with pytest.raises(ValueError):
            convert.from_wire(one, dtype, out)
        assert not out.any()
    finally:
        convert.use_accelerator(previous)
