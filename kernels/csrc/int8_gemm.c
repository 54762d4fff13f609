/* y = x W^T with int8 weights (one fp16 scale per 32 inputs) and fp32 activations, for every
 * number of rows (decode, draft verification, prefill).
 *
 * W [N, K] comes packed by kernels/quant.py (``quantize``) in panels of 16 output columns and
 * groups of 32 inputs: qs[p][g][k4][c][j] = q(W[16 p + c][32 g + 4 k4 + j]) (int8, zero past N),
 * sc[p][g][c] = the fp16 scale of that column's group, W ~= q * scale. K is a multiple of 32
 * (the caller pads). One 64-byte row qs[p][g][k4] holds 4 consecutive inputs of 16 columns:
 * what one AVX-512 VNNI ``vpdpbusd`` multiplies by 4 bytes of x broadcast to every lane.
 *
 * Each row of x is first quantized the same way (per group of 32: d = amax / 127,
 * q = round(x * 127 / amax)), then every group's dot product is exact in int32 and
 * y[m][n] = sum over g of dot(m, n, g) * (d_x[m][g] * d_w[n][g]), summed in fp32 in the order of
 * g. Each row's result is computed by the same operations whatever the number of rows and the
 * tile it falls in, so a row's output does not depend on the batch it is in.
 *
 * Paths (``int8_isas`` says which this build has; the caller picks one per call):
 *   ISA_REF  plain C;
 *   ISA_AVX2 AVX2: vpmaddubsw on |x| and sign(x) * w, widened by vpmaddwd;
 *   ISA_VNNI AVX-512 VNNI: vpdpbusd on (w + 128) as unsigned bytes and x as signed ones, which
 *            adds 128 * sum(x) to every group's dot product; that sum is taken off per group.
 * Threads (OpenMP) take blocks of panels: up to 8 rows of x (decode, draft verification, small
 * batches), one panel a block and one tile of all the rows, each weight element loaded once for
 * every row; more rows, two panels a block and tiles of up to 4 rows. x and y are fp32 or bf16
 * (``int8_gemm_bf16``).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NR 16 /* output columns per panel */
#define QK 32 /* inputs per group */
#define MR 4  /* rows of x per tile (more than MRX rows) */
#define NP 2  /* panels per tile (more than MRX rows) */
#define MRX 8 /* up to this many rows: one tile of them all, one panel wide */
#define SPLIT_MAX 4   /* vnni: up to this many (row, panel) sums, two chains each */
#define PF_AHEAD 8192 /* bytes of the weight stream prefetched ahead of the tile's loads */

enum { ISA_REF = 1, ISA_AVX2 = 2, ISA_VNNI = 4 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2 1
#endif

int int8_isas(void)
{
    int isas = ISA_REF;
#ifdef HAVE_AVX2
    isas |= ISA_AVX2;
#endif
#ifdef HAVE_VNNI
    isas |= ISA_VNNI;
#endif
    return isas;
}

static inline float fp16_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
        return v.f;
    }
    if (exp == 31) v.u = sign | 0x7f800000u | (man << 13);
    else v.u = sign | ((exp + 112) << 23) | (man << 13);
    return v.f;
}

/* One row of x (fp32, or bf16 when ``bf``; K inputs, zeros past K up to Kp, a multiple of 32)
 * -> q [Kp] int8, d [Kp / 32] scales, s [Kp / 32] sums of q per group. */
static void quantize_row_ref(const void *x, int bf, int64_t K, int64_t Kp, int8_t *q, float *d,
                             int32_t *s)
{
    for (int64_t g = 0; g < Kp / QK; ++g) {
        float xg[QK];
        float amax = 0.0f;
        for (int i = 0; i < QK; ++i) {
            const int64_t k = g * QK + i;
            xg[i] = k < K ? act_ld(x, k, bf) : 0.0f;
            amax = fmaxf(amax, fabsf(xg[i]));
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[g] = amax / 127.0f;
        int32_t sum = 0;
        for (int i = 0; i < QK; ++i) {
            const int v = (int)nearbyintf(xg[i] * id);
            q[g * QK + i] = (int8_t)v;
            sum += v;
        }
        s[g] = sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The same with 16 inputs a vector: the same products, rounded to nearest even by the
 * conversion as nearbyintf rounds them (default rounding mode), the same exact sums. */
static inline __m512 load16(const void *x, int bf, int64_t k, int64_t K)
{
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF
                        : K <= k ? (__mmask16)0 : (__mmask16)((1u << (K - k)) - 1);
    return act_ld16(x, k, bf, m);  /* inputs k.. that lie before K, zeros past it */
}

static void quantize_row_simd(const void *x, int bf, int64_t K, int64_t Kp, int8_t *q, float *d,
                              int32_t *s)
{
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g < Kp / QK; ++g) {
        const __m512 x0 = load16(x, bf, g * QK, K), x1 = load16(x, bf, g * QK + 16, K);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, absmask),
                                                              _mm512_and_ps(x1, absmask)));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[g] = amax / 127.0f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid));
        const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
        _mm_storeu_si128((__m128i *)(q + g * QK), _mm512_cvtepi32_epi8(v0));
        _mm_storeu_si128((__m128i *)(q + g * QK + 16), _mm512_cvtepi32_epi8(v1));
        s[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
    }
}
#define HAVE_QUANT_SIMD 1
#endif

