/* Quantization of a weight [N, K] into kernels/int4.py's 4-bit or 6-bit format (csrc/int4_gemm.c
 * describes them): the same operations as int4.py's torch code (``quantize_reference``), so that
 * both give the same bytes, here in C because the search below makes several passes over every
 * weight (minutes at the 0.8B shape in torch).
 *
 * Per column and group of 32 inputs: the step d and minimum m (w ~= d q - m, q in [0, qmax]:
 * 15 for 4 bits, 63 for 6) that minimise the squared error weighted by rms(group) + |w| over the
 * min/max grid and steps + 1 grids of qmax - 1 .. qmax + 1 steps over the range, each refitted
 * by weighted least squares with the minimum kept <= 0 (llama.cpp's Q4_K search,
 * make_qkx2_quants). The fit's sums are in double: their order (vector lanes here, pairwise in
 * torch) then moves them by ~1e-16, which can change a choice only on an exact tie. Then per
 * superblock of 8 groups D = bf16(max d / 255), M = bf16(max m / 255), codes sc = round(d / D)
 * (at least 1 where d > 0), mc = round(m / M), and q = round((w + M mc) / (D sc)), all in fp32
 * as torch does them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define NR 16
#define QK 32
#define SBG 8

/* w's group [32] (zeros and weight 0 past ``valid``) -> *d, *m */
static void fit(const float *x, int valid, int qmax, int steps, float *d_out, float *m_out)
{
    float lo = 0.0f, hi = x[0];
    for (int i = 0; i < QK; ++i) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    const float rng = hi - lo;
    double ss = 0.0;
    for (int i = 0; i < QK; ++i) ss += (double)x[i] * (double)x[i];
    const double av = sqrt(ss / QK);
    double wt[QK], xd[QK], sw = 0.0, swx = 0.0, swxx = 0.0;
    float t[QK];
    for (int i = 0; i < QK; ++i) {
        xd[i] = x[i];
        wt[i] = i < valid ? av + fabs((double)x[i]) : 0.0;
        sw += wt[i];
        swx += wt[i] * x[i];
        swxx += wt[i] * x[i] * x[i];
        t[i] = x[i] - lo;
    }
    const float d0 = rng / (float)qmax, fq = (float)qmax;
    double best_err = 0.0, best_d = d0, best_mn = lo;
    for (int i = 0; i < QK; ++i) {
        const float q = d0 > 0.0f ? fminf(fmaxf(nearbyintf(t[i] / d0), 0.0f), fq) : 0.0f;
        const double e = (double)q * d0 + lo - x[i];
        best_err += wt[i] * e * e;
    }
    for (int s = 0; s <= steps; ++s) {
        const float iscale = rng > 0.0f ? (float)((double)(qmax - 1) + 2.0 * s / steps) / rng
                                        : 0.0f;
        double s1 = 0.0, s2 = 0.0, sx = 0.0;
        /* vector lanes of partial sums (in double, their order moves the sums by ~1e-16) */
        #pragma omp simd reduction(+:s1, s2, sx)
        for (int i = 0; i < QK; ++i) {
            const double q = fminf(fmaxf(nearbyintf(t[i] * iscale), 0.0f), fq);
            const double wq = wt[i] * q;
            s1 += wq;
            s2 += wq * q;
            sx += wq * xd[i];
        }
        const double den = sw * s2 - s1 * s1;
        if (!(den > 0.0)) continue;
        double d = (sw * sx - swx * s1) / den, mn = (s2 * swx - s1 * sx) / den;
        if (mn > 0.0) {
            d = s2 > 0.0 ? sx / s2 : 0.0;
            mn = 0.0;
        }
        const double err = d * d * s2 + 2 * d * mn * s1 - 2 * d * sx + mn * mn * sw - 2 * mn * swx
                           + swxx;
        if (err < best_err && d > 0.0) {
            best_err = err;
            best_d = d;
            best_mn = mn;
        }
    }
    *d_out = (float)(best_d + 0.0); /* no -0.0: the codes' maxima */
    *m_out = (float)(0.0 - best_mn);
}

/* One panel: rows 16 p .. 16 p + 15 of w (fp32, or bf16 when w_bf; zeros past N) into qs, hs
 * (6 bits), codes and scales at the panel. d, m: scratch [16 G], [16 G]. */
