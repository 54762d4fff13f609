/* y = x W^T with 4-bit or 6-bit weights (kernels/int4.py's formats) and fp32 or bf16 activations,
 * for every number of rows: a GEMV for up to 8 rows (decode, draft verification), a tiled GEMM
 * beyond.
 *
 * The format. W [N, K] is cut into groups of 32 inputs (G = ceil(K / 32) per row, zeros past K)
 * and superblocks of 8 groups (SB = ceil(G / 8)). A weight is W ~= dw * q - mw with q in
 * [0, 15], dw = D * sc and mw = M * mc: sc, mc 8-bit codes per column and group, D, M bf16 per
 * column and superblock (4.625 bits a weight). Packed in panels of 16 output columns:
 *   qs[p][g][r][4 c + j] (uint8, r < 4, c < 16, j < 4): the low nibble is q(W[16 p + c][32 g +
 *       4 r + j]), the high nibble q(W[16 p + c][32 g + 16 + 4 r + j]); 256 bytes per panel and
 *       group, whose 64-byte rows are what one AVX-512 VNNI vpdpbusd multiplies (after masking
 *       or shifting out a nibble) by 4 bytes of x broadcast to every lane;
 *   codes[p][g][0][c] = sc, codes[p][g][1][c] = mc;
 *   scales[p][s][0][c] = D, scales[p][s][1][c] = M (bf16 bits).
 * The 6-bit format (int6_gemm; the LM head) has q in [0, 63]: its low 4 bits in qs as above,
 * the high 2 in
 *   hs[p][g][h][4 c + j] (uint8, h < 2): bits 2 r, 2 r + 1 are q(W[16 p + c][32 g + 16 h + 4 r +
 *       j]) >> 4; 128 bytes per panel and group (6.625 bits a weight), OR-ed at bits 4-5 into
 *       the nibbles qs[p][g][r] unpacks to (h = 0 its low, 1 its high): still unsigned bytes.
 *
 * Each row of x is quantized per group of 32 as for int8 (csrc/int8_gemm.c's
 * int8_quantize_rows: d = amax / 127, q = round(x * 127 / amax), s = sum of q), every group's
 * dot product with the unsigned nibbles is exact in int32, and for each group g in order
 *   acc = fma((float)dot, dw * d,     acc)
 *   acc = fma(mw,         -(d * s),   acc)
 * in fp32, dw and mw exact (bf16 times 8 bits). Every path (plain C included, with fmaf) does
 * these same operations for every row whatever the number of rows and the tile it lies in, so
 * the paths agree bit for bit and a row's result never depends on the rows beside it.
 *
 * Paths (``int4_isas`` says which this build has; the caller picks one per call):
 *   ISA_REF     plain C;
 *   ISA_AVX2    AVX2: vpmaddubsw (nibbles unsigned, x signed; a group's 8 products stay within
 *               int16: 8 * 2 * 15 * 127 = 30480), widened once a group by vpmaddwd; 6 bits:
 *               widened every 4 products (4 * 63 * 127 = 32004);
 *   ISA_AVXVNNI 256-bit vpdpbusd (AVX-VNNI, or AVX512-VNNI + VL), otherwise as AVX2;
 *   ISA_VNNI    AVX-512 VNNI: 512-bit vpdpbusd, 16 columns a vector.
 * Threads (OpenMP) take blocks of panels: one panel a block up to 8 rows (each weight read from
 * memory once for all rows, each thread streaming its share of W; AVX-512: unpacked once for all
 * rows, the 256-bit paths: again from L1 for rows 5-8), two panels (AVX2: one) and tiles of 4 rows
 * beyond (the 256-bit paths at one row: both halves of a panel in one pass). The GEMV prefetches
 * the weight stream ahead: into L2 (PF_AHEAD), or at one row into L1 only (PF_NTA).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NR 16      /* output columns per panel */
#define QK 32      /* inputs per group */
#define SBG 8      /* groups per superblock */
#define QB 256     /* bytes of qs per panel and group */
#define GEMV_MAX 8 /* rows up to which every row of x is one tile */
#define MR 4       /* rows per tile beyond that */
#define NP 2       /* panels per tile beyond that (AVX-512) */
#define AVX2_ROWS 4   /* rows per tile on the 256-bit paths (16 ymm registers on AVX2) */
#define PF_AHEAD 8192 /* bytes of the weight stream prefetched ahead of a few-row tile's loads */
#define PF_START 16384 /* bytes of it a thread prefetches before its first panel of a GEMV */
#define PF_NTA 2048   /* bytes prefetched ahead, non-temporal, by the one-row tiles */

/* Whether the one-row tiles prefetch their weight stream PF_NTA ahead with the non-temporal
 * hint (1) or PF_AHEAD ahead into L2 as the few-row tiles do (0): which is faster depends on the
 * CPU's caches (one measured 0.88x the step's time with the hint, another 2x the LM head's),
 * so kernels/int4.py chooses it at run time (``int4_set_one_row_nta``). The results are the
 * same bits either way. */
static int one_row_nta = 1;

void int4_set_one_row_nta(int on) { one_row_nta = on != 0; }

