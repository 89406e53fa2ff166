/* Wire conversions in C: float16 / bfloat16 <-> float32, and the daemon's
 * widen-and-add, without the GIL.
 *
 * NumPy does these in a dozen whole-array passes (convert.py), about 1 ns per
 * element: on both ends that was more CPU than the sums and the I/O together.
 * Here each element is touched once. x86-64 CPUs with F16C use its
 * conversion instructions (8 elements at a time); everywhere else the same
 * integer algorithm as convert.py runs element by element. Every function gives
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
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define HAVE_F16C_PATH 1
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

/* ---- F16C: vcvtps2ph / vcvtph2ps, 8 lanes ---- */

#ifdef HAVE_F16C_PATH
__attribute__((target("avx,f16c")))
static void f32_to_f16_f16c(const char *src, char *dst, Py_ssize_t n) {
    const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps((const float *)(src + 4 * i));
        /* Canonical NaN (0x7E00 | sign) as in convert.py, not the hardware's
         * payload-keeping one: keep the sign, replace the rest. */
        __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        __m256 canon = _mm256_or_ps(_mm256_andnot_ps(abs_mask, x), quiet_nan);
        x = _mm256_blendv_ps(x, canon, nan);
        __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(dst + 2 * i), h);
    }
    f32_to_f16_generic(src + 4 * i, dst + 2 * i, n - i);
}

__attribute__((target("avx,f16c")))
static void f16_to_f32_f16c(const char *src, char *dst, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        _mm256_storeu_ps((float *)(dst + 4 * i), _mm256_cvtph_ps(h));
    }
    f16_to_f32_generic(src + 2 * i, dst + 4 * i, n - i);
}

__attribute__((target("avx,f16c")))
static void f16_add_f16c(float *acc, const char *src, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        __m256 sum = _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_cvtph_ps(h));
        _mm256_storeu_ps(acc + i, sum);
    }
    f16_add_generic(acc + i, src + 2 * i, n - i);
}
#endif

static int use_f16c = 0;

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
    fn((const char *)src.buf, (char *)dst.buf, n);
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
    fn((float *)acc.buf, (const char *)src.buf, n);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&acc);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *py_f32_to_f16(PyObject *self, PyObject *args) {
#ifdef HAVE_F16C_PATH
    if (use_f16c) return convert(args, 4, 2, f32_to_f16_f16c, "f32_to_f16");
#endif
    return convert(args, 4, 2, f32_to_f16_generic, "f32_to_f16");
}

static PyObject *py_f16_to_f32(PyObject *self, PyObject *args) {
#ifdef HAVE_F16C_PATH
    if (use_f16c) return convert(args, 2, 4, f16_to_f32_f16c, "f16_to_f32");
#endif
    return convert(args, 2, 4, f16_to_f32_generic, "f16_to_f32");
}

static PyObject *py_f16_add(PyObject *self, PyObject *args) {
#ifdef HAVE_F16C_PATH
    if (use_f16c) return accumulate(args, f16_add_f16c, "f16_add");
#endif
    return accumulate(args, f16_add_generic, "f16_add");
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

static PyObject *py_set_f16c(PyObject *self, PyObject *arg) {
    /* For tests: switch the F16C path off (False) or back on where the CPU has it. */
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
#ifdef HAVE_F16C_PATH
    __builtin_cpu_init();
    use_f16c = on && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#endif
    return PyBool_FromLong(use_f16c);
}

static PyMethodDef methods[] = {
    {"f32_to_f16", py_f32_to_f16, METH_VARARGS,
     "f32_to_f16(src, dst): float32 buffer -> float16 bits, nearest even."},
    {"f16_to_f32", py_f16_to_f32, METH_VARARGS,
     "f16_to_f32(src, dst): float16 bits -> float32 buffer, exact."},
    {"f16_add", py_f16_add, METH_VARARGS,
     "f16_add(acc, src): float32 acc += float16 src, element-wise."},
    {"f32_to_bf16", py_f32_to_bf16, METH_VARARGS,
     "f32_to_bf16(src, dst): float32 buffer -> bfloat16 bits, nearest even."},
    {"bf16_to_f32", py_bf16_to_f32, METH_VARARGS,
     "bf16_to_f32(src, dst): bfloat16 bits -> float32 buffer, exact."},
    {"bf16_add", py_bf16_add, METH_VARARGS,
     "bf16_add(acc, src): float32 acc += bfloat16 src, element-wise."},
    {"set_f16c", py_set_f16c, METH_O,
     "set_f16c(on) -> bool: use the F16C instructions if on and the CPU has them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "float16 / bfloat16 <-> float32 conversions for reducer_wire.convert (no GIL).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef HAVE_F16C_PATH
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#endif
    return PyModule_Create(&module);
}
