/* A GDN layer's recurrent tokens in one call: from the in-projections' outputs to the input of
 * out_proj, for B sequences of L tokens each (decode: L = 1; draft verification: L = 1 + k;
 * a prompt chunk: one sequence, its tokens in place, as the recurrence rather than the chunked
 * form). Returns 0, or -1 where the conv outputs' scratch (N x C floats) cannot be allocated.
 *
 * Per token, as the reference ops compute it (kernels/backend.py gdn_recurrent, kernels/norm.py):
 *   conv:   m = silu(sum_j w[j] window[j]) over the K-1 state rows and the token, rounded to
 *           the activations' dtype; the state becomes the last K-1 inputs
 *   q, k:   l2-normalised heads of m (q also times DK^-1/2), expanded to HV heads
 *   gates:  decay = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b) (rounded)
 *   delta:  the gated delta rule step of csrc/gdn_decode.c on the fp32 state
 *   norm:   out = round(round(w * round(rmsnorm(round(o)))) * silu(z))
 * "round" is to bf16 when the activations are bf16 and nothing when they are fp32, which puts
 * the roundings where the reference's dtype conversions put them.
 *
 * Token t of sequence b reads its states from slot src(b, t) and writes them to dst(b, t):
 * without slots_out both are slots[b] (in place); with slots_out [B, L] (verification keeps
 * every intermediate state) src(b, 0) = slots[b], src(b, t) = slots_out[b, t-1] and
 * dst(b, t) = slots_out[b, t], so the source slot is left as it was.
 *
 * Inputs are rows with their own strides (views into one merged projection output);
 * conv_taps [K, C] and neg_exp_a (= -exp(A_log)), dt_bias [HV] are fp32 copies the backend makes
 * once; conv_states [S, K-1, C] and norm_w [DV] are in the activations' dtype; ssm
 * [S, HV, DK, DV] fp32; out [B*L, HV*DV] contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

static inline int64_t src_slot(const int64_t *slots, const int64_t *slots_out, int64_t b,
                               int64_t t, int64_t L)
{
    return (slots_out == NULL || t == 0) ? slots[b] : slots_out[b * L + t - 1];
}

static inline int64_t dst_slot(const int64_t *slots, const int64_t *slots_out, int64_t b,
                               int64_t t, int64_t L)
{
    return slots_out == NULL ? slots[b] : slots_out[b * L + t];
}

/* kS = S^T k, qS = S^T q over a state S [DK, DV] read once, row by row */
static void read_state(const float *S, const float *k, const float *q, int64_t DK, int64_t DV,
                       float *kS, float *qS)
{
    for (int64_t j = 0; j < DV; ++j) { kS[j] = 0.0f; qS[j] = 0.0f; }
    for (int64_t i = 0; i < DK; ++i) {
        const float *r = S + i * DV;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < DV; ++j) { kS[j] += ki * r[j]; qS[j] += qi * r[j]; }
    }
}

/* The same for DV = 128 (Qwen3.5's heads) with AVX-512: the 2 x 128 sums in 16 registers
 * instead of going through memory every row (fused multiply-adds, in the same order), which
 * saves the loads and stores of every row (docs/performance.md). 0 where not built. */
#if defined(__AVX512F__)
#include <immintrin.h>
static int read_state_128(const float *S, const float *k, const float *q, int64_t DK,
                          float *kS, float *qS)
{
    __m512 a[8], c[8];
    for (int u = 0; u < 8; ++u) { a[u] = _mm512_setzero_ps(); c[u] = _mm512_setzero_ps(); }
    for (int64_t i = 0; i < DK; ++i) {
        const float *r = S + i * 128;
        const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        for (int u = 0; u < 8; ++u) {
            const __m512 rv = _mm512_loadu_ps(r + 16 * u);
            a[u] = _mm512_fmadd_ps(ki, rv, a[u]);
            c[u] = _mm512_fmadd_ps(qi, rv, c[u]);
        }
    }
    for (int u = 0; u < 8; ++u) {
        _mm512_storeu_ps(kS + 16 * u, a[u]);
        _mm512_storeu_ps(qS + 16 * u, c[u]);
    }
    return 1;
}

#else
static int read_state_128(const float *S, const float *k, const float *q, int64_t DK,
                          float *kS, float *qS)
{
    (void)S; (void)k; (void)q; (void)DK; (void)kS; (void)qS;
    return 0;
}
#endif

