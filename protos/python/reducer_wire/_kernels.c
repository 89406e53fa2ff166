/* Wire conversions in C: float16 / bfloat16 <-> float32, and the daemon's
 * widen-and-add, without the GIL.
 *
 * NumPy does these in a dozen whole-array passes (convert.py), about 1 ns per
 * element: on both ends that was more CPU than the sums and the I/O together.
 * Here each element is touched once. x86-64 CPUs use their conversion
 * instructions: AVX-512F (16 elements at a time) where the CPU has it, else
 * F16C (8 at a time), chosen at run time; everywhere else the same integer
 * algorithm as convert.py runs element by element. Every function gives
 * the same bits as convert.py's NumPy code (tests/unit/test_wire.py checks all
 * float16 patterns and millions of float32 ones), so results do not depend
 * on which ends have the extension:
 *   - float32 -> float16 rounds to nearest even; overflow gives +-inf; every
 *     NaN becomes the quiet NaN 0x7E00 with its sign;
 *   - float32 -> bfloat16 rounds to nearest even; NaN keeps its upper bits
 *     and is made quiet (| 0x40);
 *   - widening is exact (float16 NaN payloads move up as IEEE says).
 * Buffers may be unaligned (shard data sits anywhere in a received message).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_fpmode.h"
#include "_api.h"
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define HAVE_SIMD_PATHS 1
#include <immintrin.h>
#endif

/* ---- portable element-wise conversions (the algorithm of convert.py) ---- */

static inline uint32_t load_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t load_u16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float load_f32(const char *p) { float v; memcpy(&v, p, 4); return v; }
static inline void store_u16(char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void store_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }

static inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint16_t half_from_float_bits(uint32_t bits) {
    uint32_t sign = (bits >> 16) & 0x8000u;
    uint32_t magnitude = bits & 0x7FFFFFFFu;
    uint32_t out;
    if (magnitude >= ((127u + 16u) << 23)) {          /* overflow, inf, NaN */
        out = magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u;
    } else if (magnitude < (113u << 23)) {            /* float16 subnormal or zero */
        /* Adding the magic float aligns the 10 mantissa bits at the bottom;
         * the float32 addition rounds to nearest even. */
        const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
        out = float_to_bits(bits_to_float(magnitude) + bits_to_float(magic)) - magic;
    } else {
        uint32_t odd = (magnitude >> 13) & 1u;
        out = (magnitude + ((uint32_t)(15 - 127) << 23) + 0xFFFu + odd) >> 13;
    }
    return (uint16_t)(out | sign);
}

static inline float float_from_half_bits(uint16_t half) {
    uint32_t u = ((uint32_t)half & 0x7FFFu) << 13;
    float f = bits_to_float(u) * 0x1p112f;  /* fixes the exponent, normalises subnormals */
    u = float_to_bits(f);
    if (f >= 65536.0f) u |= 0x7F800000u;     /* was inf or NaN */
    return bits_to_float(u | ((uint32_t)(half & 0x8000u) << 16));
}

static inline uint16_t bfloat_from_float_bits(uint32_t bits) {
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu))
        return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static void f32_to_f16_generic(const char *src, char *dst, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        store_u16(dst + 2 * i, half_from_float_bits(load_u32(src + 4 * i)));
}

static void f16_to_f32_generic(const char *src, char *dst, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float f = float_from_half_bits(load_u16(src + 2 * i));
        memcpy(dst + 4 * i, &f, 4);
    }
}

static void f16_add_generic(float *acc, const char *src, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        acc[i] += float_from_half_bits(load_u16(src + 2 * i));
}

