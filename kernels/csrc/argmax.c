/* The greedy token of each row of logits (fp32 or bf16), as torch's argmax gives it: the first
 * index of the row's maximum, or of its first NaN where it has one. One pass over the row by
 * blocks of 256: a block's maximum (a vectorised reduction, NaNs noted on the way) kept with the
 * block where it is larger than every earlier block's, the first NaN's block answered at once;
 * then the first index of the maximum inside the block kept. ATen's CPU argmax runs one scalar
 * comparison per element, and the torch two-pass form (kernels' callers: hybridrt/sampler.py)
 * spends more in its small ops than in the passes (docs/performance.md).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define BLOCK 256

static inline float at(const void *row, int64_t i, int bf)
{
    return bf ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* the largest value of row[b, e) -> *m, and whether one is a NaN (the return) */
static inline int block_max(const void *row, int64_t b, int64_t e, int bf, float *m)
{
    float x = -INFINITY;
    int nan = 0;
    if (bf) {
        const uint16_t *h = row;
        #pragma omp simd reduction(max:x) reduction(|:nan)
        for (int64_t i = b; i < e; ++i) {
            const float v = bf16_to_f32(h[i]);
            nan |= v != v;
            x = v > x ? v : x;
        }
    } else {
        const float *f = row;
        #pragma omp simd reduction(max:x) reduction(|:nan)
        for (int64_t i = b; i < e; ++i) {
            const float v = f[i];
            nan |= v != v;
            x = v > x ? v : x;
        }
    }
    *m = x;
    return nan;
}

static int64_t argmax_row(const void *row, int64_t V, int bf)
{
    float m = -INFINITY;
    int64_t best = 0;  /* the first block holding m (block 0 where every value is -inf) */
    for (int64_t b = 0; b < V; b += BLOCK) {
        const int64_t e = b + BLOCK < V ? b + BLOCK : V;
        float x;
        if (block_max(row, b, e, bf, &x))
            for (int64_t i = b; i < e; ++i) {
                const float v = at(row, i, bf);
                if (v != v) return i;
            }
        if (x > m) {
            m = x;
            best = b;
        }
    }
    const int64_t e = best + BLOCK < V ? best + BLOCK : V;
    for (int64_t i = best; i < e; ++i)
        if (at(row, i, bf) == m) return i;
    return 0;  /* V == 0 */
}

/* out[r] for rows r of V logits, rows ld apart (elements); bf: bf16, else fp32 */
void argmax_rows(const void *x, int64_t ld, int64_t rows, int64_t V, int bf, int64_t *out,
                 int num_threads)
{
    const int64_t esize = bf ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 2)
    for (int64_t r = 0; r < rows; ++r)
        out[r] = argmax_row((const char *)x + r * ld * esize, V, bf);
}
