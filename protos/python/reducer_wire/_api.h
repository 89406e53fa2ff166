/* The wire kernels for other C extensions (the daemon's summing pool), as a
 * capsule in each kernel module: reducer_wire._kernels._C_API (float16,
 * bfloat16) and reducer_wire._quant._C_API (int8, FP8). The functions are the
 * ones the modules' Python functions call, chosen by instruction set at each
 * call as those are, with the thread's floating-point mode cleared around
 * them (_fpmode.h): the same bits. They take no GIL and check nothing: the
 * caller has checked the sizes, and the accumulator is 4-byte aligned.
 *
 * param: the int8 block size, or the FP8 kind (0 E4M3, 1 E5M2); ignored by
 * float16 and bfloat16. n: elements (float32 ones on the accumulator side). */
#ifndef REDUCER_WIRE_API_H
#define REDUCER_WIRE_API_H

#include <Python.h>

#define RW_API_VERSION 1

typedef struct {
    void (*widen)(const char *src, float *dst, Py_ssize_t n, Py_ssize_t param);
    void (*add)(float *acc, const char *src, Py_ssize_t n, Py_ssize_t param);
    void (*narrow)(const float *src, char *dst, Py_ssize_t n, Py_ssize_t param);
} rw_codec;

/* reducer_wire._kernels._C_API */
typedef struct {
    int version;
    rw_codec float16, bfloat16;
} rw_kernels_api;

/* reducer_wire._quant._C_API */
typedef struct {
    int version;
    rw_codec int8, fp8;
} rw_quant_api;

#endif
