/* The kernels' results must not depend on the calling thread's floating-point
 * mode. TensorFlow runs its graph ops (tf.numpy_function among them, and so
 * our client, and every thread started from there, which inherits the mode)
 * with MXCSR's flush-to-zero and denormals-are-zero bits set. The scalar
 * float16 widening goes through float32 denormals for float16 subnormals:
 * under DAZ they came out 0, only for the elements outside the vector loop,
 * so ranks whose buffers were aligned differently got different results.
 * RW_FP_ENTER clears both bits for the kernel; RW_FP_LEAVE restores them. */
#ifndef REDUCER_WIRE_FPMODE_H
#define REDUCER_WIRE_FPMODE_H

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define RW_MXCSR_FTZ_DAZ 0x8040u
#define RW_FP_ENTER                                   \
    unsigned int rw_saved_mxcsr_ = _mm_getcsr();      \
    _mm_setcsr(rw_saved_mxcsr_ & ~RW_MXCSR_FTZ_DAZ)
#define RW_FP_LEAVE _mm_setcsr(rw_saved_mxcsr_)
#else
#define RW_FP_ENTER do { } while (0)
#define RW_FP_LEAVE do { } while (0)
#endif

#endif