enum { ISA_REF = 1, ISA_AVX2 = 2, ISA_VNNI = 4, ISA_AVXVNNI = 8 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#if defined(__AVXVNNI__)
#define HAVE_AVXVNNI 1
#define DPBUSD256(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_AVXVNNI 1
#define DPBUSD256(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#endif
#endif

/* csrc/int8_gemm.c: the activations' quantization, shared with the int8 kernels (flag 1: plain
 * C, 2: its vector path, the same values bit for bit) */
int int8_quantize_rows(const void *x, int x_bf, int8_t *q, float *d, int32_t *s, int64_t M,
                       int64_t K, int64_t Kp, int isa);

int int4_isas(void)
{
    int isas = ISA_REF;
#ifdef HAVE_AVX2
    isas |= ISA_AVX2;
#endif
#ifdef HAVE_AVXVNNI
    isas |= ISA_AVXVNNI;
#endif
#ifdef HAVE_VNNI
    isas |= ISA_VNNI;
#endif
    return isas;
}

/* Arguments of every tile: quantized x (xq [M, Kp], xd = d and xds = d * s [M, G]) and W. */
typedef struct {
    const int8_t *xq;
    const float *xd, *xds;
    const uint8_t *qs, *hs, *codes; /* hs: NULL for 4 bits */
    const uint16_t *scales;
    void *y; /* [M, N], fp32 or bf16 (y_bf) */
    int64_t N, Kp, G, SB;
    int y_bf;
} Args;

static inline const uint8_t *qs_at(const Args *a, int64_t p, int64_t g)
{
    return a->qs + (p * a->G + g) * QB;
}

static inline const uint8_t *hs_at(const Args *a, int64_t p, int64_t g)
{
    return a->hs + (p * a->G + g) * (QB / 2);
}

static inline const uint8_t *codes_at(const Args *a, int64_t p, int64_t g)
{
    return a->codes + (p * a->G + g) * 2 * NR;
}

static inline const uint16_t *scales_at(const Args *a, int64_t p, int64_t g)
{
    return a->scales + (p * a->SB + g / SBG) * 2 * NR;
}

static void tile_ref(const Args *a, int64_t i, int64_t p, int mr, int np)
{
    for (int r = 0; r < mr; ++r) {
        const int8_t *xr = a->xq + (i + r) * a->Kp;
        for (int t = 0; t < np; ++t) {
            float acc[NR];
            for (int c = 0; c < NR; ++c) acc[c] = 0.0f;
            for (int64_t g = 0; g < a->G; ++g) {
                const uint8_t *qg = qs_at(a, p + t, g), *cg = codes_at(a, p + t, g);
                const uint16_t *sg = scales_at(a, p + t, g);
                const float dx = a->xd[(i + r) * a->G + g], dxs = a->xds[(i + r) * a->G + g];
                for (int c = 0; c < NR; ++c) {
                    int32_t dot = 0;
                    for (int k = 0; k < QK; ++k) {
                        const int at = (k % 16 / 4) * 64 + 4 * c + k % 4;
                        int q = k < 16 ? qg[at] & 15 : qg[at] >> 4;
                        if (a->hs)
                            q |= (hs_at(a, p + t, g)[(k / 16) * 64 + 4 * c + k % 4]
                                  >> (2 * (k % 16 / 4)) & 3) << 4;
                        dot += xr[g * QK + k] * q;
                    }
                    const float dw = bf16_to_f32(sg[c]) * (float)cg[c];
                    const float mw = bf16_to_f32(sg[NR + c]) * (float)cg[NR + c];
                    acc[c] = fmaf((float)dot, dw * dx, acc[c]);
                    acc[c] = fmaf(mw, -dxs, acc[c]);
                }
            }
            const int64_t n0 = (p + t) * NR;
            for (int c = 0; c < NR && n0 + c < a->N; ++c)
                act_st(a->y, (i + r) * a->N + n0 + c, acc[c], a->y_bf);
        }
    }
}

#ifdef HAVE_VNNI
static inline __m512 bf16x16(const uint16_t *s)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s)), 16));
}

static inline __m512 codes16(const uint8_t *c)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)));
}

/* bits 2 r, 2 r + 1 of each byte of h (a row of hs) at bits 4-5, the rest 0 (r a literal) */
static inline __m512i high16(__m512i h, int r)
{
    const __m512i v = r == 0 ? _mm512_slli_epi16(h, 4) : r == 1 ? _mm512_slli_epi16(h, 2)
                    : r == 2 ? h : _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(v, _mm512_set1_epi8(0x30));
}

/* the GEMM's tile: rows [i, i + mr) (mr <= 4) by panels [p, p + np) (np <= 2; the GEMV's tile,
 * of one panel, is gemv_vnni); ``six``: the 6-bit format (a literal at every call) */
