/* The 8-bit wire formats in C: int8 with a float32 scale per block, and the
 * OCP FP8 formats E4M3 and E5M2; quantize float32, dequantize to float32, and
 * the daemon's dequantize-and-add into a float32 accumulator, without the GIL.
 *
 * reducer_wire/quant.py holds the formats' definition and the NumPy reference;
 * every function here gives its bits exactly (tests/unit/test_quant.py checks
 * both paths), so results never depend on which end has the extension:
 *   - int8: a block's scale is fl(absmax / 127) rounded up to a float32 whose
 *     7 lowest mantissa bits are zero (at least 2^-142), its codes
 *     rint(x / scale) in float32 (ties to even). code * scale is then exact,
 *     so fused or not, acc + code * scale rounds once;
 *   - FP8: nearest even, finite overflow saturates to the largest finite,
 *     NaN -> the format's NaN, Inf -> E5M2 Inf or E4M3 NaN, sign kept;
 *     decoding is exact.
 * The loops are written once (always-inline bodies) and compiled twice: for
 * the baseline x86-64 (or any CPU) and for AVX2, chosen at run time, where the
 * compiler vectorises them. Where it does that poorly there are hand-written
 * AVX2 loops (int8 and FP8 encoding, FP8 decoding through F16C), and FP8
 * encoding for AVX-512 too. Buffers may be unaligned (shard data sits
 * anywhere in a received message) except the float32 accumulator.
 * Little-endian hosts only, like _kernels.c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_fpmode.h"
#include "_api.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2")))
#endif
#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t load_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
INLINE float load_f32(const char *p) { float v; memcpy(&v, p, 4); return v; }
INLINE float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- int8 with a scale per block ---- */

#define SCALE_BYTES 4
#define SCALE_LOW_BITS 0x7Fu
#define SCALE_MIN_BITS 0x80u   /* 2^-142 */
#define NAN_BITS 0x7FC00000u

static Py_ssize_t q8_nbytes(Py_ssize_t n, Py_ssize_t block) {
    return SCALE_BYTES * ((n + block - 1) / block) + n;
}

/* The scale of a block whose largest |x| has the bits amax (sign clear). */
INLINE uint32_t q8_scale_bits(uint32_t amax) {
    if (amax >= 0x7F800000u) return NAN_BITS;  /* NaN or Inf in the block */
    if (amax == 0) return 0;
    uint32_t bits = (float_to_bits(bits_to_float(amax) / 127.0f) + SCALE_LOW_BITS)
                    & ~SCALE_LOW_BITS;
    return bits < SCALE_MIN_BITS ? SCALE_MIN_BITS : bits;
}

/* rint(v) clamped to +-127 (|v| <= 127.0001 here, see quant.py): adding and
 * subtracting 1.5 * 2^23 rounds to an integer, nearest even, as rintf does in
 * the default rounding mode, without a call into libm on baseline x86-64. */
INLINE int8_t q8_code(float v) {
    const float magic = 12582912.0f;
    float r = (v + magic) - magic;
    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
    return (int8_t)(int32_t)r;
}

INLINE void q8_encode_body(const char *restrict src, char *restrict dst, Py_ssize_t n,
                           Py_ssize_t block) {
    Py_ssize_t nblocks = (n + block - 1) / block;
    int8_t *codes = (int8_t *)(dst + SCALE_BYTES * nblocks);
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        const char *x = src + 4 * b * block;
        int8_t *q = codes + b * block;
        Py_ssize_t len = n - b * block < block ? n - b * block : block;
        uint32_t amax = 0;
        for (Py_ssize_t i = 0; i < len; i++) {
            uint32_t m = load_u32(x + 4 * i) & 0x7FFFFFFFu;
            amax = m > amax ? m : amax;
        }
        uint32_t scale_bits = q8_scale_bits(amax);
        memcpy(dst + SCALE_BYTES * b, &scale_bits, 4);
        if (scale_bits == 0 || scale_bits == NAN_BITS) {
            memset(q, 0, (size_t)len);
            continue;
        }
        float scale = bits_to_float(scale_bits);
        for (Py_ssize_t i = 0; i < len; i++)
            q[i] = q8_code(load_f32(x + 4 * i) / scale);
    }
}

/* n elements in blocks of `block`: their scales at `scales`, their codes at
 * `codes` (a whole message has its scales first, then all codes). */
INLINE void q8_decode_parts_body(const char *restrict scales, const int8_t *restrict codes,
                                 char *restrict dst, Py_ssize_t n, Py_ssize_t block) {
    Py_ssize_t nblocks = (n + block - 1) / block;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        float scale = load_f32(scales + SCALE_BYTES * b);
        const int8_t *q = codes + b * block;
        char *out = dst + 4 * b * block;
        Py_ssize_t len = n - b * block < block ? n - b * block : block;
        for (Py_ssize_t i = 0; i < len; i++) {
            float v = (float)q[i] * scale;
            memcpy(out + 4 * i, &v, 4);
        }
    }
}