/* ---- SIMD paths: F16C (8 lanes) and AVX-512F (16 lanes) ----
 *
 * Each function carries its own target attribute and is called only after
 * __builtin_cpu_supports said yes, so the module is built without global -m
 * flags and still runs on CPUs without these instructions.
 *
 * Narrowing: vcvtps2ph rounds to nearest even and overflows to infinity as
 * the wire wants, but keeps a NaN's payload, while the wire has one NaN per
 * sign (0x7E00 | sign, as NumPy's cast). Each group of vectors is tested for
 * NaN with one compare per vector and one mask test per group; only a group
 * with a NaN takes the fix-up (the lane becomes sign | quiet NaN with no
 * payload, which vcvtps2ph turns into 0x7E00 | sign). Numbers pay two
 * instructions per vector, no blend. (gcc 12 turned the former blendv into
 * per-lane branches: 2-8x slower than the bare instruction.)
 *
 * Loads and stores are unaligned (shard data sits anywhere in a message);
 * where the float32 side can be aligned to a cache line by a short scalar
 * head, it is, so that no 64-byte load is split across two lines. */

#ifdef HAVE_SIMD_PATHS
/* Elements to do one by one so that `p` (4-byte aligned) reaches a 64-byte boundary. */
static inline Py_ssize_t head_to_align(const void *p, Py_ssize_t n) {
    uintptr_t a = (uintptr_t)p;
    if (a % 4) return 0;  /* cannot be aligned by whole elements */
    Py_ssize_t k = (Py_ssize_t)(((64 - a % 64) % 64) / 4);
    return k < n ? k : n;
}

__attribute__((target("avx,f16c")))
static inline __m256 canonical_nan_256(__m256 x, __m256 nan) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    __m256 canon = _mm256_or_ps(_mm256_and_ps(x, sign), quiet);
    return _mm256_or_ps(_mm256_andnot_ps(nan, x), _mm256_and_ps(nan, canon));
}