/* The plain C path quantizes in plain C too (the tests compare every path with it). */
static void quantize_row(const void *x, int bf, int64_t K, int64_t Kp, int8_t *q, float *d,
                         int32_t *s, int isa)
{
#ifdef HAVE_QUANT_SIMD
    if (isa != ISA_REF) { quantize_row_simd(x, bf, K, Kp, q, d, s); return; }
#endif
    (void)isa;
    quantize_row_ref(x, bf, K, Kp, q, d, s);
}

/* The quantization alone, for the tests: M rows of x (as in ``gemm`` below) -> q [M, Kp],
 * d and s [M, Kp / 32]. Returns -1 for a path not in this build or a bad Kp. */
int int8_quantize_rows(const void *x, int x_bf, int8_t *q, float *d, int32_t *s, int64_t M,
                       int64_t K, int64_t Kp, int isa)
{
    if (!(isa & int8_isas()) || (isa & (isa - 1)) || Kp % QK || K > Kp) return -1;
    const int64_t xb = x_bf ? 2 : 4;
    for (int64_t m = 0; m < M; ++m)
        quantize_row((const char *)x + m * K * xb, x_bf, K, Kp, q + m * Kp, d + m * (Kp / QK),
                     s + m * (Kp / QK), isa);
    return 0;
}

/* Arguments of every tile: rows [i, i + mr) of the quantized x, panels [p, p + np). The vector
 * paths read x interleaved by tile (``interleave``): a tile's 4-byte steps of all its rows side
 * by side, and its rows' scales and sums per group side by side, so that one pointer and
 * constant offsets reach them all. */
typedef struct {
    const int8_t *xq;   /* [M, K] row-major */
    const float *xd;    /* [M, G] */
    const int32_t *xs;  /* [M, G] */
    const int32_t *xi;  /* per tile of mr rows at row i: [G * QK / 4][mr], from xi + i * K / 4 */
    const float *xdi;   /* per tile: [G][mr], from xdi + i * G */
    const int32_t *xsi; /* per tile: [G][mr] the sums times -128, from xsi + i * G */
    const int8_t *w;
    const uint16_t *sc;
    void *y; /* [M, N], fp32 or bf16 (y_bf) */
    int64_t N, K, G;
    int y_bf;
} Args;

/* acc [16] (fp32 sums of one panel) into row r of y, columns n0.. (short at N) */
static void store(const Args *a, int64_t r, const float *acc, int64_t n0)
{
    for (int c = 0; c < NR && n0 + c < a->N; ++c) act_st(a->y, r * a->N + n0 + c, acc[c], a->y_bf);
}

/* the 4 inputs k4 of group g of row r of the tile of mr rows at row i, as one int32 */
static inline const int32_t *x_at(const Args *a, int64_t i, int mr, int r, int64_t g, int k4)
{
    return a->xi + i * (a->K / 4) + (g * (QK / 4) + k4) * mr + r;
}

/* rows [i, i + mr) of the quantized x (row-major xq, xd, xs) into the tile layout of Args */
static void interleave(const int8_t *xq, const float *xd, const int32_t *xs, int32_t *xi,
                       float *xdi, int32_t *xsi, int64_t i, int mr, int64_t K, int64_t G)
{
    for (int r = 0; r < mr; ++r) {
        const int8_t *row = xq + (i + r) * K;
        for (int64_t s = 0; s < K / 4; ++s) memcpy(xi + i * (K / 4) + s * mr + r, row + 4 * s, 4);
        for (int64_t g = 0; g < G; ++g) {
            xdi[i * G + g * mr + r] = xd[(i + r) * G + g];
            xsi[i * G + g * mr + r] = -128 * xs[(i + r) * G + g];
        }
    }
}

