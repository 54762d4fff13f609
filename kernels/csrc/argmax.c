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

/* The first index of the maximum of row[b0, e0), or of its first NaN (*nan set then), its
 * value in *m; b0 a multiple of BLOCK; *m = -inf and b0 where the range is empty */
static int64_t argmax_range(const void *row, int64_t b0, int64_t e0, int bf, float *m, int *nan)
{
    float best_m = -INFINITY;
    int64_t best = b0;  /* the first block holding best_m (the first where all are -inf) */
    *nan = 0;
    for (int64_t b = b0; b < e0; b += BLOCK) {
        const int64_t e = b + BLOCK < e0 ? b + BLOCK : e0;
        float x;
        if (block_max(row, b, e, bf, &x))
            for (int64_t i = b; i < e; ++i) {
                const float v = at(row, i, bf);
                if (v != v) {
                    *nan = 1;
                    *m = v;
                    return i;
                }
            }
        if (x > best_m) {
            best_m = x;
            best = b;
        }
    }
    *m = best_m;
    const int64_t e = best + BLOCK < e0 ? best + BLOCK : e0;
    for (int64_t i = best; i < e; ++i)
        if (at(row, i, bf) == best_m) return i;
    return b0;  /* an empty range */
}

#define SPLIT_MIN 65536 /* values a row needs before its parts go to threads */
#define MAX_PARTS 64

/* out[r] for rows r of V logits, rows ld apart (elements); bf: bf16, else fp32. Fewer rows than
 * threads (a decode step's one row): each row in parts, one a thread, the parts' answers then
 * taken in order (the first NaN, else the first part holding the largest maximum) */
void argmax_rows(const void *x, int64_t ld, int64_t rows, int64_t V, int bf, int64_t *out,
                 int num_threads)
{
    const int64_t esize = bf ? 2 : 4;
    int parts = num_threads < MAX_PARTS ? num_threads : MAX_PARTS;
    if (rows >= num_threads || V < SPLIT_MIN || parts < 2) {
        float m;
        int nan;
        #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 2) \
            private(m, nan)
        for (int64_t r = 0; r < rows; ++r)
            out[r] = argmax_range((const char *)x + r * ld * esize, 0, V, bf, &m, &nan);
        return;
    }
    const int64_t blocks = (V + BLOCK - 1) / BLOCK, per = (blocks + parts - 1) / parts;
    for (int64_t r = 0; r < rows; ++r) {
        const char *row = (const char *)x + r * ld * esize;
        int64_t idx[MAX_PARTS];
        float val[MAX_PARTS];
        int isnan_[MAX_PARTS];
        #pragma omp parallel for num_threads(parts) schedule(static)
        for (int t = 0; t < parts; ++t) {
            const int64_t b0 = t * per * BLOCK < V ? t * per * BLOCK : V;
            const int64_t e0 = (t + 1) * per * BLOCK < V ? (t + 1) * per * BLOCK : V;
            idx[t] = argmax_range(row, b0, e0, bf, &val[t], &isnan_[t]);
        }
        int64_t best = idx[0];
        float m = val[0];
        int done = isnan_[0];
        for (int t = 1; t < parts && !done; ++t) {
            if (isnan_[t]) {
                best = idx[t];
                done = 1;
            } else if (val[t] > m) {
                m = val[t];
                best = idx[t];
            }
        }
        out[r] = best;
    }
}