INLINE void q8_decode_body(const char *restrict src, char *restrict dst, Py_ssize_t n,
                           Py_ssize_t block) {
    Py_ssize_t nblocks = (n + block - 1) / block;
    q8_decode_parts_body(src, (const int8_t *)(src + SCALE_BYTES * nblocks), dst, n, block);
}

INLINE void q8_add_body(float *restrict acc, const char *restrict src, Py_ssize_t n,
                        Py_ssize_t block) {
    Py_ssize_t nblocks = (n + block - 1) / block;
    const int8_t *codes = (const int8_t *)(src + SCALE_BYTES * nblocks);
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        float scale = load_f32(src + SCALE_BYTES * b);
        const int8_t *q = codes + b * block;
        float *a = acc + b * block;
        Py_ssize_t len = n - b * block < block ? n - b * block : block;
        for (Py_ssize_t i = 0; i < len; i++)
            a[i] += (float)q[i] * scale;
    }
}

/* ---- FP8 ---- */

/* a where mask is all ones, b where it is zero: no branch, so loops vectorise. */
INLINE uint32_t pick_bits(uint32_t mask, uint32_t a, uint32_t b) {
    return (a & mask) | (b & ~mask);
}
INLINE uint32_t mask_if(int condition) { return (uint32_t)0 - (uint32_t)(condition != 0); }
/* Magnitudes have the sign bit clear, so they compare as int32: AVX2 has
 * signed compares only. */
INLINE int below(uint32_t magnitude, uint32_t limit) { return (int32_t)magnitude < (int32_t)limit; }

INLINE uint32_t fp8_from_bits(uint32_t bits, int mbits, int bias, uint32_t max_bits,
                              uint32_t max_code, uint32_t inf_code, uint32_t nan_code) {
    uint32_t magnitude = bits & 0x7FFFFFFFu;
    int shift = 23 - mbits;
    /* Normal: rebias, add just under half an ulp plus the kept lowest bit. */
    uint32_t odd = (magnitude >> shift) & 1u;
    uint32_t normal = (magnitude + ((uint32_t)(bias - 127) << 23)
                       + ((1u << (shift - 1)) - 1u) + odd) >> shift;
    /* Subnormal: 2^k whose ulp is the smallest subnormal aligns the value;
     * the float32 addition rounds to nearest even. */
    uint32_t magic = (uint32_t)(127 - bias + shift + 1) << 23;
    uint32_t tiny = float_to_bits(bits_to_float(magnitude) + bits_to_float(magic)) - magic;
    uint32_t code = pick_bits(mask_if(below(magnitude, (uint32_t)(127 - bias + 1) << 23)),
                              tiny, normal);
    code = pick_bits(mask_if(!below(magnitude, max_bits)), max_code, code);
    code = pick_bits(mask_if(magnitude == 0x7F800000u), inf_code, code);
    code = pick_bits(mask_if(below(0x7F800000u, magnitude)), nan_code, code);
    return code | ((bits >> 24) & 0x80u);
}

/* The format's fields as constants, so each loop is compiled for one format. */
#define FP8_ARGS_E4M3 3, 7, 0x43E00000u, 0x7Eu, 0x7Fu, 0x7Fu
#define FP8_ARGS_E5M2 2, 15, 0x47600000u, 0x7Bu, 0x7Cu, 0x7Eu

INLINE void fp8_encode_body(const char *src, char *dst, Py_ssize_t n, int kind) {
    uint8_t *out = (uint8_t *)dst;
    if (kind == 0) {
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (uint8_t)fp8_from_bits(load_u32(src + 4 * i), FP8_ARGS_E4M3);
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = (uint8_t)fp8_from_bits(load_u32(src + 4 * i), FP8_ARGS_E5M2);
    }
}

/* Decoding by arithmetic, exact: the same bits as quant.fp8_table. */
INLINE float fp8_to_float(uint32_t code, int mbits, int bias, uint32_t inf_code,
                          uint32_t nan_code) {
    uint32_t magnitude = code & 0x7Fu;
    /* Normal: the fields move into float32 position, the exponent is rebiased. */
    uint32_t u = (magnitude << (23 - mbits)) + ((uint32_t)(127 - bias) << 23);
    /* Subnormal (exponent 0): mantissa * 2^(1 - bias - mbits), exact; computed
     * from an integer so no float32 subnormal ever enters the arithmetic
     * (Intel CPUs take a slow assist on each). */
    float tiny = (float)(int32_t)magnitude * bits_to_float((uint32_t)(128 - bias - mbits) << 23);
    u = pick_bits(mask_if(below(magnitude, 1u << mbits)), float_to_bits(tiny), u);
    if (inf_code != nan_code) {  /* E5M2: exponent all ones is Inf or NaN */
        u = pick_bits(mask_if(magnitude == inf_code), 0x7F800000u, u);
        u = pick_bits(mask_if(below(inf_code, magnitude)), NAN_BITS, u);
    } else {
        u = pick_bits(mask_if(magnitude == nan_code), NAN_BITS, u);
    }
    return bits_to_float(u | ((code & 0x80u) << 24));
}