static inline __attribute__((always_inline)) void tile_vnni(const Args *a, int64_t i, int64_t p,
                                                            int mr, int np, int six)
{
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int8_t *xq = a->xq + i * a->Kp;
    const float *xd = a->xd + i * a->G, *xds = a->xds + i * a->G;
    __m512 accf[GEMV_MAX][NP];
    #pragma GCC unroll 8
    for (int r = 0; r < GEMV_MAX; ++r)
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) accf[r][t] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < a->SB; ++sb) {
        __m512 D[NP], M[NP];
        #pragma GCC unroll 2
        for (int t = 0; t < NP; ++t) {
            if (t < np) {
                const uint16_t *s = scales_at(a, p + t, sb * SBG);
                D[t] = bf16x16(s);
                M[t] = bf16x16(s + NR);
            }
        }
        const int64_t g1 = (sb + 1) * SBG < a->G ? (sb + 1) * SBG : a->G;
        for (int64_t g = sb * SBG; g < g1; ++g) {
            __m512i acc[GEMV_MAX][NP];
            #pragma GCC unroll 8
            for (int r = 0; r < GEMV_MAX; ++r)
                #pragma GCC unroll 2
                for (int t = 0; t < NP; ++t) acc[r][t] = _mm512_setzero_si512();
            #pragma GCC unroll 4
            for (int k4 = 0; k4 < 4; ++k4) {
                __m512i wl[NP], wh[NP];
                #pragma GCC unroll 2
                for (int t = 0; t < NP; ++t) {
                    if (t < np) {
                        const __m512i v = _mm512_loadu_si512(qs_at(a, p + t, g) + 64 * k4);
                        wl[t] = _mm512_and_si512(v, low);
                        wh[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                        if (six) {
                            const uint8_t *h = hs_at(a, p + t, g);
                            wl[t] = _mm512_or_si512(wl[t], high16(_mm512_loadu_si512(h), k4));
                            wh[t] = _mm512_or_si512(wh[t],
                                                    high16(_mm512_loadu_si512(h + 64), k4));
                        }
                    }
                }
                #pragma GCC unroll 8
                for (int r = 0; r < GEMV_MAX; ++r) {
                    if (r < mr) {
                        const int8_t *xg = xq + r * a->Kp + g * QK + 4 * k4;
                        const __m512i xl = _mm512_set1_epi32(*(const int32_t *)xg);
                        const __m512i xh = _mm512_set1_epi32(*(const int32_t *)(xg + 16));
                        #pragma GCC unroll 2
                        for (int t = 0; t < NP; ++t) {
                            if (t < np) {
                                acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wl[t], xl);
                                acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wh[t], xh);
                            }
                        }
                    }
                }
            }
            #pragma GCC unroll 2
            for (int t = 0; t < NP; ++t) {
                if (t < np) {
                    const uint8_t *cg = codes_at(a, p + t, g);
                    const __m512 dw = _mm512_mul_ps(D[t], codes16(cg));
                    const __m512 mw = _mm512_mul_ps(M[t], codes16(cg + NR));
                    #pragma GCC unroll 8
                    for (int r = 0; r < GEMV_MAX; ++r) {
                        if (r < mr) {
                            const __m512 dx = _mm512_set1_ps(xd[r * a->G + g]);
                            const __m512 ndxs = _mm512_set1_ps(-xds[r * a->G + g]);
                            accf[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]),
                                                         _mm512_mul_ps(dw, dx), accf[r][t]);
                            accf[r][t] = _mm512_fmadd_ps(mw, ndxs, accf[r][t]);
                        }
                    }
                }
            }
        }
    }
    #pragma GCC unroll 2
    for (int t = 0; t < NP; ++t) {
        if (t < np) {
            const int64_t n0 = (p + t) * NR;
            const __mmask16 m = n0 + NR <= a->N ? (__mmask16)0xffff
                                                : (__mmask16)((1u << (a->N - n0)) - 1);
            #pragma GCC unroll 8
            for (int r = 0; r < GEMV_MAX; ++r)
                if (r < mr) act_st16(a->y, (i + r) * a->N + n0, accf[r][t], a->y_bf, m);
        }
    }
}
#endif

#ifdef HAVE_AVX2
static inline __m256 bf16x8(const uint16_t *s)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s)), 16));
}

static inline __m256 codes8(const uint8_t *c)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

/* high16 on 256 bits */
static inline __m256i high8(__m256i h, int r)
{
    const __m256i v = r == 0 ? _mm256_slli_epi16(h, 4) : r == 1 ? _mm256_slli_epi16(h, 2)
                    : r == 2 ? h : _mm256_srli_epi16(h, 2);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}

/* rows [i, i + mr) (mr <= 8) by columns 8 h .. 8 h + 7 of panel p. ``vnni``: vpdpbusd; ``six``:
 * the 6-bit format, its int32 sums widened every k4 without vnni (literals at every call) */