__attribute__((target("avx,f16c")))
static void f32_to_f16_f16c(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = head_to_align(src, n);
    f32_to_f16_generic(src, dst, i);
    for (; i + 32 <= n; i += 32) {
        const float *s = (const float *)(src + 4 * i);
        __m256 a = _mm256_loadu_ps(s), b = _mm256_loadu_ps(s + 8);
        __m256 c = _mm256_loadu_ps(s + 16), d = _mm256_loadu_ps(s + 24);
        __m256 na = _mm256_cmp_ps(a, a, _CMP_UNORD_Q), nb = _mm256_cmp_ps(b, b, _CMP_UNORD_Q);
        __m256 nc = _mm256_cmp_ps(c, c, _CMP_UNORD_Q), nd = _mm256_cmp_ps(d, d, _CMP_UNORD_Q);
        if (__builtin_expect(_mm256_movemask_ps(
                _mm256_or_ps(_mm256_or_ps(na, nb), _mm256_or_ps(nc, nd))), 0)) {
            a = canonical_nan_256(a, na);
            b = canonical_nan_256(b, nb);
            c = canonical_nan_256(c, nc);
            d = canonical_nan_256(d, nd);
        }
        __m128i *h = (__m128i *)(dst + 2 * i);
        _mm_storeu_si128(h, _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(h + 1, _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(h + 2, _mm256_cvtps_ph(c, _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(h + 3, _mm256_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT));
    }
    f32_to_f16_generic(src + 4 * i, dst + 2 * i, n - i);
}

__attribute__((target("avx,f16c")))
static void f16_to_f32_f16c(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = head_to_align(dst, n);
    f16_to_f32_generic(src, dst, i);
    for (; i + 32 <= n; i += 32) {
        const __m128i *h = (const __m128i *)(src + 2 * i);
        float *d = (float *)(dst + 4 * i);
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(h)), b = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
        __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(h + 2)), e = _mm256_cvtph_ps(_mm_loadu_si128(h + 3));
        _mm256_storeu_ps(d, a);
        _mm256_storeu_ps(d + 8, b);
        _mm256_storeu_ps(d + 16, c);
        _mm256_storeu_ps(d + 24, e);
    }
    f16_to_f32_generic(src + 2 * i, dst + 4 * i, n - i);
}

__attribute__((target("avx,f16c")))
static void f16_add_f16c(float *acc, const char *src, Py_ssize_t n) {
    Py_ssize_t i = head_to_align(acc, n);
    f16_add_generic(acc, src, i);
    for (; i + 32 <= n; i += 32) {
        const __m128i *h = (const __m128i *)(src + 2 * i);
        float *d = acc + i;
        __m256 a = _mm256_add_ps(_mm256_loadu_ps(d), _mm256_cvtph_ps(_mm_loadu_si128(h)));
        __m256 b = _mm256_add_ps(_mm256_loadu_ps(d + 8), _mm256_cvtph_ps(_mm_loadu_si128(h + 1)));
        __m256 c = _mm256_add_ps(_mm256_loadu_ps(d + 16), _mm256_cvtph_ps(_mm_loadu_si128(h + 2)));
        __m256 e = _mm256_add_ps(_mm256_loadu_ps(d + 24), _mm256_cvtph_ps(_mm_loadu_si128(h + 3)));
        _mm256_storeu_ps(d, a);
        _mm256_storeu_ps(d + 8, b);
        _mm256_storeu_ps(d + 16, c);
        _mm256_storeu_ps(d + 24, e);
    }
    f16_add_generic(acc + i, src + 2 * i, n - i);
}

__attribute__((target("avx512f")))
static inline __m512 canonical_nan_512(__m512 x, __mmask16 nan) {
    /* (x & sign) | quiet, in the NaN lanes only: one ternary-logic op, one masked move. */
    __m512i canon = _mm512_ternarylogic_epi32(_mm512_castps_si512(x),
                                              _mm512_set1_epi32((int)0x80000000u),
                                              _mm512_set1_epi32(0x7FC00000), 0xEA);
    return _mm512_mask_mov_ps(x, nan, _mm512_castsi512_ps(canon));
}

__attribute__((target("avx512f")))
static void f32_to_f16_avx512(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = head_to_align(src, n);
    f32_to_f16_generic(src, dst, i);
    for (; i + 32 <= n; i += 32) {
        const float *s = (const float *)(src + 4 * i);
        __m512 a = _mm512_loadu_ps(s), b = _mm512_loadu_ps(s + 16);
        __mmask16 na = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        __mmask16 nb = _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
        if (__builtin_expect((na | nb) != 0, 0)) {
            a = canonical_nan_512(a, na);
            b = canonical_nan_512(b, nb);
        }
        __m256i *h = (__m256i *)(dst + 2 * i);
        _mm256_storeu_si256(h, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
        _mm256_storeu_si256(h + 1, _mm512_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
    }
    f32_to_f16_generic(src + 4 * i, dst + 2 * i, n - i);
}

__attribute__((target("avx512f")))
static void f16_to_f32_avx512(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = head_to_align(dst, n);
    f16_to_f32_generic(src, dst, i);
    for (; i + 32 <= n; i += 32) {
        const __m256i *h = (const __m256i *)(src + 2 * i);
        float *d = (float *)(dst + 4 * i);
        _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(h)));
        _mm512_storeu_ps(d + 16, _mm512_cvtph_ps(_mm256_loadu_si256(h + 1)));
    }
    f16_to_f32_generic(src + 2 * i, dst + 4 * i, n - i);
}

__attribute__((target("avx512f")))
static void f16_add_avx512(float *acc, const char *src, Py_ssize_t n) {
    Py_ssize_t i = head_to_align(acc, n);
    f16_add_generic(acc, src, i);
    for (; i + 32 <= n; i += 32) {
        const __m256i *h = (const __m256i *)(src + 2 * i);
        float *d = acc + i;
        __m512 a = _mm512_add_ps(_mm512_loadu_ps(d), _mm512_cvtph_ps(_mm256_loadu_si256(h)));
        __m512 b = _mm512_add_ps(_mm512_loadu_ps(d + 16),
                                 _mm512_cvtph_ps(_mm256_loadu_si256(h + 1)));
        _mm512_storeu_ps(d, a);
        _mm512_storeu_ps(d + 16, b);
    }
    f16_add_generic(acc + i, src + 2 * i, n - i);
}

/* Widening with streaming (non-temporal) stores, for a large output that is
 * not read again soon (a reply widened into the caller's gradient): the
 * cache lines are written whole without being read first, so a float32
 * output costs its bytes once, not twice (measured 1.8x faster into a cold
 * 64 MiB output). The same bits as the plain widening; sfence before
 * returning, so another thread that learns of the result sees the stores. */
/* Elements of a float32 `dst` to write one by one before it reaches a cache
 * line (streaming stores need aligned lines), or -1 where it cannot: then
 * the caller takes plain stores for all of it. */
static inline Py_ssize_t stream_head(const char *dst, Py_ssize_t n) {
    Py_ssize_t i = head_to_align(dst, n);
    return (uintptr_t)(dst + 4 * i) % 64 ? -1 : i;
}

__attribute__((target("avx,f16c")))
static void f16_to_f32_stream_f16c(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = stream_head(dst, n);
    if (i < 0) {
        f16_to_f32_f16c(src, dst, n);
        return;
    }
    f16_to_f32_generic(src, dst, i);
    for (; i + 32 <= n; i += 32) {
        const __m128i *h = (const __m128i *)(src + 2 * i);
        float *d = (float *)(dst + 4 * i);
        _mm256_stream_ps(d, _mm256_cvtph_ps(_mm_loadu_si128(h)));
        _mm256_stream_ps(d + 8, _mm256_cvtph_ps(_mm_loadu_si128(h + 1)));
        _mm256_stream_ps(d + 16, _mm256_cvtph_ps(_mm_loadu_si128(h + 2)));
        _mm256_stream_ps(d + 24, _mm256_cvtph_ps(_mm_loadu_si128(h + 3)));
    }
    _mm_sfence();
    f16_to_f32_generic(src + 2 * i, dst + 4 * i, n - i);
}

__attribute__((target("avx512f")))
static void f16_to_f32_stream_avx512(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = stream_head(dst, n);
    if (i < 0) {
        f16_to_f32_avx512(src, dst, n);
        return;
    }
    f16_to_f32_generic(src, dst, i);
    for (; i + 32 <= n; i += 32) {
        const __m256i *h = (const __m256i *)(src + 2 * i);
        float *d = (float *)(dst + 4 * i);
        _mm512_stream_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(h)));
        _mm512_stream_ps(d + 16, _mm512_cvtph_ps(_mm256_loadu_si256(h + 1)));
    }
    _mm_sfence();
    f16_to_f32_generic(src + 2 * i, dst + 4 * i, n - i);
}