#define FP8_DECODE_E4M3 3, 7, 0x7Fu, 0x7Fu
#define FP8_DECODE_E5M2 2, 15, 0x7Cu, 0x7Eu

INLINE void fp8_decode_body(const char *src, char *dst, Py_ssize_t n, int kind) {
    const uint8_t *codes = (const uint8_t *)src;
    if (kind == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            float v = fp8_to_float(codes[i], FP8_DECODE_E4M3);
            memcpy(dst + 4 * i, &v, 4);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            float v = fp8_to_float(codes[i], FP8_DECODE_E5M2);
            memcpy(dst + 4 * i, &v, 4);
        }
    }
}

INLINE void fp8_add_body(float *restrict acc, const char *restrict src, Py_ssize_t n,
                         int kind) {
    const uint8_t *codes = (const uint8_t *)src;
    if (kind == 0) {
        for (Py_ssize_t i = 0; i < n; i++) acc[i] += fp8_to_float(codes[i], FP8_DECODE_E4M3);
    } else {
        for (Py_ssize_t i = 0; i < n; i++) acc[i] += fp8_to_float(codes[i], FP8_DECODE_E5M2);
    }
}

/* ---- the two compilations of every loop ---- */

typedef void (*q8_fn)(const char *, char *, Py_ssize_t, Py_ssize_t);
typedef void (*q8_parts_fn)(const char *, const int8_t *, char *, Py_ssize_t, Py_ssize_t);
typedef void (*q8_add_fn)(float *, const char *, Py_ssize_t, Py_ssize_t);
typedef void (*fp8_fn)(const char *, char *, Py_ssize_t, int);
typedef void (*fp8_add_fn)(float *, const char *, Py_ssize_t, int);

#define VARIANTS(ATTR, SUFFIX)                                                          \
    ATTR static void q8_decode_##SUFFIX(const char *s, char *d, Py_ssize_t n,           \
                                        Py_ssize_t b) { q8_decode_body(s, d, n, b); }   \
    ATTR static void q8_decode_parts_##SUFFIX(const char *s, const int8_t *q, char *d,     \
                                              Py_ssize_t n, Py_ssize_t b) {              \
        q8_decode_parts_body(s, q, d, n, b);                                            \
    }                                                                                   \
    ATTR static void q8_add_##SUFFIX(float *a, const char *s, Py_ssize_t n,             \
                                     Py_ssize_t b) { q8_add_body(a, s, n, b); }         \
    ATTR static void fp8_encode_##SUFFIX(const char *s, char *d, Py_ssize_t n,          \
                                         int k) { fp8_encode_body(s, d, n, k); }        \
    ATTR static void fp8_decode_##SUFFIX(const char *s, char *d, Py_ssize_t n,          \
                                         int k) { fp8_decode_body(s, d, n, k); }        \
    ATTR static void fp8_add_##SUFFIX(float *a, const char *s, Py_ssize_t n,            \
                                      int k) { fp8_add_body(a, s, n, k); }

VARIANTS(, generic)
static void q8_encode_generic(const char *s, char *d, Py_ssize_t n, Py_ssize_t b) {
    q8_encode_body(s, d, n, b);
}
#ifdef HAVE_AVX2_PATH
VARIANTS(AVX2, avx2)
#endif

#ifdef HAVE_AVX2_PATH
#include <immintrin.h>
/* int8 encoding by hand: vcvtps2dq rounds to nearest even (the default MXCSR
 * mode, which Python and NumPy keep), as rintf does, and the saturating packs
 * clamp as the portable loop does (|x / scale| <= 127.0001 anyway). */
AVX2 static void q8_encode_block_avx2(const char *x, int8_t *q, Py_ssize_t len,
                                      float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    Py_ssize_t i = 0;
    for (; i + 32 <= len; i += 32) {
        const float *p = (const float *)(x + 4 * i);
        __m256i a = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(p), s));
        __m256i b = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(p + 8), s));
        __m256i c = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(p + 16), s));
        __m256i d = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(p + 24), s));
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(packed, order));
    }
    for (; i < len; i++)
        q[i] = q8_code(load_f32(x + 4 * i) / scale);
}

AVX2 static void q8_encode_avx2_intrinsics(const char *src, char *dst, Py_ssize_t n,
                                           Py_ssize_t block) {
    Py_ssize_t nblocks = (n + block - 1) / block;
    int8_t *codes = (int8_t *)(dst + SCALE_BYTES * nblocks);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        const char *x = src + 4 * b * block;
        Py_ssize_t len = n - b * block < block ? n - b * block : block;
        __m256i vmax = _mm256_setzero_si256();
        Py_ssize_t i = 0;
        for (; i + 8 <= len; i += 8)
            vmax = _mm256_max_epu32(vmax, _mm256_and_si256(
                _mm256_loadu_si256((const __m256i *)(x + 4 * i)), abs_mask));
        uint32_t lanes[8], amax = 0;
        _mm256_storeu_si256((__m256i *)lanes, vmax);
        for (int k = 0; k < 8; k++) amax = lanes[k] > amax ? lanes[k] : amax;
        for (; i < len; i++) {
            uint32_t m = load_u32(x + 4 * i) & 0x7FFFFFFFu;
            amax = m > amax ? m : amax;
        }
        uint32_t scale_bits = q8_scale_bits(amax);
        memcpy(dst + SCALE_BYTES * b, &scale_bits, 4);
        if (scale_bits == 0 || scale_bits == NAN_BITS)
            memset(codes + b * block, 0, (size_t)len);
        else
            q8_encode_block_avx2(x, codes + b * block, len, bits_to_float(scale_bits));
    }
}