static void tile_ref(const Args *a, int64_t i, int64_t p, int mr, int np)
{
    const int64_t K = a->K, G = a->G;
    for (int r = 0; r < mr; ++r) {
        const int8_t *xr = a->xq + (i + r) * K;
        const float *dr = a->xd + (i + r) * G;
        for (int t = 0; t < np; ++t) {
            float acc[NR];
            for (int c = 0; c < NR; ++c) acc[c] = 0.0f;
            for (int64_t g = 0; g < G; ++g) {
                const int8_t *wg = a->w + ((p + t) * G + g) * (QK * NR);
                const uint16_t *sg = a->sc + ((p + t) * G + g) * NR;
                for (int c = 0; c < NR; ++c) {
                    int32_t dot = 0;
                    for (int k4 = 0; k4 < QK / 4; ++k4)
                        for (int j = 0; j < 4; ++j)
                            dot += xr[g * QK + 4 * k4 + j] * wg[k4 * 4 * NR + c * 4 + j];
                    acc[c] += (float)dot * (dr[g] * fp16_to_float(sg[c]));
                }
            }
            store(a, i + r, acc, (p + t) * NR);
        }
    }
}

#ifdef HAVE_AVX2
/* rows of x per pass of tile_avx2 over a panel: R x 2 int32 and R x 2 fp32 sums, the two
 * weight vectors, |x|, x, the constant and the temporaries within the registers (32 ymm with
 * AVX-512 VL, 16 on an AVX2 CPU); half as many over two panels */
#ifndef AVX2_R
#ifdef __AVX512VL__
#define AVX2_R 4
#else
#define AVX2_R 2
#endif
#endif

/* Rows [i + r0, i + r0 + R) (R a literal) of the tile of mr rows at i, by panels [p, p + np):
 * every group's integer sums and every column's fp32 sums of these rows in registers, over all
 * the panels' groups. The weight stream ahead is prefetched into L2 by the first pass of the
 * first tile of rows, as in tile_vnni (not for one row, as there); later passes read the panel
 * from L1 / L2. */
static inline __attribute__((always_inline)) void pass_avx2(const Args *a, int64_t i, int64_t p,
                                                            int mr, int r0, int R, int np)
{
    const int64_t G = a->G;
    const __m256i ones = _mm256_set1_epi16(1);
    const int pf = i == 0 && r0 == 0 && mr > 1;
    __m256 accf[AVX2_R][NP][2];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) accf[r][t][0] = accf[r][t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m256i acci[AVX2_R][NP][2];
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            #pragma GCC unroll 2
            for (int t = 0; t < NP; ++t) acci[r][t][0] = acci[r][t][1] = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (int k4 = 0; k4 < QK / 4; ++k4) {
            __m256i w[NP][2];
            #pragma GCC unroll 2
            for (int t = 0; t < NP; ++t) {
                if (t < np) {
                    const int8_t *wk = a->w + ((p + t) * G + g) * (QK * NR) + k4 * 4 * NR;
                    w[t][0] = _mm256_loadu_si256((const __m256i *)wk);
                    w[t][1] = _mm256_loadu_si256((const __m256i *)(wk + 32));
                    if (pf) _mm_prefetch((const char *)wk + PF_AHEAD, _MM_HINT_T1);
                }
            }
            #pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m256i xv = _mm256_set1_epi32(*x_at(a, i, mr, r0 + r, g, k4));
                const __m256i ax = _mm256_abs_epi8(xv);
                #pragma GCC unroll 2
                for (int t = 0; t < NP; ++t) {
                    if (t < np) {
                        #pragma GCC unroll 2
                        for (int h = 0; h < 2; ++h) {
                            const __m256i pr = _mm256_maddubs_epi16(
                                ax, _mm256_sign_epi8(w[t][h], xv));
                            acci[r][t][h] = _mm256_add_epi32(acci[r][t][h],
                                                             _mm256_madd_epi16(pr, ones));
                        }
                    }
                }
            }
        }
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) {
            if (t < np) {
                const uint16_t *sg = a->sc + ((p + t) * G + g) * NR;
                const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
                const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 8)));
                #pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const __m256 dx = _mm256_set1_ps(a->xdi[i * G + g * mr + r0 + r]);
                    __m256 *f = accf[r][t];
                    f[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[r][t][0]),
                                           _mm256_mul_ps(dw0, dx), f[0]);
                    f[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[r][t][1]),
                                           _mm256_mul_ps(dw1, dx), f[1]);
                }
            }
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) {
            if (t < np) {
                const int64_t n0 = (p + t) * NR, row = i + r0 + r;
                if (n0 + NR <= a->N && !a->y_bf) {
                    float *yr = (float *)a->y + row * a->N;
                    _mm256_storeu_ps(yr + n0, accf[r][t][0]);
                    _mm256_storeu_ps(yr + n0 + 8, accf[r][t][1]);
                } else {
                    float acc[NR];
                    _mm256_storeu_ps(acc, accf[r][t][0]);
                    _mm256_storeu_ps(acc + 8, accf[r][t][1]);
                    store(a, row, acc, n0);
                }
            }
        }
    }
}

