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
 *
 * OP_MOE is an MoE block's routed experts (kernels/moe_step.py builds it): the router's choice
 * is made by the caller between two runs of the list (torch's softmax and topk, the bits the
 * model's block gets), the experts' products are product operations of a table, one gate|up and
 * one down row per expert, run over the rows of the tokens that chose the expert.
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
    OP_MOE = 10,     /* moe_experts below */
};

#define TABLE_WORDS 16 /* an expert product's row: the word its row count goes in, the op */

#define P(i) ((void *)(intptr_t)a[i])
#define I(i) (a[i])

static float F(int64_t w)
{
    union { uint32_t u; float f; } c = { .u = (uint32_t)w };
    return c.f;
}

static int moe_experts(const int64_t *a, int num_threads);

/* one operation -> 0, or nonzero where it failed (out of memory, a kernel path this build
 * lacks, an unknown code) */
static int run_op(const int64_t *op, int num_threads)
{
    const int64_t *a = op + 1;
    int failed = 0;
    switch (op[0]) {
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
    case OP_MOE:
        failed = moe_experts(a, num_threads);
        break;
    default:
        failed = 1;
    }
    return failed;
}

/* -> 0, or 1 + the index of the operation that failed */
int run_step(const int64_t *ops, int64_t n, int num_threads)
{
    for (int64_t i = 0; i < n; ++i)
        if (run_op(ops + i * OP_WORDS, num_threads)) return (int)(i + 1);
    return 0;
}

/* a table row's product over its first m rows */
static int run_product(const int64_t *row, int64_t m, int num_threads)
{
    int64_t op[OP_WORDS] = {0};
    memcpy(op, row + 1, (TABLE_WORDS - 1) * sizeof(int64_t));
    op[row[0]] = m;
    return run_op(op, num_threads);
}

/* The routed experts of an MoE block and the shared expert's share, as kernels/moe.py computes
 * them: x [rows, D] bf16, the router's ids [rows, k] (int64) and weights [rows, k] (bf16),
 * sg [rows] the shared expert's sigmoid gate and sh [rows, D] its output (bf16). The rows * k
 * choices are stable-sorted by expert (order, a scratch of rows * k); per chosen expert, in
 * ascending id, the rows of its tokens are gathered (xe), its gate|up product (gu [m, 2I]),
 * silu_mul (act [m, I]) and down product (ye [m, D]) run, and each token's row of
 * out [rows, D] gets bf16(ye * weight) added in bf16 (torch's index_add_ of the product);
 * then out = bf16(out + bf16(sg * sh)). Ids outside [0, E) fail. */
static int moe_experts(const int64_t *a, int num_threads)
{
    const uint16_t *x = P(0), *w = P(4), *sg = P(6), *sh = P(14);
    const int64_t *ids = P(3), *table = P(7);
    const int64_t rows = I(1), D = I(2), k = I(5), I_ = I(8), E = I(16), n = rows * k;
    uint16_t *xe = P(9), *gu = P(10), *act = P(11), *ye = P(12), *out = P(15);
    int64_t *order = P(13);
    for (int64_t p = 0; p < n; ++p) {
        if (ids[p] < 0 || ids[p] >= E) return 1;
        int64_t q = p;
        for (; q > 0 && ids[order[q - 1]] > ids[p]; --q) order[q] = order[q - 1];
        order[q] = p;
    }
    memset(out, 0, (size_t)(rows * D) * sizeof(uint16_t));
    for (int64_t s = 0, g; s < n; s = g) {
        const int64_t e = ids[order[s]];
        for (g = s; g < n && ids[order[g]] == e; ++g)
            memcpy(xe + (g - s) * D, x + order[g] / k * D, (size_t)D * sizeof(uint16_t));
        const int64_t m = g - s, *row = table + e * 2 * TABLE_WORDS;
        if (run_product(row, m, num_threads)) return 1;
        silu_mul(gu, 2 * I_, gu + I_, 2 * I_, act, m, I_, 1, num_threads);
        if (run_product(row + TABLE_WORDS, m, num_threads)) return 1;
        for (int64_t j = 0; j < m; ++j) {
            const float wt = bf16_to_f32(w[order[s + j]]);
            const uint16_t *y = ye + j * D;
            uint16_t *o = out + order[s + j] / k * D;
            for (int64_t d = 0; d < D; ++d)
                o[d] = f32_to_bf16(bf16_to_f32(o[d])
                                   + bf16_to_f32(f32_to_bf16(bf16_to_f32(y[d]) * wt)));
        }
    }
    for (int64_t t = 0; t < rows; ++t) {
        const float gate = bf16_to_f32(sg[t]);
        uint16_t *o = out + t * D;
        for (int64_t d = 0; d < D; ++d)
            o[d] = f32_to_bf16(bf16_to_f32(o[d])
                               + bf16_to_f32(f32_to_bf16(gate * bf16_to_f32(sh[t * D + d]))));
    }
    return 0;
}

int step_op_words(void) { return OP_WORDS; }