/* One element in either format: the scalar ends of the vector loops below. */
INLINE uint8_t fp8_code_of(const char *src, int kind) {
    uint32_t bits = load_u32(src);
    return (uint8_t)(kind == 0 ? fp8_from_bits(bits, FP8_ARGS_E4M3)
                               : fp8_from_bits(bits, FP8_ARGS_E5M2));
}
INLINE float fp8_value_of(uint8_t code, int kind) {
    return kind == 0 ? fp8_to_float(code, FP8_DECODE_E4M3) : fp8_to_float(code, FP8_DECODE_E5M2);
}

/* FP8 decoding through float16 (F16C's vcvtph2ps), exact and branch-free:
 * an E5M2 code is the high byte of the float16 with the same value; an E4M3
 * code's fields, shifted into a float16's places, give its value times 2^-8
 * (the exponent biases are 7 and 15), so the float32 is that float16 times
 * 256, exact for normal and subnormal codes alike. Only NaN needs a blend: the
 * format's NaN bits (quant.fp8_table) with the code's sign. About as fast as
 * the bytes arrive, where the arithmetic above is several times slower. */
#define F16C_PATH __attribute__((target("avx2,f16c")))

F16C_PATH static inline __m256 fp8_eight_f16c(const uint8_t *codes, int kind) {
    __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)codes));
    __m128i magnitude = _mm_and_si128(c, _mm_set1_epi16(0x7F));
    __m128i half, nan16;
    if (kind == 0) {
        half = _mm_or_si128(_mm_slli_epi16(magnitude, 7),
                            _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8));
        nan16 = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7F));
    } else {
        half = _mm_slli_epi16(c, 8);
        nan16 = _mm_cmpgt_epi16(magnitude, _mm_set1_epi16(0x7C));
    }
    __m256 v = _mm256_cvtph_ps(half);
    if (kind == 0) v = _mm256_mul_ps(v, _mm256_set1_ps(256.0f));
    __m256i sign = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32((int)0x80000000u));
    __m256i nan = _mm256_or_si256(sign, _mm256_set1_epi32((int)NAN_BITS));
    return _mm256_blendv_ps(v, _mm256_castsi256_ps(nan),
                            _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16)));
}

/* FP8 encoding by hand, fp8_from_bits on 8 lanes: the compiler's own
 * vectorisation of the loop above packed each code to a byte one lane at a
 * time; here 32 codes are packed with two saturating packs, as for int8. */
F16C_PATH static inline __m256i fp8_codes_avx2(__m256i bits, int mbits, int bias,
                                               uint32_t max_bits, uint32_t max_code,
                                               uint32_t inf_code, uint32_t nan_code) {
    const int shift = 23 - mbits;
    __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, shift), _mm256_set1_epi32(1));
    __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(magnitude, odd),
        _mm256_set1_epi32((int)(((uint32_t)(bias - 127) << 23) + (1u << (shift - 1)) - 1u))),
        shift);
    __m256i magic = _mm256_set1_epi32((int)((uint32_t)(127 - bias + shift + 1) << 23));
    __m256i tiny = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(
        _mm256_castsi256_ps(magnitude), _mm256_castsi256_ps(magic))), magic);
    __m256i is_tiny = _mm256_cmpgt_epi32(
        _mm256_set1_epi32((int)((uint32_t)(127 - bias + 1) << 23)), magnitude);
    __m256i code = _mm256_blendv_epi8(normal, tiny, is_tiny);
    __m256i in_range = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)max_bits), magnitude);
    code = _mm256_blendv_epi8(_mm256_set1_epi32((int)max_code), code, in_range);
    const __m256i inf = _mm256_set1_epi32(0x7F800000);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32((int)inf_code),
                              _mm256_cmpeq_epi32(magnitude, inf));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32((int)nan_code),
                              _mm256_cmpgt_epi32(magnitude, inf));
    return _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(bits, 24),
                                                  _mm256_set1_epi32(0x80)));
}

#define FP8_CODES(v, kind) ((kind) == 0 ? fp8_codes_avx2((v), FP8_ARGS_E4M3) \
                                        : fp8_codes_avx2((v), FP8_ARGS_E5M2))