static inline __attribute__((always_inline)) void tile_avx2(const Args *a, int64_t i, int64_t p,
                                                            int h, int mr, int vnni, int six,
                                                            int pf)
{
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t *xq = a->xq + i * a->Kp;
    const float *xd = a->xd + i * a->G, *xds = a->xds + i * a->G;
    __m256 accf[GEMV_MAX];
    #pragma GCC unroll 8
    for (int r = 0; r < GEMV_MAX; ++r) accf[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < a->SB; ++sb) {
        const uint16_t *s = scales_at(a, p, sb * SBG) + 8 * h;
        const __m256 D = bf16x8(s), M = bf16x8(s + NR);
        const int64_t g1 = (sb + 1) * SBG < a->G ? (sb + 1) * SBG : a->G;
        for (int64_t g = sb * SBG; g < g1; ++g) {
            __m256i acc[GEMV_MAX], h0 = _mm256_setzero_si256(), h1 = h0;
            #pragma GCC unroll 8
            for (int r = 0; r < GEMV_MAX; ++r) acc[r] = _mm256_setzero_si256();
            if (six) {
                const uint8_t *hq = hs_at(a, p, g);
                if (pf) {
                    _mm_prefetch((const char *)hq + PF_AHEAD / 2, _MM_HINT_T1);
                    _mm_prefetch((const char *)hq + 64 + PF_AHEAD / 2, _MM_HINT_T1);
                }
                h0 = _mm256_loadu_si256((const __m256i *)(hq + 32 * h));
                h1 = _mm256_loadu_si256((const __m256i *)(hq + 64 + 32 * h));
            }
            #pragma GCC unroll 4
            for (int k4 = 0; k4 < 4; ++k4) {
                if (pf)
                    _mm_prefetch((const char *)qs_at(a, p, g) + 64 * k4 + PF_AHEAD, _MM_HINT_T1);
                const __m256i v = _mm256_loadu_si256(
                    (const __m256i *)(qs_at(a, p, g) + 64 * k4 + 32 * h));
                __m256i wl = _mm256_and_si256(v, low);
                __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (six) {
                    wl = _mm256_or_si256(wl, high8(h0, k4));
                    wh = _mm256_or_si256(wh, high8(h1, k4));
                }
                #pragma GCC unroll 8
                for (int r = 0; r < GEMV_MAX; ++r) {
                    if (r < mr) {
                        const int8_t *xg = xq + r * a->Kp + g * QK + 4 * k4;
                        const __m256i xl = _mm256_set1_epi32(*(const int32_t *)xg);
                        const __m256i xh = _mm256_set1_epi32(*(const int32_t *)(xg + 16));
#ifdef HAVE_AVXVNNI
                        if (vnni) {
                            acc[r] = DPBUSD256(DPBUSD256(acc[r], wl, xl), wh, xh);
                            continue;
                        }
#endif
                        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(wl, xl),
                                                             _mm256_maddubs_epi16(wh, xh));
                        acc[r] = six ? _mm256_add_epi32(acc[r], _mm256_madd_epi16(s16, ones))
                                     : _mm256_add_epi16(acc[r], s16);
                    }
                }
            }
            const uint8_t *cg = codes_at(a, p, g) + 8 * h;
            const __m256 dw = _mm256_mul_ps(D, codes8(cg)), mw = _mm256_mul_ps(M, codes8(cg + NR));
            #pragma GCC unroll 8
            for (int r = 0; r < GEMV_MAX; ++r) {
                if (r < mr) {
                    const __m256i dot = vnni || six ? acc[r] : _mm256_madd_epi16(acc[r], ones);
                    const __m256 dx = _mm256_set1_ps(xd[r * a->G + g]);
                    const __m256 ndxs = _mm256_set1_ps(-xds[r * a->G + g]);
                    accf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dx),
                                              accf[r]);
                    accf[r] = _mm256_fmadd_ps(mw, ndxs, accf[r]);
                }
            }
        }
    }
    const int64_t n0 = p * NR + 8 * h;
    #pragma GCC unroll 8
    for (int r = 0; r < GEMV_MAX; ++r) {
        if (r < mr) {
            if (n0 + 8 <= a->N) {
                act_st8(a->y, (i + r) * a->N + n0, accf[r], a->y_bf);
            } else {
                float v[8];
                _mm256_storeu_ps(v, accf[r]);
                for (int c = 0; c < 8 && n0 + c < a->N; ++c)
                    act_st(a->y, (i + r) * a->N + n0 + c, v[c], a->y_bf);
            }
        }
    }
}

/* tile_avx2 for one row, both halves of panel p in one pass: each 64-byte line of the weight
 * stream used whole when it arrives (the two passes of tile_avx2 read it twice), x's 4-byte steps
 * broadcast once for both halves, the stream prefetched PF_NTA ahead non-temporally as gemv_vnni
 * does at one row. The same operations per column as tile_avx2, so the same bits; a one-row
 * decode step takes less time than with the two passes (docs/performance.md, "The one-row int4
 * stream, non-temporal"). */