static void panel(const void *w, int w_bf, int64_t N, int64_t K, int64_t p, int64_t G, int64_t S,
                  int qmax, int steps, uint8_t *qs, uint8_t *hs, uint8_t *codes,
                  uint16_t *scales, float *d, float *m)
{
    for (int c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        for (int64_t g = 0; g < G; ++g) {
            float x[QK];
            const int valid = n < N ? (int)(K - g * QK < QK ? K - g * QK : QK) : 0;
            for (int i = 0; i < QK; ++i) x[i] = i < valid ? act_ld(w, n * K + g * QK + i, w_bf) : 0.0f;
            if (n < N) fit(x, valid, qmax, steps, &d[c * G + g], &m[c * G + g]);
            else d[c * G + g] = m[c * G + g] = 0.0f;
        }
    }
    uint8_t *qp = qs + p * G * 256, *cp = codes + p * G * 2 * NR;
    uint16_t *sp = scales + p * S * 2 * NR;
    uint8_t *hp = hs ? hs + p * G * 128 : NULL;
    memset(qp, 0, (size_t)(G * 256));
    if (hp) memset(hp, 0, (size_t)(G * 128));
    for (int c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        for (int64_t s = 0; s < S; ++s) {
            const int64_t g0 = s * SBG, g1 = g0 + SBG < G ? g0 + SBG : G;
            float dmax = 0.0f, mmax = 0.0f;
            for (int64_t g = g0; g < g1; ++g) {
                dmax = fmaxf(dmax, d[c * G + g]);
                mmax = fmaxf(mmax, m[c * G + g]);
            }
            const uint16_t Db = f32_to_bf16(dmax / 255.0f), Mb = f32_to_bf16(mmax / 255.0f);
            const float D = bf16_to_f32(Db), M = bf16_to_f32(Mb);
            sp[(s * 2) * NR + c] = Db;
            sp[(s * 2 + 1) * NR + c] = Mb;
            for (int64_t g = g0; g < g1; ++g) {
                float sc = D > 0.0f ? fminf(fmaxf(nearbyintf(d[c * G + g] / D), 0.0f), 255.0f) : 0.0f;
                if (d[c * G + g] > 0.0f && sc == 0.0f) sc = 1.0f;
                const float mc = M > 0.0f ? fminf(fmaxf(nearbyintf(m[c * G + g] / M), 0.0f), 255.0f)
                                          : 0.0f;
                cp[(g * 2) * NR + c] = (uint8_t)sc;
                cp[(g * 2 + 1) * NR + c] = (uint8_t)mc;
                const float dw = D * sc, mw = M * mc, inv = dw > 0.0f ? 1.0f / dw : 0.0f;
                for (int k = 0; k < QK; ++k) {
                    const int64_t kk = g * QK + k;
                    const float x = n < N && kk < K ? act_ld(w, n * K + kk, w_bf) : 0.0f;
                    const int q = (int)fminf(fmaxf(nearbyintf((x + mw) * inv), 0.0f),
                                             (float)qmax);
                    const int at = (k % 16 / 4) * 64 + 4 * c + k % 4;
                    qp[g * 256 + at] |= (uint8_t)(k < 16 ? q & 15 : (q & 15) << 4);
                    /* 6 bits: the high 2 in hs[p][g][k / 16], bits 2 (k % 16 / 4) and up */
                    if (hp) hp[g * 128 + (k / 16) * 64 + 4 * c + k % 4] |=
                        (uint8_t)((q >> 4) << (2 * (k % 16 / 4)));
                }
            }
        }
    }
}

/* w [N, K] fp32 or bf16 (w_bf) -> qs [P, G, 4, 64], hs [P, G, 2, 64] (6 bits, qmax 63; NULL
 * for 4, qmax 15), codes [P, G, 2, 16], scales [P, S, 2, 16] (P = ceil(N / 16), G = ceil(K /
 * 32), S = ceil(G / 8)); ``steps``: the grids searched past the min/max one, minus one. Returns
 * 0, or -1 when scratch memory runs out. */
int int4_quantize(const void *w, int w_bf, int64_t N, int64_t K, uint8_t *qs, uint8_t *hs,
                  uint8_t *codes, uint16_t *scales, int qmax, int steps, int num_threads)
{
    const int64_t P = (N + NR - 1) / NR, G = (K + QK - 1) / QK, S = (G + SBG - 1) / SBG;
    int failed = 0;
    if (num_threads > P) num_threads = (int)P;
    if (num_threads < 1) num_threads = 1;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *d = malloc(sizeof(float) * (size_t)(2 * NR * G));
        #pragma omp for schedule(dynamic, 4)
        for (int64_t p = 0; p < P; ++p) {
            if (!d) {
                failed = 1;
                continue;
            }
            panel(w, w_bf, N, K, p, G, S, qmax, steps, qs, hs, codes, scales, d, d + NR * G);
        }
        free(d);
    }
    return failed ? -1 : 0;
}

/* Rows ``ids`` [n] of a 4-bit (hs NULL) or 6-bit weight of N columns dequantized (the embedding
 * lookup): out [n, K] bf16 (out_bf16) or fp32, each value q * (D sc) - M mc in fp32 as
 * Int4Weight.rows computes it (the products are exact, q of 6 bits times D sc of 16, so the
 * subtraction's is the one rounding, fused or not). G
 * groups and S superblocks a column. -> 0, or -1 for an id outside [0, N) (nothing written). */
int int4_rows(const uint8_t *qs, const uint8_t *hs, const uint8_t *codes, const uint16_t *scales,
              const int64_t *ids, int64_t n, int64_t N, int64_t G, int64_t S, int64_t K,
              int out_bf16, void *out)
{
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t p = ids[i] / NR, c = ids[i] % NR;
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t *q4 = qs + ((p * G + g) * 4) * 64;
            const uint8_t *cd = codes + ((p * G + g) * 2) * NR;
            const uint16_t *sc = scales + ((p * S + g / SBG) * 2) * NR;
            const float dw = bf16_to_f32(sc[c]) * (float)cd[c];
            const float mw = bf16_to_f32(sc[NR + c]) * (float)cd[NR + c];
            for (int h = 0; h < 2; ++h)
                for (int r = 0; r < 4; ++r)
                    for (int j = 0; j < 4; ++j) {
                        const int64_t k = g * QK + 16 * h + 4 * r + j;
                        if (k >= K) continue;
                        int q = (q4[r * 64 + 4 * c + j] >> (4 * h)) & 15;
                        if (hs)
                            q |= ((hs[((p * G + g) * 2 + h) * 64 + 4 * c + j] >> (2 * r)) & 3)
                                 << 4;
                        const float prod = (float)q * dw;
                        const float w = prod - mw;
                        if (out_bf16) ((uint16_t *)out)[i * K + k] = f32_to_bf16(w);
                        else ((float *)out)[i * K + k] = w;
                    }
        }
    }
    return 0;
}