F16C_PATH static void fp8_encode_intrinsics(const char *src, char *dst, Py_ssize_t n,
                                            int kind) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    uint8_t *out = (uint8_t *)dst;
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i *p = (const __m256i *)(src + 4 * i);
        __m256i a = FP8_CODES(_mm256_loadu_si256(p), kind);
        __m256i b = FP8_CODES(_mm256_loadu_si256(p + 1), kind);
        __m256i c = FP8_CODES(_mm256_loadu_si256(p + 2), kind);
        __m256i d = FP8_CODES(_mm256_loadu_si256(p + 3), kind);
        __m256i packed = _mm256_packus_epi16(_mm256_packus_epi32(a, b),
                                             _mm256_packus_epi32(c, d));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_permutevar8x32_epi32(packed, order));
    }
    for (; i < n; i++)
        out[i] = fp8_code_of(src + 4 * i, kind);
}

/* The same on 16 lanes where the CPU has AVX-512: unsigned compares into
 * masks, and vpmovdb packs the 16 codes to bytes. */
#define AVX512_PATH __attribute__((target("avx512f")))

AVX512_PATH static inline __m128i fp8_codes_avx512(__m512i bits, int mbits, int bias,
                                                   uint32_t max_bits, uint32_t max_code,
                                                   uint32_t inf_code, uint32_t nan_code) {
    const int shift = 23 - mbits;
    __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, shift), _mm512_set1_epi32(1));
    __m512i code = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(magnitude, odd),
        _mm512_set1_epi32((int)(((uint32_t)(bias - 127) << 23) + (1u << (shift - 1)) - 1u))),
        shift);
    __m512i magic = _mm512_set1_epi32((int)((uint32_t)(127 - bias + shift + 1) << 23));
    __m512i tiny = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(
        _mm512_castsi512_ps(magnitude), _mm512_castsi512_ps(magic))), magic);
    code = _mm512_mask_mov_epi32(code, _mm512_cmplt_epu32_mask(
        magnitude, _mm512_set1_epi32((int)((uint32_t)(127 - bias + 1) << 23))), tiny);
    code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epu32_mask(
        magnitude, _mm512_set1_epi32((int)max_bits)), _mm512_set1_epi32((int)max_code));
    const __m512i inf = _mm512_set1_epi32(0x7F800000);
    code = _mm512_mask_mov_epi32(code, _mm512_cmpeq_epu32_mask(magnitude, inf),
                                 _mm512_set1_epi32((int)inf_code));
    code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(magnitude, inf),
                                 _mm512_set1_epi32((int)nan_code));
    code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(bits, 24),
                                                  _mm512_set1_epi32(0x80)));
    return _mm512_cvtepi32_epi8(code);
}

AVX512_PATH static void fp8_encode_avx512(const char *src, char *dst, Py_ssize_t n, int kind) {
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i bits = _mm512_loadu_si512((const void *)(src + 4 * i));
        _mm_storeu_si128((__m128i *)(dst + i),
                         kind == 0 ? fp8_codes_avx512(bits, FP8_ARGS_E4M3)
                                   : fp8_codes_avx512(bits, FP8_ARGS_E5M2));
    }
    for (; i < n; i++)
        dst[i] = (char)fp8_code_of(src + 4 * i, kind);
}

/* With `stream`, whole 32-byte lines of the output are written with streaming
 * stores (a large output not read again soon: see stream_copy below). */
F16C_PATH static void fp8_decode_f16c(const char *src, char *dst, Py_ssize_t n, int kind,
                                      int stream) {
    /* The output may sit at any byte (a float32 view of a buffer): scalar
     * elements go through memcpy, and one that never reaches a 32-byte line
     * is simply not streamed. */
    const uint8_t *codes = (const uint8_t *)src;
    Py_ssize_t i = 0;
    if (stream) {
        for (; i < n && (uintptr_t)(dst + 4 * i) % 32; i++) {
            float v = fp8_value_of(codes[i], kind);
            memcpy(dst + 4 * i, &v, 4);
        }
        for (; i + 8 <= n; i += 8)
            _mm256_stream_ps((float *)(dst + 4 * i), fp8_eight_f16c(codes + i, kind));
        _mm_sfence();
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps((float *)(dst + 4 * i), fp8_eight_f16c(codes + i, kind));
    }
    for (; i < n; i++) {
        float v = fp8_value_of(codes[i], kind);
        memcpy(dst + 4 * i, &v, 4);
    }
}

F16C_PATH static void fp8_add_f16c(float *acc, const char *src, Py_ssize_t n, int kind) {
    const uint8_t *codes = (const uint8_t *)src;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i),
                                                fp8_eight_f16c(codes + i, kind)));
    for (; i < n; i++)
        acc[i] += fp8_value_of(codes[i], kind);
}
#endif

static int use_avx2 = 0;
static int use_f16c = 0;
static int use_avx512 = 0;

#ifdef HAVE_AVX2_PATH
#define PICK(name) (use_avx2 ? name##_avx2 : name##_generic)
#else
#define PICK(name) (name##_generic)
#endif