static inline __attribute__((always_inline)) void row_avx2(const Args *a, int64_t i, int64_t p,
                                                           int vnni, int six, int nta)
{
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t *xq = a->xq + i * a->Kp;
    const float *xd = a->xd + i * a->G, *xds = a->xds + i * a->G;
    __m256 accf[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t sb = 0; sb < a->SB; ++sb) {
        const uint16_t *s = scales_at(a, p, sb * SBG);
        const __m256 D[2] = {bf16x8(s), bf16x8(s + 8)};
        const __m256 M[2] = {bf16x8(s + NR), bf16x8(s + NR + 8)};
        const int64_t g1 = (sb + 1) * SBG < a->G ? (sb + 1) * SBG : a->G;
        for (int64_t g = sb * SBG; g < g1; ++g) {
            __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            __m256i h0[2] = {acc[0], acc[0]}, h1[2] = {acc[0], acc[0]};
            const uint8_t *q = qs_at(a, p, g);
            if (six) {
                const uint8_t *hq = hs_at(a, p, g);
                if (nta) {
                    _mm_prefetch((const char *)hq + PF_NTA / 2, _MM_HINT_NTA);
                    _mm_prefetch((const char *)hq + 64 + PF_NTA / 2, _MM_HINT_NTA);
                } else {
                    _mm_prefetch((const char *)hq + PF_AHEAD / 2, _MM_HINT_T1);
                    _mm_prefetch((const char *)hq + 64 + PF_AHEAD / 2, _MM_HINT_T1);
                }
                #pragma GCC unroll 2
                for (int hh = 0; hh < 2; ++hh) {
                    h0[hh] = _mm256_loadu_si256((const __m256i *)(hq + 32 * hh));
                    h1[hh] = _mm256_loadu_si256((const __m256i *)(hq + 64 + 32 * hh));
                }
            }
            #pragma GCC unroll 4
            for (int k4 = 0; k4 < 4; ++k4) {
                if (nta)
                    _mm_prefetch((const char *)q + 64 * k4 + PF_NTA, _MM_HINT_NTA);
                else
                    _mm_prefetch((const char *)q + 64 * k4 + PF_AHEAD, _MM_HINT_T1);
                const int8_t *xg = xq + g * QK + 4 * k4;
                const __m256i xl = _mm256_set1_epi32(*(const int32_t *)xg);
                const __m256i xh = _mm256_set1_epi32(*(const int32_t *)(xg + 16));
                #pragma GCC unroll 2
                for (int hh = 0; hh < 2; ++hh) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * k4 + 32 * hh));
                    __m256i wl = _mm256_and_si256(v, low);
                    __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (six) {
                        wl = _mm256_or_si256(wl, high8(h0[hh], k4));
                        wh = _mm256_or_si256(wh, high8(h1[hh], k4));
                    }
#ifdef HAVE_AVXVNNI
                    if (vnni) {
                        acc[hh] = DPBUSD256(DPBUSD256(acc[hh], wl, xl), wh, xh);
                        continue;
                    }
#endif
                    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(wl, xl),
                                                         _mm256_maddubs_epi16(wh, xh));
                    acc[hh] = six ? _mm256_add_epi32(acc[hh], _mm256_madd_epi16(s16, ones))
                                  : _mm256_add_epi16(acc[hh], s16);
                }
            }
            const uint8_t *cg = codes_at(a, p, g);
            const __m256 dx = _mm256_set1_ps(xd[g]);
            const __m256 ndxs = _mm256_set1_ps(-xds[g]);
            #pragma GCC unroll 2
            for (int hh = 0; hh < 2; ++hh) {
                const __m256 dw = _mm256_mul_ps(D[hh], codes8(cg + 8 * hh));
                const __m256 mw = _mm256_mul_ps(M[hh], codes8(cg + NR + 8 * hh));
                const __m256i dot = vnni || six ? acc[hh] : _mm256_madd_epi16(acc[hh], ones);
                accf[hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dx),
                                           accf[hh]);
                accf[hh] = _mm256_fmadd_ps(mw, ndxs, accf[hh]);
            }
        }
    }
    #pragma GCC unroll 2
    for (int hh = 0; hh < 2; ++hh) {
        const int64_t n0 = p * NR + 8 * hh;
        if (n0 + 8 <= a->N) {
            act_st8(a->y, i * a->N + n0, accf[hh], a->y_bf);
        } else if (n0 < a->N) {
            float v[8];
            _mm256_storeu_ps(v, accf[hh]);
            for (int c = 0; c < 8 && n0 + c < a->N; ++c)
                act_st(a->y, i * a->N + n0 + c, v[c], a->y_bf);
        }
    }
}

static inline __attribute__((always_inline)) void panel_avx2(const Args *a, int64_t i, int64_t p,
                                                             int mr, int vnni, int six)
{
    /* one row: row_avx2. More: rows in tiles of up to AVX2_ROWS (their int16 and fp32 sums in
     * registers; the panel's bytes again from L1 for the next tile), the weight stream
     * prefetched by the first; mr and vnni as literals at every call, so that the unrolled
     * loops keep the tile in registers; the second half of a panel past N is skipped */
    if (mr == 1) {
        if (vnni) {
            if (one_row_nta) row_avx2(a, i, p, 1, six, 1);
            else row_avx2(a, i, p, 1, six, 0);
        } else {
            if (one_row_nta) row_avx2(a, i, p, 0, six, 1);
            else row_avx2(a, i, p, 0, six, 0);
        }
        return;
    }
    for (int h = 0; h < 2 && p * NR + 8 * h < a->N; ++h) {
        for (int r0 = 0; r0 < mr; r0 += AVX2_ROWS) {
            const int n = mr - r0 < AVX2_ROWS ? mr - r0 : AVX2_ROWS, pf = h == 0 && r0 == 0;
#define AVX2_CASE(n)                                                  \
    case n:                                                           \
        if (vnni) tile_avx2(a, i + r0, p, h, n, 1, six, pf);          \
        else tile_avx2(a, i + r0, p, h, n, 0, six, pf);               \
        break;
            switch (n) {
            AVX2_CASE(1) AVX2_CASE(2) AVX2_CASE(3) AVX2_CASE(4)
            AVX2_CASE(5) AVX2_CASE(6) AVX2_CASE(7)
            default: tile_avx2(a, i + r0, p, h, 8, vnni, six, pf); break;
            }
#undef AVX2_CASE
        }
    }
}