static void bf16_to_f32(const char *src, char *dst, Py_ssize_t n);

__attribute__((target("avx512f")))
static void bf16_to_f32_stream_avx512(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = stream_head(dst, n);
    if (i < 0) {
        bf16_to_f32(src, dst, n);
        return;
    }
    bf16_to_f32(src, dst, i);
    for (; i + 32 <= n; i += 32) {
        const __m256i *h = (const __m256i *)(src + 2 * i);
        __m512i *d = (__m512i *)(dst + 4 * i);
        _mm512_stream_si512(d, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(h)), 16));
        _mm512_stream_si512(d + 1, _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(h + 1)), 16));
    }
    _mm_sfence();
    bf16_to_f32(src + 2 * i, dst + 4 * i, n - i);
}

/* The bare instruction, NaN payloads kept: not a wire conversion, only the
 * baseline scripts/wire_speed.py compares f32_to_f16 with. */
__attribute__((target("avx,f16c")))
static void f32_to_f16_bare_f16c(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * i),
                         _mm256_cvtps_ph(_mm256_loadu_ps((const float *)(src + 4 * i)),
                                         _MM_FROUND_TO_NEAREST_INT));
    f32_to_f16_generic(src + 4 * i, dst + 2 * i, n - i);
}

__attribute__((target("avx512f")))
static void f32_to_f16_bare_avx512(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + 2 * i),
                            _mm512_cvtps_ph(_mm512_loadu_ps((const float *)(src + 4 * i)),
                                            _MM_FROUND_TO_NEAREST_INT));
    f32_to_f16_generic(src + 4 * i, dst + 2 * i, n - i);
}
#endif

