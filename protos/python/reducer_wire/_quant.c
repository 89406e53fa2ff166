/* reducer_wire._quant: the 8-bit wire formats in C, int8 with a float32
 * scale per block (_quant_int8.c) and the OCP FP8 formats E4M3 and E5M2
 * (_quant_fp8.c): quantize float32, dequantize to float32, and the daemon's
 * dequantize-and-add into a float32 accumulator, without the GIL.
 *
 * reducer_wire/quant.py holds the formats' definition and the NumPy
 * reference; every function gives its bits exactly (tests/unit/test_quant.py
 * checks both paths), so results never depend on which end has the
 * extension. This file holds what the formats share: the Python bindings,
 * the C API for the daemon's summing pool (_api.h), and the choice of loops
 * by the CPU's instruction sets (AVX2, F16C, AVX-512), made at import.
 */
#include "_quant.h"

#include "_fpmode.h"
#include "_api.h"

int rwq_use_avx2 = 0;
int rwq_use_f16c = 0;
int rwq_use_avx512 = 0;

/* ---- the C API (_api.h): the same loops as the bindings below ---- */

static void api_q8_widen(const char *src, float *dst, Py_ssize_t n, Py_ssize_t block) {
    RW_FP_ENTER;
    rwq_q8_decode(src, (char *)dst, n, block, 0);
    RW_FP_LEAVE;
}

static void api_q8_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t block) {
    RW_FP_ENTER;
    rwq_q8_add(acc, src, n, block);
    RW_FP_LEAVE;
}

static void api_q8_narrow(const float *src, char *dst, Py_ssize_t n, Py_ssize_t block) {
    RW_FP_ENTER;
    rwq_q8_encode((const char *)src, dst, n, block);
    RW_FP_LEAVE;
}

static void api_fp8_widen(const char *src, float *dst, Py_ssize_t n, Py_ssize_t kind) {
    RW_FP_ENTER;
    rwq_fp8_decode(src, (char *)dst, n, (int)kind, 0);
    RW_FP_LEAVE;
}

static void api_fp8_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t kind) {
    RW_FP_ENTER;
    rwq_fp8_add(acc, src, n, (int)kind);
    RW_FP_LEAVE;
}

static void api_fp8_narrow(const float *src, char *dst, Py_ssize_t n, Py_ssize_t kind) {
    RW_FP_ENTER;
    rwq_fp8_encode((const char *)src, dst, n, (int)kind);
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
    if (src.len % 4 || dst.len != rwq_q8_nbytes(n, block)) {
        PyErr_Format(PyExc_ValueError, "q8_encode: %zd source bytes are not whole float32 "
                     "elements, or the destination of %zd bytes is not their int8 size "
                     "in blocks of %zd", src.len, dst.len, block);
        return release_both(&src, &dst), NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    rwq_q8_encode((const char *)src.buf, (char *)dst.buf, n, block);
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
    if (dst.len % 4 || src.len != rwq_q8_nbytes(n, block)) {
        PyErr_Format(PyExc_ValueError, "q8_decode: the destination of %zd bytes is not "
                     "whole float32 elements, or the source of %zd bytes is not their "
                     "int8 size in blocks of %zd", dst.len, src.len, block);
        return release_both(&src, &dst), NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    rwq_q8_decode((const char *)src.buf, (char *)dst.buf, n, block, stream);
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
    if (src.len != rwq_q8_nbytes(n, block)) {
        PyErr_Format(PyExc_ValueError, "q8_add: the source of %zd bytes is not the int8 "
                     "size of %zd elements in blocks of %zd", src.len, n, block);
        return release_both(&acc, &src), NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    rwq_q8_add((float *)acc.buf, (const char *)src.buf, n, block);
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
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    rwq_fp8_encode((const char *)src.buf, (char *)dst.buf, n, kind);
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
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    rwq_fp8_decode((const char *)src.buf, (char *)dst.buf, n, kind, stream);
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
    Py_BEGIN_ALLOW_THREADS
    RW_FP_ENTER;
    rwq_fp8_add((float *)acc.buf, (const char *)src.buf, n, kind);
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
    rwq_use_avx512 = on && rwq_use_avx2 && cpu_has_avx512();
    return PyBool_FromLong(rwq_use_avx512);
}

static PyObject *py_set_simd(PyObject *self, PyObject *arg) {
    /* For tests: the baseline loops (False) or the AVX2 ones where the CPU has it. */
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    rwq_use_avx2 = on && cpu_has_avx2();
    rwq_use_f16c = on && cpu_has_f16c();
    rwq_use_avx512 = rwq_use_avx2 && cpu_has_avx512();
    return PyBool_FromLong(rwq_use_avx2);
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
    rwq_use_avx2 = cpu_has_avx2();
    rwq_use_f16c = cpu_has_f16c();
    rwq_use_avx512 = rwq_use_avx2 && cpu_has_avx512();
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