static void panel_avx2_4(const Args *a, int64_t i, int64_t p, int mr, int vnni)
{
    panel_avx2(a, i, p, mr, vnni, 0);
}

static void panel_avx2_6(const Args *a, int64_t i, int64_t p, int mr, int vnni)
{
    panel_avx2(a, i, p, mr, vnni, 1);
}
#endif

#ifdef HAVE_VNNI
/* acc + the 4-byte dot products of w's unsigned bytes with x's 4 signed bytes broadcast from
 * memory to every lane: vpdpbusd's embedded broadcast, which the compiler does not fold from
 * _mm512_set1_epi32 (a separate broadcast per row and 4 inputs took issue slots) */
static inline __m512i dpbusd_x4(__m512i acc, __m512i w, const int8_t *x)
{
    __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const int32_t *)x), "v"(w));
    return acc;
}

/* The GEMV's tile: rows [i, i + mr) (mr <= 8) of x by panel p. Each group's 256 bytes are
 * loaded and unpacked once into 8 vectors (4 of low nibbles, 4 of high) and multiplied into
 * every row's int32 sums, a row's 8 products in two chains (low, high) up to 4 rows, one beyond
 * (the sums are exact: the split cannot change them); then the same fp32 steps per row and group
 * as every path. The weight stream ahead is prefetched: a whole decode step's one-row products
 * took 0.83x the time of the hardware prefetcher alone, and with a few rows' work per byte the
 * loads waited without it (docs/performance.md, "int4 few rows"). From 2 rows into L2, PF_AHEAD
 * ahead; at one row PF_NTA ahead with the non-temporal hint (into L1, not kept by the outer
 * caches), which makes a whole one-row decode step faster and a step of 2-8 rows no faster
 * ("The one-row int4 stream, non-temporal"). */
static inline __attribute__((always_inline)) void gemv_vnni(const Args *a, int64_t i, int64_t p,
                                                            int mr, int six, int nta)
{
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int8_t *xq = a->xq + i * a->Kp;
    const float *xd = a->xd + i * a->G, *xds = a->xds + i * a->G;
    __m512 accf[GEMV_MAX];
    #pragma GCC unroll 8
    for (int r = 0; r < GEMV_MAX; ++r) accf[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < a->SB; ++sb) {
        const uint16_t *s = scales_at(a, p, sb * SBG);
        const __m512 D = bf16x16(s), M = bf16x16(s + NR);
        const int64_t g1 = (sb + 1) * SBG < a->G ? (sb + 1) * SBG : a->G;
        for (int64_t g = sb * SBG; g < g1; ++g) {
            const uint8_t *q = qs_at(a, p, g);
            __m512i w[8], h0 = _mm512_setzero_si512(), h1 = h0;
            if (six) { /* the hs stream: half of qs's bytes, prefetched as far ahead */
                const uint8_t *hq = hs_at(a, p, g);
                if (nta) {
                    _mm_prefetch((const char *)hq + PF_NTA / 2, _MM_HINT_NTA);
                    _mm_prefetch((const char *)hq + 64 + PF_NTA / 2, _MM_HINT_NTA);
                } else {
                    _mm_prefetch((const char *)hq + PF_AHEAD / 2, _MM_HINT_T1);
                    _mm_prefetch((const char *)hq + 64 + PF_AHEAD / 2, _MM_HINT_T1);
                }
                h0 = _mm512_loadu_si512(hq);
                h1 = _mm512_loadu_si512(hq + 64);
            }
            #pragma GCC unroll 4
            for (int k4 = 0; k4 < 4; ++k4) {
                if (nta)
                    _mm_prefetch((const char *)q + 64 * k4 + PF_NTA, _MM_HINT_NTA);
                else
                    _mm_prefetch((const char *)q + 64 * k4 + PF_AHEAD, _MM_HINT_T1);
                const __m512i v = _mm512_loadu_si512(q + 64 * k4);
                w[k4] = _mm512_and_si512(v, low);
                w[4 + k4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (six) {
                    w[k4] = _mm512_or_si512(w[k4], high16(h0, k4));
                    w[4 + k4] = _mm512_or_si512(w[4 + k4], high16(h1, k4));
                }
            }
            __m512i acc[GEMV_MAX];
            #pragma GCC unroll 8
            for (int r = 0; r < GEMV_MAX; ++r) {
                if (r < mr) {
                    const int8_t *xg = xq + r * a->Kp + g * QK;
                    /* two chains (low, high nibbles) up to 4 rows, one beyond */
                    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                    #pragma GCC unroll 4
                    for (int k4 = 0; k4 < 4; ++k4) {
                        lo = dpbusd_x4(lo, w[k4], xg + 4 * k4);
                        if (mr <= 4) hi = dpbusd_x4(hi, w[4 + k4], xg + 16 + 4 * k4);
                        else lo = dpbusd_x4(lo, w[4 + k4], xg + 16 + 4 * k4);
                    }
                    acc[r] = mr <= 4 ? _mm512_add_epi32(lo, hi) : lo;
                }
            }
            const uint8_t *cg = codes_at(a, p, g);
            const __m512 dw = _mm512_mul_ps(D, codes16(cg));
            const __m512 mw = _mm512_mul_ps(M, codes16(cg + NR));
            #pragma GCC unroll 8
            for (int r = 0; r < GEMV_MAX; ++r) {
                if (r < mr) {
                    const __m512 dx = _mm512_set1_ps(xd[r * a->G + g]);
                    const __m512 dxs = _mm512_set1_ps(xds[r * a->G + g]);
                    accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(dw, dx),
                                              accf[r]);
                    accf[r] = _mm512_fnmadd_ps(mw, dxs, accf[r]); /* fma(mw, -dxs, acc) */
                }
            }
        }
    }
    const int64_t n0 = p * NR;
    const __mmask16 m = n0 + NR <= a->N ? (__mmask16)0xffff : (__mmask16)((1u << (a->N - n0)) - 1);
    #pragma GCC unroll 8
    for (int r = 0; r < GEMV_MAX; ++r)
        if (r < mr) act_st16(a->y, (i + r) * a->N + n0, accf[r], a->y_bf, m);
}

