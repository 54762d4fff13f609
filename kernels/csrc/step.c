/* A decode step's layers in one call: a list of operations, each one of the kernels of the other
 * files with its arguments, run in order. kernels/step.py builds the list once per batch shape
 * (the weights, the caches and its own activation buffers are where they stay) and sets the few
 * per-step pointers (the step's slots, block tables, RoPE rows) before each run. The kernels and
 * their order are those of CPUBackend.forward's decode loop, so the results are the same bits;
 * what goes is the Python around each of the ~250 calls of a step (the allocation of each output,
 * the argument conversions), some 10-20 us a call once the weights' stream has pushed the
 * interpreter out of the caches.
 *
 * An operation is OP_WORDS int64 words: its code, then its arguments in the order of the kernel's
 * own parameters (pointers and integers as int64, a float as its bits in the low 32).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define OP_WORDS 32

enum {
    OP_NORM = 1,     /* rms_norm_bf16 */
    OP_INT4 = 2,     /* int4_gemm, bf16 in and out */
    OP_INT8 = 3,     /* int8_gemm_bf16 */
    OP_GEMV_BF16 = 4,/* half_gemv_bf16, bf16 out */
    OP_GEMV_F32X = 5,/* x widened to fp32 (into a buffer), then half_gemv, bf16 out */
    OP_GDN = 6,      /* gdn_fused */
    OP_ATTN = 7,     /* attn_decode */
    OP_SILU_MUL = 8, /* silu_mul */
    OP_INT6 = 9,     /* int6_gemm, bf16 in and out (a GGUF file's Q6_K layer weights) */
};

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) (a[i])

static float F(int64_t w)
{
    union { uint32_t u; float f; } c = { .u = (uint32_t)w };
    return c.f;
}

/* -> 0, or 1 + the index of the operation that failed (out of memory, or a kernel path this
 * build lacks); an unknown code fails too */
int run_step(const int64_t *ops, int64_t n, int num_threads)
{
    for (int64_t i = 0; i < n; ++i) {
        const int64_t *a = ops + i * OP_WORDS + 1;
        int failed = 0;
        switch (ops[i * OP_WORDS]) {
        case OP_NORM:
            rms_norm_bf16(P(0), I(1), P(2), P(3), P(4), P(5), F(a[6]), I(7), I(8), num_threads);
            break;
        case OP_INT4:
            failed = int4_gemm(P(0), 1, P(1), P(2), P(3), P(4), 1, I(5), I(6), I(7), I(8),
                               (int)I(9), num_threads);
            break;
        case OP_INT6:
            failed = int6_gemm(P(0), 1, P(1), P(2), P(3), P(4), P(5), 1, I(6), I(7), I(8),
                               I(9), (int)I(10), num_threads);
            break;
        case OP_INT8:
            failed = int8_gemm_bf16(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7), (int)I(8),
                                    num_threads);
            break;
        case OP_GEMV_BF16:
            half_gemv_bf16(P(0), P(1), P(2), I(3), I(4), I(5), 1, num_threads);
            break;
        case OP_GEMV_F32X: {  /* x [M, K] bf16 -> the fp32 buffer a[6], then the product */
            const uint16_t *x = P(0);
            float *xf = P(6);
            for (int64_t j = 0; j < I(3) * I(5); ++j) xf[j] = bf16_to_f32(x[j]);
            half_gemv(xf, P(1), P(2), I(3), I(4), I(5), 0, 1, num_threads);
            break;
        }
        case OP_GDN:
            failed = gdn_fused(P(0), I(1), P(2), I(3), P(4), I(5), P(6), I(7), P(8), P(9),
                               P(10), P(11), P(12), P(13), P(14), P(15), F(a[16]), P(17),
                               I(18), I(19), I(20), I(21), I(22), I(23), I(24), (int)I(25),
                               (int)I(26), num_threads);
            break;
        case OP_ATTN:
            failed = attn_decode(P(0), I(1), P(2), I(3), P(4), I(5), P(6), P(7), F(a[8]), P(9),
                                 P(10), I(11), P(12), P(13), P(14), P(15), I(16), P(17), I(18),
                                 F(a[19]), P(20), I(21), I(22), I(23), I(24), I(25), (int)I(26),
                                 (int)I(27), (int)I(28), num_threads);
            break;
        case OP_SILU_MUL:
            silu_mul(P(0), I(1), P(2), I(3), P(4), I(5), I(6), (int)I(7), num_threads);
            break;
        default:
            failed = 1;
        }
        if (failed) return (int)(i + 1);
    }
    return 0;
}

int step_op_words(void) { return OP_WORDS; }