/* The instruction set in use: the best the CPU has, unless set_isa chose less. */
enum isa { ISA_PORTABLE = 0, ISA_F16C = 1, ISA_AVX512 = 2 };
static const char *const isa_names[] = {"portable", "f16c", "avx512"};
static int isa = ISA_PORTABLE;

static int best_isa(void) {
#ifdef HAVE_SIMD_PATHS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")) return ISA_F16C;
#endif
    return ISA_PORTABLE;
}

/* ---- bfloat16: plain integer work that compilers vectorise ---- */

static void f32_to_bf16(const char *src, char *dst, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        store_u16(dst + 2 * i, bfloat_from_float_bits(load_u32(src + 4 * i)));
}

static void bf16_to_f32(const char *src, char *dst, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        store_u32(dst + 4 * i, (uint32_t)load_u16(src + 2 * i) << 16);
}

static void bf16_add(float *acc, const char *src, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        acc[i] += bits_to_float((uint32_t)load_u16(src + 2 * i) << 16);
}

/* ---- the C API (_api.h): the same functions as the bindings below ---- */

static void api_f16_widen(const char *src, float *dst, Py_ssize_t n, Py_ssize_t param) {
    (void)param;
    RW_FP_ENTER;
#ifdef HAVE_SIMD_PATHS
    if (isa == ISA_AVX512) f16_to_f32_avx512(src, (char *)dst, n);
    else if (isa == ISA_F16C) f16_to_f32_f16c(src, (char *)dst, n);
    else
#endif
        f16_to_f32_generic(src, (char *)dst, n);
    RW_FP_LEAVE;
}

static void api_f16_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t param) {
    (void)param;
    RW_FP_ENTER;
#ifdef HAVE_SIMD_PATHS
    if (isa == ISA_AVX512) f16_add_avx512(acc, src, n);
    else if (isa == ISA_F16C) f16_add_f16c(acc, src, n);
    else
#endif
        f16_add_generic(acc, src, n);
    RW_FP_LEAVE;
}

static void api_f16_narrow(const float *src, char *dst, Py_ssize_t n, Py_ssize_t param) {
    (void)param;
    RW_FP_ENTER;
#ifdef HAVE_SIMD_PATHS
    if (isa == ISA_AVX512) f32_to_f16_avx512((const char *)src, dst, n);
    else if (isa == ISA_F16C) f32_to_f16_f16c((const char *)src, dst, n);
    else
#endif
        f32_to_f16_generic((const char *)src, dst, n);
    RW_FP_LEAVE;
}

static void api_bf16_widen(const char *src, float *dst, Py_ssize_t n, Py_ssize_t param) {
    (void)param;
    RW_FP_ENTER;
    bf16_to_f32(src, (char *)dst, n);
    RW_FP_LEAVE;
}

static void api_bf16_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t param) {
    (void)param;
    RW_FP_ENTER;
    bf16_add(acc, src, n);
    RW_FP_LEAVE;
}

static void api_bf16_narrow(const float *src, char *dst, Py_ssize_t n, Py_ssize_t param) {
    (void)param;
    RW_FP_ENTER;
    f32_to_bf16((const char *)src, dst, n);
    RW_FP_LEAVE;
}

static rw_kernels_api c_api = {
    RW_API_VERSION,
    {api_f16_widen, api_f16_add, api_f16_narrow},
    {api_bf16_widen, api_bf16_add, api_bf16_narrow},
};

/* ---- Python bindings ---- */

typedef void (*narrow_fn)(const char *, char *, Py_ssize_t);
typedef void (*add_fn)(float *, const char *, Py_ssize_t);

