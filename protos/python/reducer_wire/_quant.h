/* What the three sources of reducer_wire._quant share: _quant.c (the Python
 * bindings, the C API of _api.h, the choice of instruction set),
 * _quant_int8.c and _quant_fp8.c (each format's loops).
 *
 * Each format's entry points below pick their loop by the instruction sets
 * allowed at the call (rwq_use_*), and give the same bits whichever runs
 * (tests/unit/test_quant.py checks every path against the NumPy reference,
 * reducer_wire/quant.py). They take no GIL and check nothing: the caller has
 * checked the sizes, holds the float32 accumulator 4-byte aligned, and sets
 * the floating-point mode around them (_fpmode.h). Buffers may otherwise be
 * unaligned (shard data sits anywhere in a received message). Little-endian
 * hosts only, like _kernels.c. The module is compiled with hidden
 * visibility: nothing here is exported beyond it.
 */
#ifndef REDUCER_WIRE_QUANT_H
#define REDUCER_WIRE_QUANT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2")))
#endif
#define INLINE static inline __attribute__((always_inline))

#define NAN_BITS 0x7FC00000u

INLINE uint32_t load_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
INLINE float load_f32(const char *p) { float v; memcpy(&v, p, 4); return v; }
INLINE float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INLINE uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* The loops allowed: the CPU's best at import, narrowed by set_simd and
 * set_avx512 (tests). Written with the GIL held, read by the entry points. */
extern int rwq_use_avx2, rwq_use_f16c, rwq_use_avx512;

#ifdef HAVE_AVX2_PATH
#define PICK(name) (rwq_use_avx2 ? name##_avx2 : name##_generic)
#else
#define PICK(name) (name##_generic)
#endif

/* int8 with a float32 scale per block (_quant_int8.c): n float32 elements
 * in blocks of `block`; the wire bytes are all scales, then all codes.
 * stream: write the decoded output with streaming stores where there are
 * some (a large output not read again soon); the same bits either way. */
Py_ssize_t rwq_q8_nbytes(Py_ssize_t n, Py_ssize_t block);
void rwq_q8_encode(const char *src, char *dst, Py_ssize_t n, Py_ssize_t block);
void rwq_q8_decode(const char *src, char *dst, Py_ssize_t n, Py_ssize_t block, int stream);
void rwq_q8_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t block);

/* OCP FP8 (_quant_fp8.c): kind 0 E4M3, 1 E5M2; one byte per element. */
void rwq_fp8_encode(const char *src, char *dst, Py_ssize_t n, int kind);
void rwq_fp8_decode(const char *src, char *dst, Py_ssize_t n, int kind, int stream);
void rwq_fp8_add(float *acc, const char *src, Py_ssize_t n, int kind);

#endif