static inline __attribute__((always_inline)) void tile_vnni_any(const Args *a, int64_t i,
                                                                int64_t p, int mr, int np, int six)
{
    if (np == 1) {
        switch (mr) {
        case 1:
            if (one_row_nta) gemv_vnni(a, i, p, 1, six, 1);
            else gemv_vnni(a, i, p, 1, six, 0);
            break;
        case 2: gemv_vnni(a, i, p, 2, six, 0); break;
        case 3: gemv_vnni(a, i, p, 3, six, 0); break;
        case 4: gemv_vnni(a, i, p, 4, six, 0); break;
        case 5: gemv_vnni(a, i, p, 5, six, 0); break;
        case 6: gemv_vnni(a, i, p, 6, six, 0); break;
        case 7: gemv_vnni(a, i, p, 7, six, 0); break;
        default: gemv_vnni(a, i, p, 8, six, 0); break;
        }
        return;
    }
    switch (mr) {
    case 1: tile_vnni(a, i, p, 1, 2, six); break;
    case 2: tile_vnni(a, i, p, 2, 2, six); break;
    case 3: tile_vnni(a, i, p, 3, 2, six); break;
    default: tile_vnni(a, i, p, 4, 2, six); break;
    }
}

/* the 4-bit and 6-bit tiles apart, so that the 4-bit code is what it was without the format */
static void tile_vnni4(const Args *a, int64_t i, int64_t p, int mr, int np)
{
    tile_vnni_any(a, i, p, mr, np, 0);
}

static void tile_vnni6(const Args *a, int64_t i, int64_t p, int mr, int np)
{
    tile_vnni_any(a, i, p, mr, np, 1);
}
#endif

/* rows [i, i + mr) by panels [p, p + np) on path ``isa`` (AVX2 paths: panel after panel) */
static void tile(const Args *a, int64_t i, int64_t p, int mr, int np, int isa)
{
#ifdef HAVE_VNNI
    if (isa == ISA_VNNI) {
        if (a->hs) tile_vnni6(a, i, p, mr, np);
        else tile_vnni4(a, i, p, mr, np);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2 || isa == ISA_AVXVNNI) {
        for (int t = 0; t < np; ++t) {
            if (a->hs) panel_avx2_6(a, i, p + t, mr, isa == ISA_AVXVNNI);
            else panel_avx2_4(a, i, p + t, mr, isa == ISA_AVXVNNI);
        }
        return;
    }
#endif
    (void)isa;
    tile_ref(a, i, p, mr, np);
}

/* The start of a thread's share of the GEMV's weight stream, from panel p on, prefetched into
 * L2 at once: the tile's prefetches run PF_AHEAD bytes ahead of its loads, so that a thread's
 * first ones would otherwise wait for memory one by one (at one row, a step's products took
 * 0.96-0.975x the time with these). */
