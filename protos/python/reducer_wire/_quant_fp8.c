/* The OCP FP8 formats E4M3 and E5M2: quantize float32, dequantize to
 * float32, and the daemon's dequantize-and-add into a float32 accumulator
 * (reducer_wire/quant.py holds the definition and the NumPy reference; the
 * same bits here):
 *   nearest even; a finite value that rounds beyond the largest finite
 *   overflows as IEEE rounding does, never saturates: to E5M2 Inf with its
 *   sign, or E4M3 NaN (E4M3 has no infinity), so a loss scaler sees it;
 *   Inf -> E5M2 Inf with its sign or E4M3 NaN; every NaN written is
 *   positive; decoding is exact.
 * The loops are written once (always-inline bodies) and compiled twice: for
 * the baseline x86-64 (or any CPU) and for AVX2, chosen at run time, where
 * the compiler vectorises them. Where it does that poorly there are
 * hand-written loops: encoding on AVX2 and AVX-512, decoding through F16C.
 */
#include "_quant.h"

/* a where mask is all ones, b where it is zero: no branch, so loops vectorise. */
INLINE uint32_t pick_bits(uint32_t mask, uint32_t a, uint32_t b) {
    return (a & mask) | (b & ~mask);
}
INLINE uint32_t mask_if(int condition) { return (uint32_t)0 - (uint32_t)(condition != 0); }
/* Magnitudes have the sign bit clear, so they compare as int32: AVX2 has
 * signed compares only. */
INLINE int below(uint32_t magnitude, uint32_t limit) { return (int32_t)magnitude < (int32_t)limit; }

INLINE uint32_t fp8_from_bits(uint32_t bits, int mbits, int bias, uint32_t overflow_bits,
                              uint32_t inf_code, uint32_t nan_code) {
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
    /* Overflow, Inf among it: what Inf becomes. */
    code = pick_bits(mask_if(!below(magnitude, overflow_bits)), inf_code, code);
    code = pick_bits(mask_if(below(0x7F800000u, magnitude)), nan_code, code);
    /* A NaN code is written positive: the daemon's sum of NaNs of both signs
     * would otherwise take the sign of whichever contribution came first. */
    return code | pick_bits(mask_if(code == nan_code), 0, (bits >> 24) & 0x80u);
}

/* The format's fields as constants, so each loop is compiled for one format:
 * mantissa bits, bias; the smallest float32 magnitude that rounds beyond the
 * largest finite (nearest even: E4M3's 448 + 16 rounds to 448, whose
 * mantissa is even, anything above it to 480, no finite code; E5M2's
 * 57344 + 4096 rounds to 65536); the code of Inf and of every overflow
 * (E5M2 Inf; E4M3 has no infinity: its NaN); the code of NaN. */
#define FP8_ARGS_E4M3 3, 7, 0x43E80001u, 0x7Fu, 0x7Fu
#define FP8_ARGS_E5M2 2, 15, 0x47700000u, 0x7Cu, 0x7Eu

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

#define FP8_VARIANTS(ATTR, SUFFIX)                                                      \
    ATTR static void fp8_encode_##SUFFIX(const char *s, char *d, Py_ssize_t n,          \
                                         int k) { fp8_encode_body(s, d, n, k); }        \
    ATTR static void fp8_decode_##SUFFIX(const char *s, char *d, Py_ssize_t n,          \
                                         int k) { fp8_decode_body(s, d, n, k); }        \
    ATTR static void fp8_add_##SUFFIX(float *a, const char *s, Py_ssize_t n,            \
                                      int k) { fp8_add_body(a, s, n, k); }

FP8_VARIANTS(, generic)
#ifdef HAVE_AVX2_PATH
FP8_VARIANTS(AVX2, avx2)
#endif

#ifdef HAVE_AVX2_PATH
#include <immintrin.h>
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
                                               uint32_t overflow_bits, uint32_t inf_code,
                                               uint32_t nan_code) {
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
    __m256i in_range = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)overflow_bits), magnitude);
    code = _mm256_blendv_epi8(_mm256_set1_epi32((int)inf_code), code, in_range);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32((int)nan_code),
                              _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000)));
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
    sign = _mm256_andnot_si256(_mm256_cmpeq_epi32(code, _mm256_set1_epi32((int)nan_code)),
                               sign);  /* NaN positive, as fp8_from_bits */
    return _mm256_or_si256(code, sign);
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
                                                   uint32_t overflow_bits, uint32_t inf_code,
                                                   uint32_t nan_code) {
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
        magnitude, _mm512_set1_epi32((int)overflow_bits)), _mm512_set1_epi32((int)inf_code));
    code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(
        magnitude, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32((int)nan_code));
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    sign = _mm512_mask_mov_epi32(sign, _mm512_cmpeq_epu32_mask(
        code, _mm512_set1_epi32((int)nan_code)), _mm512_setzero_si512());  /* NaN positive */
    code = _mm512_or_si512(code, sign);
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
 * stores (a large output not read again soon: see _quant_int8.c). */
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

/* ---- the entry points (_quant.h) ---- */

void rwq_fp8_encode(const char *src, char *dst, Py_ssize_t n, int kind) {
#ifdef HAVE_AVX2_PATH
    if (rwq_use_avx512) fp8_encode_avx512(src, dst, n, kind);
    else if (rwq_use_f16c) fp8_encode_intrinsics(src, dst, n, kind);
    else
#endif
        PICK(fp8_encode)(src, dst, n, kind);
}

void rwq_fp8_decode(const char *src, char *dst, Py_ssize_t n, int kind, int stream) {
#ifdef HAVE_AVX2_PATH
    if (rwq_use_f16c) fp8_decode_f16c(src, dst, n, kind, stream);
    else
#endif
        PICK(fp8_decode)(src, dst, n, kind);
}

void rwq_fp8_add(float *acc, const char *src, Py_ssize_t n, int kind) {
#ifdef HAVE_AVX2_PATH
    if (rwq_use_f16c) fp8_add_f16c(acc, src, n, kind);
    else
#endif
        PICK(fp8_add)(acc, src, n, kind);
}