/* src: n 4-byte floats, dst: n 2-byte slots (narrow) or the reverse (widen). */
static PyObject *convert(PyObject *args, Py_ssize_t src_size, Py_ssize_t dst_size,
                         narrow_fn fn, const char *name) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = src.len / src_size;
    if (src.len % src_size || dst.len != n * dst_size) {
        PyErr_Format(PyExc_ValueError,
                     "%s: source of %zd bytes and destination of %zd bytes do not hold "
                     "the same number of %zd- and %zd-byte elements",
                     name, src.len, dst.len, src_size, dst_size);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    fn((const char *)src.buf, (char *)dst.buf, n);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *accumulate(PyObject *args, add_fn fn, const char *name) {
    Py_buffer acc, src;
    if (!PyArg_ParseTuple(args, "w*y*", &acc, &src))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = acc.len / 4;
    if (acc.len % 4 || src.len != n * 2) {
        PyErr_Format(PyExc_ValueError,
                     "%s: accumulator of %zd bytes and source of %zd bytes do not hold "
                     "the same number of float32 and 2-byte elements", name, acc.len, src.len);
        goto done;
    }
    if ((uintptr_t)acc.buf % 4) {
        PyErr_Format(PyExc_ValueError, "%s: the float32 accumulator is not 4-byte aligned",
                     name);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    fn((float *)acc.buf, (const char *)src.buf, n);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&acc);
    PyBuffer_Release(&src);
    return result;
}

#ifdef HAVE_SIMD_PATHS
/* The function of each instruction set, chosen per call (set_isa may change it). */
static narrow_fn pick_narrow(narrow_fn portable, narrow_fn f16c, narrow_fn avx512) {
#ifdef HAVE_SIMD_PATHS
    if (isa == ISA_AVX512) return avx512;
    if (isa == ISA_F16C) return f16c;
#endif
    return portable;
}
#endif

static PyObject *py_f32_to_f16(PyObject *self, PyObject *args) {
#ifdef HAVE_SIMD_PATHS
    return convert(args, 4, 2, pick_narrow(f32_to_f16_generic, f32_to_f16_f16c,
                                           f32_to_f16_avx512), "f32_to_f16");
#else
    return convert(args, 4, 2, f32_to_f16_generic, "f32_to_f16");
#endif
}

static PyObject *py_f16_to_f32(PyObject *self, PyObject *args) {
#ifdef HAVE_SIMD_PATHS
    return convert(args, 2, 4, pick_narrow(f16_to_f32_generic, f16_to_f32_f16c,
                                           f16_to_f32_avx512), "f16_to_f32");
#else
    return convert(args, 2, 4, f16_to_f32_generic, "f16_to_f32");
#endif
}

static PyObject *py_f16_to_f32_stream(PyObject *self, PyObject *args) {
#ifdef HAVE_SIMD_PATHS
    return convert(args, 2, 4, pick_narrow(f16_to_f32_generic, f16_to_f32_stream_f16c,
                                           f16_to_f32_stream_avx512), "f16_to_f32_stream");
#else
    return convert(args, 2, 4, f16_to_f32_generic, "f16_to_f32_stream");
#endif
}

static PyObject *py_bf16_to_f32_stream(PyObject *self, PyObject *args) {
#ifdef HAVE_SIMD_PATHS
    return convert(args, 2, 4, pick_narrow(bf16_to_f32, bf16_to_f32, bf16_to_f32_stream_avx512),
                   "bf16_to_f32_stream");
#else
    return convert(args, 2, 4, bf16_to_f32, "bf16_to_f32_stream");
#endif
}

static PyObject *py_f16_add(PyObject *self, PyObject *args) {
#ifdef HAVE_SIMD_PATHS
    if (isa == ISA_AVX512) return accumulate(args, f16_add_avx512, "f16_add");
    if (isa == ISA_F16C) return accumulate(args, f16_add_f16c, "f16_add");
#endif
    return accumulate(args, f16_add_generic, "f16_add");
}

static PyObject *py_f32_to_f16_bare(PyObject *self, PyObject *args) {
#ifdef HAVE_SIMD_PATHS
    if (isa == ISA_AVX512) return convert(args, 4, 2, f32_to_f16_bare_avx512, "f32_to_f16_bare");
    if (isa == ISA_F16C) return convert(args, 4, 2, f32_to_f16_bare_f16c, "f32_to_f16_bare");
#endif
    PyErr_SetString(PyExc_RuntimeError, "f32_to_f16_bare: no F16C or AVX-512 in use");
    return NULL;
}

static PyObject *py_f32_to_bf16(PyObject *self, PyObject *args) {
    return convert(args, 4, 2, f32_to_bf16, "f32_to_bf16");
}

static PyObject *py_bf16_to_f32(PyObject *self, PyObject *args) {
    return convert(args, 2, 4, bf16_to_f32, "bf16_to_f32");
}

static PyObject *py_bf16_add(PyObject *self, PyObject *args) {
    return accumulate(args, bf16_add, "bf16_add");
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    /* For tests and scripts/wire_speed.py: use at most the named instruction
     * set ("best", "avx512", "f16c", "portable"), as far as the CPU has it. */
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    int wanted;
    if (strcmp(name, "best") == 0 || strcmp(name, "avx512") == 0) wanted = ISA_AVX512;
    else if (strcmp(name, "f16c") == 0) wanted = ISA_F16C;
    else if (strcmp(name, "portable") == 0) wanted = ISA_PORTABLE;
    else {
        PyErr_Format(PyExc_ValueError, "set_isa: %R is not one of 'best', 'avx512', "
                     "'f16c', 'portable'", arg);
        return NULL;
    }
    int best = best_isa();
    isa = wanted < best ? wanted : best;
    return PyUnicode_FromString(isa_names[isa]);
}

static PyObject *py_get_isa(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(isa_names[isa]);
}

static PyMethodDef methods[] = {
    {"f32_to_f16", py_f32_to_f16, METH_VARARGS,
     "f32_to_f16(src, dst): float32 buffer -> float16 bits, nearest even, one NaN per sign."},
    {"f16_to_f32", py_f16_to_f32, METH_VARARGS,
     "f16_to_f32(src, dst): float16 bits -> float32 buffer, exact."},
    {"f16_to_f32_stream", py_f16_to_f32_stream, METH_VARARGS,
     "f16_to_f32_stream(src, dst): f16_to_f32 with streaming stores (a large output not "
     "read again soon)."},
    {"bf16_to_f32_stream", py_bf16_to_f32_stream, METH_VARARGS,
     "bf16_to_f32_stream(src, dst): bf16_to_f32 with streaming stores where AVX-512 has them."},
    {"f16_add", py_f16_add, METH_VARARGS,
     "f16_add(acc, src): float32 acc += float16 src, element-wise."},
    {"f32_to_bf16", py_f32_to_bf16, METH_VARARGS,
     "f32_to_bf16(src, dst): float32 buffer -> bfloat16 bits, nearest even."},
    {"bf16_to_f32", py_bf16_to_f32, METH_VARARGS,
     "bf16_to_f32(src, dst): bfloat16 bits -> float32 buffer, exact."},
    {"bf16_add", py_bf16_add, METH_VARARGS,
     "bf16_add(acc, src): float32 acc += bfloat16 src, element-wise."},
    {"f32_to_f16_bare", py_f32_to_f16_bare, METH_VARARGS,
     "f32_to_f16_bare(src, dst): the bare vcvtps2ph loop (NaN payloads kept); a "
     "benchmark baseline, not a wire conversion."},
    {"set_isa", py_set_isa, METH_O,
     "set_isa(name) -> str: use at most 'avx512', 'f16c' or 'portable' ('best': all the "
     "CPU has); returns the instruction set now in use."},
    {"isa", py_get_isa, METH_NOARGS, "isa() -> str: the instruction set in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "float16 / bfloat16 <-> float32 conversions for reducer_wire.convert (no GIL).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    isa = best_isa();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New(&c_api, "reducer_wire._kernels._C_API", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