/* ---- decoding into a large output with streaming stores ----
 *
 * A reply decoded into the caller's gradient is not read again soon, and
 * plain stores read every line of a cold float32 output before writing it.
 * With `stream`, int8 codes are decoded piece by piece into a small buffer
 * that stays in L1, then copied out with streaming (non-temporal) stores,
 * which write whole lines without reading them: the same bits (64 MiB out:
 * 5.7 ms, 4.2 streamed). FP8 decoded by the arithmetic loop is not streamed
 * (the extra copy cost more than the reads it saved: 6.6 -> 7.0 ms); its F16C
 * loop streams straight into the output (fp8_decode_f16c). SSE2's streaming
 * store is baseline x86-64. */
#define STREAM_PIECE 4096  /* float32 elements of scratch: 16 KiB */

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_STREAM_STORES 1
#include <emmintrin.h>
static void stream_copy(char *dst, const char *src, Py_ssize_t nbytes) {
    Py_ssize_t head = (Py_ssize_t)((16 - (uintptr_t)dst % 16) % 16);
    if (head > nbytes) head = nbytes;
    memcpy(dst, src, (size_t)head);
    Py_ssize_t i = head;
    for (; i + 64 <= nbytes; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, (size_t)(nbytes - i));
}
static void stream_fence(void) { _mm_sfence(); }
#else  /* no streaming stores: the hint is ignored (decoding straight into the output) */
#define HAVE_STREAM_STORES 0
static void stream_copy(char *dst, const char *src, Py_ssize_t nbytes) {
    memcpy(dst, src, (size_t)nbytes);
}
static void stream_fence(void) {}
#endif

static void q8_decode_streamed(q8_parts_fn fn, const char *src, char *dst, Py_ssize_t n,
                               Py_ssize_t block) {
    _Alignas(64) float scratch[STREAM_PIECE];
    Py_ssize_t nblocks = (n + block - 1) / block;
    const int8_t *codes = (const int8_t *)(src + SCALE_BYTES * nblocks);
    Py_ssize_t piece_blocks = STREAM_PIECE / block;
    for (Py_ssize_t b = 0; b < nblocks; b += piece_blocks) {
        Py_ssize_t first = b * block;
        Py_ssize_t len = n - first < piece_blocks * block ? n - first : piece_blocks * block;
        fn(src + SCALE_BYTES * b, codes + first, (char *)scratch, len, block);
        stream_copy(dst + 4 * first, (const char *)scratch, 4 * len);
    }
    stream_fence();
}

/* ---- the C API (_api.h): the same choices as the bindings below ---- */

static void api_q8_widen(const char *src, float *dst, Py_ssize_t n, Py_ssize_t block) {
    RW_FP_ENTER;
    PICK(q8_decode)(src, (char *)dst, n, block);
    RW_FP_LEAVE;
}

static void api_q8_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t block) {
    RW_FP_ENTER;
    PICK(q8_add)(acc, src, n, block);
    RW_FP_LEAVE;
}

static void api_q8_narrow(const float *src, char *dst, Py_ssize_t n, Py_ssize_t block) {
    RW_FP_ENTER;
#ifdef HAVE_AVX2_PATH
    if (use_avx2) q8_encode_avx2_intrinsics((const char *)src, dst, n, block);
    else
#endif
        q8_encode_generic((const char *)src, dst, n, block);
    RW_FP_LEAVE;
}

static void api_fp8_widen(const char *src, float *dst, Py_ssize_t n, Py_ssize_t kind) {
    RW_FP_ENTER;
#ifdef HAVE_AVX2_PATH
    if (use_f16c) fp8_decode_f16c(src, (char *)dst, n, (int)kind, 0);
    else
#endif
        PICK(fp8_decode)(src, (char *)dst, n, (int)kind);
    RW_FP_LEAVE;
}

static void api_fp8_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t kind) {
    RW_FP_ENTER;
#ifdef HAVE_AVX2_PATH
    if (use_f16c) fp8_add_f16c(acc, src, n, (int)kind);
    else
#endif
        PICK(fp8_add)(acc, src, n, (int)kind);
    RW_FP_LEAVE;
}

static void api_fp8_narrow(const float *src, char *dst, Py_ssize_t n, Py_ssize_t kind) {
    RW_FP_ENTER;
#ifdef HAVE_AVX2_PATH
    if (use_avx512) fp8_encode_avx512((const char *)src, dst, n, (int)kind);
    else if (use_f16c) fp8_encode_intrinsics((const char *)src, dst, n, (int)kind);
    else
#endif
        PICK(fp8_encode)((const char *)src, dst, n, (int)kind);
    RW_FP_LEAVE;
}

static rw_quant_api c_api = {
    RW_API_VERSION,
    {api_q8_widen, api_q8_add, api_q8_narrow},
    {api_fp8_widen, api_fp8_add, api_fp8_narrow},
};

/* ---- Python bindings ---- */

static int release_both(Py_buffer *a, Py_buffer *b) {
    PyBuffer_Release(a);
    PyBuffer_Release(b);
    return 0;
}