/* Rows [i, i + mr) (mr <= MRX, a literal) by panels [p, p + np): passes of rows split evenly
 * over the fewest passes of at most AVX2_R rows (AVX2_R / 2 over two panels). A row's sums are
 * the same whatever pass it falls in. */
static inline __attribute__((always_inline)) void tile_avx2(const Args *a, int64_t i, int64_t p,
                                                            int mr, int np)
{
    const int rmax = np > 1 && AVX2_R > 1 ? AVX2_R / 2 : AVX2_R;
    #pragma GCC unroll 8
    for (int r0 = 0; r0 < mr;) {
        const int passes = (mr - r0 + rmax - 1) / rmax, r = (mr - r0 + passes - 1) / passes;
        switch (r) {
        case 1: pass_avx2(a, i, p, mr, r0, 1, np); break;
#if AVX2_R >= 2
        case 2: pass_avx2(a, i, p, mr, r0, 2, np); break;
#endif
#if AVX2_R >= 3
        case 3: pass_avx2(a, i, p, mr, r0, 3, np); break;
#endif
#if AVX2_R >= 4
        case 4: pass_avx2(a, i, p, mr, r0, 4, np); break;
#endif
        default: break;
        }
        r0 += r;
    }
}
#endif

#ifdef HAVE_VNNI
/* Rows [i, i + mr) (mr <= MRX) by panels [p, p + np), every row's integer and fp32 sums in
 * registers. A group's integer sums start at -128 * sum(x) (the bias taken off up front); where
 * the tile has at most SPLIT_MAX (row, panel) sums, odd steps go to a second sum (more
 * dependency chains, so that a few rows are not bound by the dot products' latency; exact in
 * int32). The weight stream ahead is prefetched into L2: alone, the hardware prefetcher left the
 * loads of a few rows waiting on memory and their arithmetic not overlapped with it. One row
 * is not prefetched: one panel a block is one sequential stream the hardware follows, and the
 * extra prefetches made a whole decode step's one-row products slower (docs/performance.md). */