static void prefetch_start(const Args *a, int64_t p, int64_t P)
{
    const int64_t left = (P - p) * a->G * QB, n = PF_START < left ? PF_START : left;
    for (int64_t o = 0; o < n; o += 64) {
        __builtin_prefetch(qs_at(a, p, 0) + o, 0, 2); /* 2: into L2, as _MM_HINT_T1 */
        if (o % 128 == 0 && a->hs) __builtin_prefetch(hs_at(a, p, 0) + o / 2, 0, 2);
        if (o % 512 == 0) __builtin_prefetch(codes_at(a, p, 0) + o / 8, 0, 2);
    }
    __builtin_prefetch(scales_at(a, p, 0), 0, 2);
}

static int gemm(const void *x, int x_bf, const uint8_t *qs, const uint8_t *hs,
                const uint8_t *codes, const uint16_t *scales, void *y, int y_bf, int64_t M,
                int64_t N, int64_t K, int64_t Kp, int isa, int num_threads)
{
    if (!(isa & int4_isas()) || (isa & (isa - 1)) || Kp % QK || K > Kp || Kp - K >= QK) return -1;
    const int64_t G = Kp / QK, SB = (G + SBG - 1) / SBG, P = (N + NR - 1) / NR;
    /* up to 8 rows: one panel a block, all rows one tile; beyond: tiles of MR rows by NP
     * panels (VNNI) or one panel (the AVX2 paths and plain C) */
    const int gemv = M <= GEMV_MAX;
    const int np_max = gemv || isa != ISA_VNNI ? 1 : NP;
    const int64_t blocks = (P + np_max - 1) / np_max;
    const int qisa = isa == ISA_REF ? 1 : 2; /* int8_quantize_rows' plain C or vector path */
    int8_t *xq = malloc((size_t)(M * Kp) + 64);
    float *xd = malloc(sizeof(float) * (size_t)(2 * M * G) + 64);
    int32_t *xs = malloc(sizeof(int32_t) * (size_t)(M * G) + 64);
    if (!xq || !xd || !xs) {
        free(xq); free(xd); free(xs);
        return -1;
    }
    float *xds = xd + M * G;
    const Args a = {xq, xd, xds, qs, hs, codes, scales, y, N, Kp, G, SB, y_bf};
    const int64_t xb = x_bf ? 2 : 4;
    /* Few rows: x is quantized here, so that the threads meet once, not twice. Small products
     * run on this thread alone. */
    const int serial = M * Kp <= (1 << 16);
    int failed = 0;
    if (serial) {
        failed = int8_quantize_rows(x, x_bf, xq, xd, xs, M, K, Kp, qisa);
        for (int64_t j = 0; j < M * G; ++j) xds[j] = xd[j] * (float)xs[j];
    }
    if (num_threads > blocks) num_threads = (int)blocks;
    if (M * N * Kp < (1 << 20) || num_threads < 1) num_threads = 1;
    if (!failed) {
        #pragma omp parallel num_threads(num_threads)
        {
            if (!serial) {
                #pragma omp for schedule(static)
                for (int64_t m = 0; m < M; ++m) {
                    int8_quantize_rows((const char *)x + m * K * xb, x_bf, xq + m * Kp,
                                       xd + m * G, xs + m * G, 1, K, Kp, qisa);
                    for (int64_t j = m * G; j < (m + 1) * G; ++j)
                        xds[j] = xd[j] * (float)xs[j];
                }
            }
            int started = 0;
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t p = b * np_max;
                const int np = P - p < np_max ? (int)(P - p) : np_max;
                if (gemv && isa != ISA_REF && !started) {
                    prefetch_start(&a, p, P);
                    started = 1;
                }
                if (gemv) {
                    tile(&a, 0, p, (int)M, np, isa);
                    continue;
                }
                for (int64_t i = 0; i < M; i += MR) {
                    const int mr = M - i < MR ? (int)(M - i) : MR;
                    tile(&a, i, p, mr, np, isa);
                }
            }
        }
    }
    free(xq); free(xd); free(xs);
    return failed ? -1 : 0;
}

/* y [M, N] = x [M, K] W^T: x fp32 or bf16 (x_bf) with K inputs a row (zeros past K up to
 * Kp = 32 G, the packed width), y fp32 or bf16 (y_bf; the fp32 sums rounded to nearest even
 * once). Returns 0, or -1 when the path ``isa`` is not in this build, Kp is not the packed width
 * or memory runs out (y untouched). */
int int4_gemm(const void *x, int x_bf, const uint8_t *qs, const uint8_t *codes,
              const uint16_t *scales, void *y, int y_bf, int64_t M, int64_t N, int64_t K,
              int64_t Kp, int isa, int num_threads)
{
    return gemm(x, x_bf, qs, NULL, codes, scales, y, y_bf, M, N, K, Kp, isa, num_threads);
}

/* int4_gemm for the 6-bit format: W's high bits in hs (not NULL) */
int int6_gemm(const void *x, int x_bf, const uint8_t *qs, const uint8_t *hs,
              const uint8_t *codes, const uint16_t *scales, void *y, int y_bf, int64_t M,
              int64_t N, int64_t K, int64_t Kp, int isa, int num_threads)
{
    if (!hs) return -1;
    return gemm(x, x_bf, qs, hs, codes, scales, y, y_bf, M, N, K, Kp, isa, num_threads);
}