static int check_block(Py_ssize_t block, const char *name) {
    if (block < 1) {
        PyErr_Format(PyExc_ValueError, "%s: block must be >= 1, got %zd", name, block);
        return -1;
    }
    return 0;
}

static int check_acc(Py_buffer *acc, const char *name) {
    if (acc->len % 4) {
        PyErr_Format(PyExc_ValueError, "%s: the accumulator of %zd bytes is not whole "
                     "float32 elements", name, acc->len);
        return -1;
    }
    if ((uintptr_t)acc->buf % 4) {
        PyErr_Format(PyExc_ValueError, "%s: the float32 accumulator is not 4-byte "
                     "aligned", name);
        return -1;
    }
    return 0;
}

static PyObject *py_q8_encode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t block;
    int stream = 0;
    if (!PyArg_ParseTuple(args, "y*w*n|p", &src, &dst, &block, &stream)) return NULL;
    Py_ssize_t n = src.len / 4;
    if (check_block(block, "q8_encode") < 0) return release_both(&src, &dst), NULL;
    if (src.len % 4 || dst.len != q8_nbytes(n, block)) {
        PyErr_Format(PyExc_ValueError, "q8_encode: %zd source bytes are not whole float32 "
                     "elements, or the destination of %zd bytes is not their int8 size "
                     "in blocks of %zd", src.len, dst.len, block);
        return release_both(&src, &dst), NULL;
    }
#ifdef HAVE_AVX2_PATH
    q8_fn fn = use_avx2 ? q8_encode_avx2_intrinsics : q8_encode_generic;
#else
    q8_fn fn = q8_encode_generic;
#endif
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    fn((const char *)src.buf, (char *)dst.buf, n, block);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    release_both(&src, &dst);
    Py_RETURN_NONE;
}

static PyObject *py_q8_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t block;
    int stream = 0;
    if (!PyArg_ParseTuple(args, "y*w*n|p", &src, &dst, &block, &stream)) return NULL;
    Py_ssize_t n = dst.len / 4;
    if (check_block(block, "q8_decode") < 0) return release_both(&src, &dst), NULL;
    if (dst.len % 4 || src.len != q8_nbytes(n, block)) {
        PyErr_Format(PyExc_ValueError, "q8_decode: the destination of %zd bytes is not "
                     "whole float32 elements, or the source of %zd bytes is not their "
                     "int8 size in blocks of %zd", dst.len, src.len, block);
        return release_both(&src, &dst), NULL;
    }
    q8_fn fn = PICK(q8_decode);
    q8_parts_fn parts = PICK(q8_decode_parts);
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    if (HAVE_STREAM_STORES && stream && block <= STREAM_PIECE)
        q8_decode_streamed(parts, (const char *)src.buf, (char *)dst.buf, n, block);
    else
        fn((const char *)src.buf, (char *)dst.buf, n, block);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    release_both(&src, &dst);
    Py_RETURN_NONE;
}

static PyObject *py_q8_add(PyObject *self, PyObject *args) {
    Py_buffer acc, src;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "w*y*n", &acc, &src, &block)) return NULL;
    Py_ssize_t n = acc.len / 4;
    if (check_block(block, "q8_add") < 0 || check_acc(&acc, "q8_add") < 0)
        return release_both(&acc, &src), NULL;
    if (src.len != q8_nbytes(n, block)) {
        PyErr_Format(PyExc_ValueError, "q8_add: the source of %zd bytes is not the int8 "
                     "size of %zd elements in blocks of %zd", src.len, n, block);
        return release_both(&acc, &src), NULL;
    }
    q8_add_fn fn = PICK(q8_add);
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    fn((float *)acc.buf, (const char *)src.buf, n, block);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    release_both(&acc, &src);
    Py_RETURN_NONE;
}

static int check_kind(int kind, const char *name) {
    if (kind != 0 && kind != 1) {
        PyErr_Format(PyExc_ValueError, "%s: format %d is not 0 (E4M3) or 1 (E5M2)",
                     name, kind);
        return -1;
    }
    return 0;
}

static PyObject *py_fp8_encode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int kind;
    if (!PyArg_ParseTuple(args, "y*w*i", &src, &dst, &kind)) return NULL;
    Py_ssize_t n = src.len / 4;
    if (check_kind(kind, "fp8_encode") < 0) return release_both(&src, &dst), NULL;
    if (src.len % 4 || dst.len != n) {
        PyErr_Format(PyExc_ValueError, "fp8_encode: source of %zd bytes and destination "
                     "of %zd bytes do not hold the same number of float32 and 1-byte "
                     "elements", src.len, dst.len);
        return release_both(&src, &dst), NULL;
    }
    fp8_fn fn = PICK(fp8_encode);
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
#ifdef HAVE_AVX2_PATH
    if (use_avx512)
        fp8_encode_avx512((const char *)src.buf, (char *)dst.buf, n, kind);
    else if (use_f16c)
        fp8_encode_intrinsics((const char *)src.buf, (char *)dst.buf, n, kind);
    else
#endif
        fn((const char *)src.buf, (char *)dst.buf, n, kind);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    release_both(&src, &dst);
    Py_RETURN_NONE;
}