static inline __attribute__((always_inline)) void tile_vnni(const Args *a, int64_t i, int64_t p,
                                                            int mr, int np)
{
    const int64_t G = a->G;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512 accf[MRX][NP];
    #pragma GCC unroll 8
    for (int r = 0; r < MRX; ++r)
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) accf[r][t] = _mm512_setzero_ps();
    const int split = mr * np <= SPLIT_MAX;
    for (int64_t g = 0; g < G; ++g) {
        __m512i acci[MRX][NP], odd[SPLIT_MAX];
        #pragma GCC unroll 8
        for (int r = 0; r < MRX; ++r) {
            const __m512i start = r < mr ? _mm512_set1_epi32(a->xsi[i * G + g * mr + r])
                                         : _mm512_setzero_si512();
            #pragma GCC unroll 2
            for (int t = 0; t < NP; ++t) acci[r][t] = start;
        }
        #pragma GCC unroll 4
        for (int j = 0; j < SPLIT_MAX; ++j) odd[j] = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int k4 = 0; k4 < QK / 4; ++k4) {
            __m512i w[NP];
            #pragma GCC unroll 2
            for (int t = 0; t < NP; ++t) {
                if (t < np) {
                    const int8_t *wk = a->w + ((p + t) * G + g) * (QK * NR) + k4 * 4 * NR;
                    w[t] = _mm512_xor_si512(bias, _mm512_loadu_si512(wk));
                    if (i == 0 && mr > 1)  /* the first tile of rows, more than one */
                        _mm_prefetch((const char *)wk + PF_AHEAD, _MM_HINT_T1);
                }
            }
            #pragma GCC unroll 8
            for (int r = 0; r < MRX; ++r) {
                if (r < mr) {
                    const __m512i xv = _mm512_set1_epi32(*x_at(a, i, mr, r, g, k4));
                    #pragma GCC unroll 2
                    for (int t = 0; t < NP; ++t) {
                        if (t < np) {
                            if (split && (k4 & 1))
                                odd[r * np + t] = _mm512_dpbusd_epi32(odd[r * np + t], w[t],
                                                                      xv);
                            else
                                acci[r][t] = _mm512_dpbusd_epi32(acci[r][t], w[t], xv);
                        }
                    }
                }
            }
        }
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) {
            if (t < np) {
                const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(
                    (const __m256i *)(a->sc + ((p + t) * G + g) * NR)));
                #pragma GCC unroll 8
                for (int r = 0; r < MRX; ++r) {
                    if (r < mr) {
                        const __m512i dot = split ? _mm512_add_epi32(acci[r][t], odd[r * np + t])
                                                  : acci[r][t];
                        const __m512 dx = _mm512_set1_ps(a->xdi[i * G + g * mr + r]);
                        accf[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                                     _mm512_mul_ps(dw, dx), accf[r][t]);
                    }
                }
            }
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < MRX; ++r) {
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) {
            if (r < mr && t < np) {
                const int64_t n0 = (p + t) * NR;
                if (n0 + NR <= a->N && !a->y_bf) {
                    _mm512_storeu_ps((float *)a->y + (i + r) * a->N + n0, accf[r][t]);
                } else {
                    float acc[NR];
                    _mm512_storeu_ps(acc, accf[r][t]);
                    store(a, i + r, acc, n0);
                }
            }
        }
    }
}
#endif

/* mr and np as literals at every call, so that the unrolled loops keep the tile in registers */
#define CASES(fn)                                                                 \
    switch (mr * 2 + np - 1) {                                                    \
    case 2: fn(a, i, p, 1, 1); break;                                             \
    case 3: fn(a, i, p, 1, 2); break;                                             \
    case 4: fn(a, i, p, 2, 1); break;                                             \
    case 5: fn(a, i, p, 2, 2); break;                                             \
    case 6: fn(a, i, p, 3, 1); break;                                             \
    case 7: fn(a, i, p, 3, 2); break;                                             \
    case 8: fn(a, i, p, 4, 1); break;                                             \
    case 9: fn(a, i, p, 4, 2); break;                                             \
    case 10: fn(a, i, p, 5, 1); break;                                            \
    case 12: fn(a, i, p, 6, 1); break;                                            \
    case 14: fn(a, i, p, 7, 1); break;                                            \
    default: fn(a, i, p, 8, 1); break;                                            \
    }

static void tile(const Args *a, int64_t i, int64_t p, int mr, int np, int isa)
{
#ifdef HAVE_VNNI
    if (isa == ISA_VNNI) { CASES(tile_vnni) return; }
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) { CASES(tile_avx2) return; }
#endif
    (void)isa;
    tile_ref(a, i, p, mr, np);
}

/* Rows [i, i + mr) of x (mr_max a tile, fewer at the end of M) quantized (xq, xd, xs) and
 * interleaved for the tile that reads them (xi, xdi, xsi). */
static void prepare_tile(const void *x, int x_bf, int64_t xb, int8_t *xq, float *xd,
                         int32_t *xs, int32_t *xi, float *xdi, int32_t *xsi, int64_t i,
                         int64_t M, int mr_max, int64_t K, int64_t Kp, int isa)
{
    const int mr = M - i < mr_max ? (int)(M - i) : mr_max;
    const int64_t G = Kp / QK;
    for (int64_t m = i; m < i + mr; ++m)
        quantize_row((const char *)x + m * K * xb, x_bf, K, Kp, xq + m * Kp, xd + m * G,
                     xs + m * G, isa);
    interleave(xq, xd, xs, xi, xdi, xsi, i, mr, Kp, G);
}

/* y [M, N] = x [M, K] W^T with x fp32 or bf16 (x_bf) holding K inputs a row, zeros past K up
 * to Kp (a multiple of 32, the packed width), y fp32 or bf16 (y_bf; the fp32 sums rounded to
 * nearest even once). Returns 0, or -1 when the path ``isa`` is not in this build or memory runs
 * out (y untouched). */
