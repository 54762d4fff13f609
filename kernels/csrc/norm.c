/* Zero-centred RMSNorm over rows of bf16 activations, with the residual add before it fused in:
 *     r = round(x + residual) (written to res_out)
 *     out = round(r * rsqrt(mean(r^2) + eps) * (1 + w))
 * as kernels/norm.py rms_norm computes it in fp32 between its bf16 conversions (the roundings
 * to bf16 hide the different order of the sums: the results are those of the torch ops). Without
 * a residual (res == NULL) r = x and res_out is not written. Rows of D contiguous; x rows ld_x
 * apart. fp32 models keep the torch ops: there the order of the sums shows, and random test
 * weights amplify it past the parity tests' tolerance.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"

static inline void norm_row_bf16(const uint16_t *x, const uint16_t *res, uint16_t *out,
                                 uint16_t *res_out, const uint16_t *w, float eps, int64_t D,
                                 float *r)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < D; ++i) {
        float v = bf16_to_f32(x[i]);
        if (res) { const uint16_t s = f32_to_bf16(v + bf16_to_f32(res[i])); res_out[i] = s; v = bf16_to_f32(s); }
        r[i] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; ++i) out[i] = f32_to_bf16(r[i] * inv * (1.0f + bf16_to_f32(w[i])));
}

void rms_norm_bf16(const uint16_t *x, int64_t ld_x, const uint16_t *res, uint16_t *out,
                   uint16_t *res_out, const uint16_t *w, float eps, int64_t M, int64_t D,
                   int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; ++m) {
        float r[D];
        norm_row_bf16(x + m * ld_x, res ? res + m * D : 0, out + m * D,
                      res ? res_out + m * D : 0, w, eps, D, r);
    }
}

/* out = round(round(silu(gate)) * up) over rows of N (bf16 or fp32 activations; gate and up
 * rows ld_g and ld_u apart, out contiguous): the MLP's activation as the torch ops compute it,
 * with each element's arithmetic fixed by its column (vector lanes, then the scalar tail), not
 * by how many rows there are or how threads split them (torch's elementwise ops take their
 * scalar tail where the tensor's length and the thread split put it). */
void silu_mul(const void *gate, int64_t ld_g, const void *up, int64_t ld_u, void *out,
              int64_t M, int64_t N, int bf, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; ++m) {
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= N; i += 16) {
            const __m512 g = act_round16(silu16(act_ld16(gate, m * ld_g + i, bf, 0xFFFF)), bf);
            act_st16(out, m * N + i, _mm512_mul_ps(g, act_ld16(up, m * ld_u + i, bf, 0xFFFF)),
                     bf, 0xFFFF);
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= N; i += 8) {  /* exp8 computes exp16's lanes */
            const __m256 g = act_round8(silu8(act_ld8(gate, m * ld_g + i, bf)), bf);
            act_st8(out, m * N + i, _mm256_mul_ps(g, act_ld8(up, m * ld_u + i, bf)), bf);
        }
#endif
        for (; i < N; ++i)
            act_st(out, m * N + i, act_round(silu(act_ld(gate, m * ld_g + i, bf)), bf)
                   * act_ld(up, m * ld_u + i, bf), bf);
    }
}
