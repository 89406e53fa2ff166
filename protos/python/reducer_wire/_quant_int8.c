/* int8 with a float32 scale per block: quantize float32, dequantize to
 * float32, and the daemon's dequantize-and-add into a float32 accumulator
 * (reducer_wire/quant.py holds the definition and the NumPy reference; the
 * same bits here):
 *   a block's scale is fl(absmax / 127) rounded up to a float32 whose 7
 *   lowest mantissa bits are zero (at least 2^-142), its codes rint(x /
 *   scale) in float32 (ties to even). code * scale is then exact, so fused
 *   or not, acc + code * scale rounds once.
 * The loops are written once (always-inline bodies) and compiled twice: for
 * the baseline x86-64 (or any CPU) and for AVX2, chosen at run time, where
 * the compiler vectorises them; encoding has a hand-written AVX2 loop.
 */
#include "_quant.h"

#define SCALE_BYTES 4
#define SCALE_LOW_BITS 0x7Fu
#define SCALE_MIN_BITS 0x80u   /* 2^-142 */

Py_ssize_t rwq_q8_nbytes(Py_ssize_t n, Py_ssize_t block) {
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

/* ---- the two compilations of every loop ---- */

typedef void (*q8_parts_fn)(const char *, const int8_t *, char *, Py_ssize_t, Py_ssize_t);

#define Q8_VARIANTS(ATTR, SUFFIX)                                                       \
    ATTR static void q8_decode_##SUFFIX(const char *s, char *d, Py_ssize_t n,           \
                                        Py_ssize_t b) { q8_decode_body(s, d, n, b); }   \
    ATTR static void q8_decode_parts_##SUFFIX(const char *s, const int8_t *q, char *d,     \
                                              Py_ssize_t n, Py_ssize_t b) {              \
        q8_decode_parts_body(s, q, d, n, b);                                            \
    }                                                                                   \
    ATTR static void q8_add_##SUFFIX(float *a, const char *s, Py_ssize_t n,             \
                                     Py_ssize_t b) { q8_add_body(a, s, n, b); }

Q8_VARIANTS(, generic)
static void q8_encode_generic(const char *s, char *d, Py_ssize_t n, Py_ssize_t b) {
    q8_encode_body(s, d, n, b);
}
#ifdef HAVE_AVX2_PATH
Q8_VARIANTS(AVX2, avx2)
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

/* ---- the entry points (_quant.h) ---- */

void rwq_q8_encode(const char *src, char *dst, Py_ssize_t n, Py_ssize_t block) {
#ifdef HAVE_AVX2_PATH
    if (rwq_use_avx2) q8_encode_avx2_intrinsics(src, dst, n, block);
    else
#endif
        q8_encode_generic(src, dst, n, block);
}

void rwq_q8_decode(const char *src, char *dst, Py_ssize_t n, Py_ssize_t block, int stream) {
    if (HAVE_STREAM_STORES && stream && block <= STREAM_PIECE)
        q8_decode_streamed(PICK(q8_decode_parts), src, dst, n, block);
    else
        PICK(q8_decode)(src, dst, n, block);
}

void rwq_q8_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t block) {
    PICK(q8_add)(acc, src, n, block);
}