static int gemm(const void *x, int x_bf, const int8_t *qs, const uint16_t *sc, void *y, int y_bf,
                int64_t M, int64_t N, int64_t K, int64_t Kp, int isa, int num_threads)
{
    if (!(isa & int8_isas()) || (isa & (isa - 1)) || Kp % QK || K > Kp) return -1;
    /* Up to MRX rows (decode, verifications, small batches): one tile of all rows a panel, each
     * weight element loaded once for all of them, and blocks of one panel, so that each thread
     * reads its share of the weight as one sequential stream; more rows: tiles of MR rows by two
     * panels, each row's quantized inputs used twice a load. A row's sums are the same either
     * way. */
    const int few = M <= MRX, np_max = few ? 1 : NP, mr_max = few ? MRX : MR;
    const int64_t G = Kp / QK, P = (N + NR - 1) / NR, blocks = (P + np_max - 1) / np_max;
    const int64_t xb = x_bf ? 2 : 4, row_tiles = (M + mr_max - 1) / mr_max;
    int8_t *xq = malloc((size_t)(M * Kp) + 64);
    int32_t *xi = malloc((size_t)(M * Kp) + 64);
    float *xd = malloc(sizeof(float) * (size_t)(M * G) + 64);
    float *xdi = malloc(sizeof(float) * (size_t)(M * G) + 64);
    int32_t *xs = malloc(sizeof(int32_t) * (size_t)(M * G) + 64);
    int32_t *xsi = malloc(sizeof(int32_t) * (size_t)(M * G) + 64);
    if (!xq || !xi || !xd || !xdi || !xs || !xsi) {
        free(xq); free(xi); free(xd); free(xdi); free(xs); free(xsi);
        return -1;
    }
    const Args a = {xq, xd, xs, xi, xdi, xsi, qs, sc, y, N, Kp, G, y_bf};
    /* Few rows: x is quantized here, so that the threads meet once, not twice (on a busy machine
     * each meeting can wait for a time slice). Small products run on this thread alone. A tile's
     * rows are quantized and interleaved by one thread. */
    const int serial = M * Kp <= (1 << 16);
    if (serial)
        for (int64_t rt = 0; rt < row_tiles; ++rt)
            prepare_tile(x, x_bf, xb, xq, xd, xs, xi, xdi, xsi, rt * mr_max, M, mr_max, K, Kp,
                         isa);
    if (num_threads > blocks) num_threads = (int)blocks;
    if (M * N * Kp < (1 << 20)) num_threads = 1;
    #pragma omp parallel num_threads(num_threads)
    {
        if (!serial) {
            #pragma omp for schedule(static)
            for (int64_t rt = 0; rt < row_tiles; ++rt)
                prepare_tile(x, x_bf, xb, xq, xd, xs, xi, xdi, xsi, rt * mr_max, M, mr_max, K,
                             Kp, isa);
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t p = b * np_max;
            const int np = P - p < np_max ? (int)(P - p) : np_max;
            for (int64_t i = 0; i < M; i += mr_max) {
                const int mr = M - i < mr_max ? (int)(M - i) : mr_max;
                tile(&a, i, p, mr, np, isa);
            }
        }
    }
    free(xi); free(xdi); free(xsi);
    free(xq); free(xd); free(xs);
    return 0;
}

/* x [M, K] fp32 (K a multiple of 32), qs and sc as above, y [M, N] fp32. */
int int8_gemm(const float *x, const int8_t *qs, const uint16_t *sc, float *y, int64_t M,
              int64_t N, int64_t K, int isa, int num_threads)
{
    return gemm(x, 0, qs, sc, y, 0, M, N, K, K, isa, num_threads);
}

/* The same product for bf16 x [M, K] (K not padded: the groups past K are zeros) into bf16 y
 * [M, N], the fp32 sums rounded to nearest even: what int8_gemm and two dtype conversions
 * give, for the CPU backend's decode loop. Kp: K padded to a multiple of 32. */
int int8_gemm_bf16(const uint16_t *x, const int8_t *qs, const uint16_t *sc, uint16_t *y,
                   int64_t M, int64_t N, int64_t K, int64_t Kp, int isa, int num_threads)
{
    return gemm(x, 1, qs, sc, y, 1, M, N, K, Kp, isa, num_threads);
}