static PyObject *py_fp8_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int kind, stream = 0;
    if (!PyArg_ParseTuple(args, "y*w*i|p", &src, &dst, &kind, &stream)) return NULL;
    Py_ssize_t n = src.len;
    if (check_kind(kind, "fp8_decode") < 0) return release_both(&src, &dst), NULL;
    if (dst.len != 4 * n) {
        PyErr_Format(PyExc_ValueError, "fp8_decode: source of %zd bytes and destination "
                     "of %zd bytes do not hold the same number of 1-byte and float32 "
                     "elements", src.len, dst.len);
        return release_both(&src, &dst), NULL;
    }
    fp8_fn fn = PICK(fp8_decode);
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
#ifdef HAVE_AVX2_PATH
    if (use_f16c)
        fp8_decode_f16c((const char *)src.buf, (char *)dst.buf, n, kind, stream);
    else
#endif
        fn((const char *)src.buf, (char *)dst.buf, n, kind);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    release_both(&src, &dst);
    Py_RETURN_NONE;
}

static PyObject *py_fp8_add(PyObject *self, PyObject *args) {
    Py_buffer acc, src;
    int kind;
    if (!PyArg_ParseTuple(args, "w*y*i", &acc, &src, &kind)) return NULL;
    Py_ssize_t n = acc.len / 4;
    if (check_kind(kind, "fp8_add") < 0 || check_acc(&acc, "fp8_add") < 0)
        return release_both(&acc, &src), NULL;
    if (src.len != n) {
        PyErr_Format(PyExc_ValueError, "fp8_add: accumulator of %zd bytes and source of "
                     "%zd bytes do not hold the same number of float32 and 1-byte "
                     "elements", acc.len, src.len);
        return release_both(&acc, &src), NULL;
    }
    fp8_add_fn fn = PICK(fp8_add);
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
#ifdef HAVE_AVX2_PATH
    if (use_f16c)
        fp8_add_f16c((float *)acc.buf, (const char *)src.buf, n, kind);
    else
#endif
        fn((float *)acc.buf, (const char *)src.buf, n, kind);
    RW_FP_LEAVE;
    Py_END_ALLOW_THREADS
    release_both(&acc, &src);
    Py_RETURN_NONE;
}

static int cpu_has_avx2(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static int cpu_has_f16c(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static int cpu_has_avx512(void) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

static PyObject *py_set_avx512(PyObject *self, PyObject *arg) {
    /* For tests: the AVX-512 loops (FP8 encoding) where the CPU has them, or
     * not (the AVX2 ones then run, if set_simd allows them). */
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    use_avx512 = on && use_avx2 && cpu_has_avx512();
    return PyBool_FromLong(use_avx512);
}

static PyObject *py_set_simd(PyObject *self, PyObject *arg) {
    /* For tests: the baseline loops (False) or the AVX2 ones where the CPU has it. */
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    use_avx2 = on && cpu_has_avx2();
    use_f16c = on && cpu_has_f16c();
    use_avx512 = use_avx2 && cpu_has_avx512();
    return PyBool_FromLong(use_avx2);
}

static PyMethodDef methods[] = {
    {"q8_encode", py_q8_encode, METH_VARARGS,
     "q8_encode(src, dst, block): float32 -> int8 wire bytes (scales, then codes)."},
    {"q8_decode", py_q8_decode, METH_VARARGS,
     "q8_decode(src, dst, block, stream=False): int8 wire bytes -> float32, exact "
     "(stream: with streaming stores, for a large output not read again soon)."},
    {"q8_add", py_q8_add, METH_VARARGS,
     "q8_add(acc, src, block): float32 acc += the decoded int8 wire bytes."},
    {"fp8_encode", py_fp8_encode, METH_VARARGS,
     "fp8_encode(src, dst, kind): float32 -> FP8 codes (kind 0 E4M3, 1 E5M2)."},
    {"fp8_decode", py_fp8_decode, METH_VARARGS,
     "fp8_decode(src, dst, kind, stream=False): FP8 codes -> float32, exact "
     "(stream: with streaming stores, for a large output not read again soon)."},
    {"fp8_add", py_fp8_add, METH_VARARGS,
     "fp8_add(acc, src, kind): float32 acc += the values of FP8 codes."},
    {"set_avx512", py_set_avx512, METH_O,
     "set_avx512(on) -> bool: with set_simd on, use the AVX-512 loops where the CPU has "
     "them (set_simd(True) turns them on again)."},
    {"set_simd", py_set_simd, METH_O,
     "set_simd(on) -> bool: use the AVX2 loops (and F16C's FP8 decoding) if on and the "
     "CPU has them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_quant",
    "int8 (block scales) and FP8 wire formats for reducer_wire.quant (no GIL).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__quant(void) {
    use_avx2 = cpu_has_avx2();
    use_f16c = cpu_has_f16c();
    use_avx512 = use_avx2 && cpu_has_avx512();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New(&c_api, "reducer_wire._quant._C_API", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