int gdn_fused(const void *mixed, int64_t ld_mixed, const void *z, int64_t ld_z,
              const void *a, int64_t ld_a, const void *bv, int64_t ld_b,
              const float *conv_taps, void *conv_states, float *ssm,
              const int64_t *slots, const int64_t *slots_out,
              const float *neg_exp_a, const float *dt_bias, const void *norm_w, float eps,
              void *out, int64_t B, int64_t L, int64_t K, int64_t HK, int64_t HV, int64_t DK,
              int64_t DV, int bf, int simd, int num_threads)
{
    simd = simd < SIMD_MAX ? simd : SIMD_MAX;
    const int64_t C = 2 * HK * DK + HV * DV, W = K - 1, N = B * L;
    float *m = malloc(sizeof(float) * (size_t)(N * C));  /* conv outputs, rounded */
    if (m == NULL) return -1;  /* the caller raises MemoryError */
    const int64_t cs = W * C * (bf ? 2 : 4);  /* bytes per conv state slot */
    #pragma omp parallel num_threads(num_threads)
    {
        /* 1. conv: per sequence the L tokens in order, channels split between threads */
        #pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; ++b) {
            for (int64_t c0 = 0; c0 < C; c0 += 256) {
                const int64_t c1 = c0 + 256 < C ? c0 + 256 : C;
                for (int64_t t = 0; t < L; ++t) {
                    char *src = (char *)conv_states + src_slot(slots, slots_out, b, t, L) * cs;
                    char *dst = (char *)conv_states + dst_slot(slots, slots_out, b, t, L) * cs;
                    const int64_t row = b * L + t;
                    int64_t c = c0;
#if defined(__AVX512F__)
                    /* 16 channels at a time: the same products and sums (no fused multiply-add),
                     * silu with exp16 */
                    for (; simd == 2 && c + 16 <= c1; c += 16) {
                        __m512 win[16];
                        for (int64_t j = 0; j < W; ++j) win[j] = act_ld16(src, j * C + c, bf, 0xFFFF);
                        win[W] = act_ld16(mixed, row * ld_mixed + c, bf, 0xFFFF);
                        __m512 y = _mm512_mul_ps(win[0], _mm512_loadu_ps(conv_taps + c));
                        for (int64_t j = 1; j < K; ++j)
                            y = _mm512_add_ps(y, _mm512_mul_ps(
                                win[j], _mm512_loadu_ps(conv_taps + j * C + c)));
                        _mm512_storeu_ps(m + row * C + c, act_round16(silu16(y), bf));
                        for (int64_t j = 0; j < W; ++j) act_st16(dst, j * C + c, win[j + 1], bf, 0xFFFF);
                    }
#endif
#if SIMD_MAX >= 1
                    for (; simd >= 1 && c + 8 <= c1; c += 8) {  /* the same, 8 channels (AVX2) */
                        __m256 win[16];
                        for (int64_t j = 0; j < W; ++j) win[j] = act_ld8(src, j * C + c, bf);
                        win[W] = act_ld8(mixed, row * ld_mixed + c, bf);
                        __m256 y = _mm256_mul_ps(win[0], _mm256_loadu_ps(conv_taps + c));
                        for (int64_t j = 1; j < K; ++j)
                            y = _mm256_add_ps(y, _mm256_mul_ps(
                                win[j], _mm256_loadu_ps(conv_taps + j * C + c)));
                        _mm256_storeu_ps(m + row * C + c, act_round8(silu8(y), bf));
                        for (int64_t j = 0; j < W; ++j) act_st8(dst, j * C + c, win[j + 1], bf);
                    }
#endif
                    for (; c < c1; ++c) {
                        float win[16];  /* K <= 16, checked by the caller */
                        for (int64_t j = 0; j < W; ++j) win[j] = act_ld(src, j * C + c, bf);
                        win[W] = act_ld(mixed, row * ld_mixed + c, bf);
                        float y = win[0] * conv_taps[c];
                        for (int64_t j = 1; j < K; ++j) y += win[j] * conv_taps[j * C + c];
                        m[row * C + c] = act_round(silu(y), bf);
                        for (int64_t j = 0; j < W; ++j) act_st(dst, j * C + c, win[j + 1], bf);
                    }
                }
            }
        }
        /* 2. per (sequence, value head): gates, q/k norms, the delta rule over the L tokens,
         * the gated output norm */
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * HV; ++bh) {
            const int64_t b = bh / HV, h = bh % HV, hk = h / (HV / HK);
            float qn[DK], kn[DK], kS[DV], qS[DV], delta[DV], o[DV];
            for (int64_t t = 0; t < L; ++t) {
                const int64_t row = b * L + t;
                const float *mq = m + row * C + hk * DK, *mk = mq + HK * DK;
                const float *mv = m + row * C + 2 * HK * DK + h * DV;
                float sq = 0.0f, sk = 0.0f;
                for (int64_t i = 0; i < DK; ++i) { sq += mq[i] * mq[i]; sk += mk[i] * mk[i]; }
                const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
                const float scale = 1.0f / sqrtf((float)DK);
                for (int64_t i = 0; i < DK; ++i) { qn[i] = mq[i] * rq * scale; kn[i] = mk[i] * rk; }
                float x = act_ld(a, row * ld_a + h, bf) + dt_bias[h];
                const float sp = x > 20.0f ? x : log1pf(expf(x));
                const float d = expf(neg_exp_a[h] * sp);
                const float beta = act_round(1.0f / (1.0f + expf(-act_ld(bv, row * ld_b + h, bf))), bf);
                const float *S = ssm + (src_slot(slots, slots_out, b, t, L) * HV + h) * DK * DV;
                float *S2 = ssm + (dst_slot(slots, slots_out, b, t, L) * HV + h) * DK * DV;
                float qk = 0.0f;
                for (int64_t i = 0; i < DK; ++i) qk += qn[i] * kn[i];
                if (DV != 128 || !read_state_128(S, kn, qn, DK, kS, qS))
                    read_state(S, kn, qn, DK, DV, kS, qS);
                float ss = 0.0f;
                for (int64_t j = 0; j < DV; ++j) {
                    delta[j] = beta * (mv[j] - d * kS[j]);
                    o[j] = act_round(d * qS[j] + qk * delta[j], bf);
                    ss += o[j] * o[j];
                }
                /* the next head's state, read while this one is written (the read pass above
                 * and this write pass would otherwise leave memory idle in turn) */
                const char *next = t == L - 1 && bh + 1 < B * HV
                    ? (const char *)(ssm + (src_slot(slots, slots_out, (bh + 1) / HV, 0, L) * HV
                                            + (bh + 1) % HV) * DK * DV) : NULL;
                const int64_t lines = DV * 4 / 64;  /* cache lines of one state row */
                for (int64_t i = 0; i < DK; ++i) {
                    const float *r = S + i * DV;
                    float *r2 = S2 + i * DV;
                    const float ki = kn[i];
                    if (next != NULL)
                        for (int64_t c = 0; c < lines; ++c)
                            __builtin_prefetch(next + (i * lines + c) * 64, 0, 3);
                    for (int64_t j = 0; j < DV; ++j) r2[j] = d * r[j] + ki * delta[j];
                }
                const float inv = 1.0f / sqrtf(ss / (float)DV + eps);
                int64_t j0 = 0;
#if defined(__AVX512F__)
                for (; simd == 2 && j0 + 16 <= DV; j0 += 16) {
                    const __m512 on = act_round16(_mm512_mul_ps(_mm512_loadu_ps(o + j0),
                                                                _mm512_set1_ps(inv)), bf);
                    const __m512 y = act_round16(_mm512_mul_ps(act_ld16(norm_w, j0, bf, 0xFFFF),
                                                               on), bf);
                    const __m512 zz = act_ld16(z, row * ld_z + h * DV + j0, bf, 0xFFFF);
                    act_st16(out, row * HV * DV + h * DV + j0, _mm512_mul_ps(y, silu16(zz)), bf,
                             0xFFFF);
                }
#endif
#if SIMD_MAX >= 1
                for (; simd >= 1 && j0 + 8 <= DV; j0 += 8) {
                    const __m256 on = act_round8(_mm256_mul_ps(_mm256_loadu_ps(o + j0),
                                                               _mm256_set1_ps(inv)), bf);
                    const __m256 y = act_round8(_mm256_mul_ps(act_ld8(norm_w, j0, bf), on), bf);
                    const __m256 zz = act_ld8(z, row * ld_z + h * DV + j0, bf);
                    act_st8(out, row * HV * DV + h * DV + j0, _mm256_mul_ps(y, silu8(zz)), bf);
                }
#endif
                for (int64_t j = j0; j < DV; ++j) {
                    const float y = act_round(act_ld(norm_w, j, bf) * act_round(o[j] * inv, bf), bf);
                    const float zz = act_ld(z, row * ld_z + h * DV + j, bf);
                    act_st(out, row * HV * DV + h * DV + j, y * silu(zz), bf);
                }
            }
        }
    }
    free(m);
    return 0;
}
