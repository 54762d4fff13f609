/* y = x W^T with half-precision (bf16 or fp16) weights, fp32 activations and fp32 sums, for
 * CPUs without half-precision matrix instructions (AVX2 + FMA + F16C).
 *
 * x: [M, K] fp32 row-major; y: [M, N] fp32 row-major; W [N, K] row-major, as the model holds it
 * (no second copy). half_gemm: each thread takes a range of panels of 16 output columns. Per
 * panel and block of KC inputs the weights are widened to fp32 and transposed once
 * (widen_rows), into a thread-local buffer buf[k][c] that stays in L1, and every tile of up to 6
 * rows of x runs over it with a 6 x 16 register tile (12 ymm accumulators, one broadcast of x per
 * row and k). Blocks of MC rows keep the part of x that is re-read for every panel within about
 * 1 MiB. half_gemv (up to 8 rows): each weight element read and widened once.
 */
#include <stdint.h>

#include "bf16.h"

#define NR 16
#define MR 6
#define KC 256

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int half_gemm_simd(void) { return 1; }

static inline __m256 widen8(const uint16_t *src, int is_fp16)
{
    const __m128i h = _mm_loadu_si128((const __m128i *)src);
    return is_fp16 ? _mm256_cvtph_ps(h)
                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Prefetch (into L2) the next panel's block of KC inputs at k0, while this panel's tiles run:
 * widen_rows / pair_rows read 16 rows 2 KiB or more apart, streams the hardware prefetcher
 * follows badly once the weights come from memory; a panel ahead leaves the loads time to land
 * (prefetching only the next block did not help; docs/performance.md). */
static inline void prefetch_next_panel(const uint16_t *w, int64_t N, int64_t K, int64_t n0,
                                       int64_t k0, int64_t kc)
{
    for (int64_t c = n0 + NR; c < n0 + 2 * NR && c < N; ++c)
        for (int64_t k = 0; k < kc; k += 32)
            _mm_prefetch((const char *)(w + c * K + k0 + k), _MM_HINT_T1);
}

static inline float half_to_float(uint16_t h, int is_fp16)
{
    return is_fp16 ? _cvtsh_ss(h) : bf16_to_f32(h);
}

/* y[0:mr, 0:ncols] (+)= x[0:mr, 0:kc] b[0:kc, 0:16]; mr is a literal at every call, so the
 * unrolled loops keep acc in registers. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *b, int64_t kc, float *y, int64_t ldy, int mr,
    int first, int ncols)
{
    __m256 acc[MR][2];
    #pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) { acc[r][0] = _mm256_setzero_ps(); acc[r][1] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 b0 = _mm256_load_ps(b + k * NR), b1 = _mm256_load_ps(b + k * NR + 8);
        #pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
            if (r < mr) {
                const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
                acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
            }
        }
    }
    if (ncols == NR) {
        #pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
            if (r < mr) {
                float *yr = y + r * ldy;
                if (!first) {
                    acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_loadu_ps(yr));
                    acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_loadu_ps(yr + 8));
                }
                _mm256_storeu_ps(yr, acc[r][0]);
                _mm256_storeu_ps(yr + 8, acc[r][1]);
            }
        }
        return;
    }
    float t[MR * NR] __attribute__((aligned(32)));  /* last panel: fewer than 16 columns */
    #pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
        if (r < mr) {
            _mm256_store_ps(t + r * NR, acc[r][0]);
            _mm256_store_ps(t + r * NR + 8, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; ++r) {
        float *yr = y + r * ldy;
        const float *tr = t + r * NR;
        for (int c = 0; c < ncols; ++c) yr[c] = first ? tr[c] : yr[c] + tr[c];
    }
}

/* rows of the next tile: the rows left split evenly over the fewest tiles of at most 6 (32 rows:
 * 6 6 5 5 5 5, not 6 6 6 6 6 2: a small tile has too few accumulators to hide the FMA latency;
 * docs/performance.md compares the splits) */
static inline int tile_rows(int64_t rows)
{
    const int64_t tiles = (rows + MR - 1) / MR;
    return (int)((rows + tiles - 1) / tiles);
}

#define TILE(m) tile(x + i * K + k0, K, buf, kc, y + i * N + n0, N, m, k0 == 0, ncols)

/* 8 rows of 8 floats -> 8 columns: r[j][c] = in[c][j] */
static inline void transpose8(__m256 r[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* buf[k][c] = W[c][k] widened to fp32 for k < kc, c < ncols (0 for c >= ncols): the 16-column
 * panel block the tile reads, taken from W [N, K] row-major (w at the block's first element).
 * Blocks of 8 x 8 are widened and transposed in registers. */
static void widen_rows(const uint16_t *w, int64_t K, int ncols, int64_t kc, float *buf,
                       int is_fp16)
{
    const int64_t k8 = kc & ~(int64_t)7;
    for (int h = 0; h < NR; h += 8) {
        for (int64_t k = 0; k < k8; k += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; ++c)
                r[c] = h + c < ncols ? widen8(w + (h + c) * K + k, is_fp16) : _mm256_setzero_ps();
            transpose8(r);
            for (int j = 0; j < 8; ++j) _mm256_store_ps(buf + (k + j) * NR + h, r[j]);
        }
        for (int64_t k = k8; k < kc; ++k)
            for (int c = 0; c < 8; ++c)
                buf[k * NR + h + c] = h + c < ncols ? half_to_float(w[(h + c) * K + k], is_fp16)
                                                    : 0.0f;
    }
}

void half_gemm(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                    int64_t K, int is_fp16, int num_threads)
{
    const int64_t P = (N + NR - 1) / NR;
    int64_t MC = ((int64_t)1 << 20) / (K * 4);
    MC = MC < MR ? MR : (MC / MR) * MR;
    #pragma omp parallel num_threads(num_threads)
    {
        float buf[KC * NR] __attribute__((aligned(32)));
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t m1 = m0 + MC < M ? m0 + MC : M;
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < P; ++p) {
                const int64_t n0 = p * NR;
                const int ncols = (int)(N - n0 < NR ? N - n0 : NR);
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    widen_rows(w + n0 * K + k0, K, ncols, kc, buf, is_fp16);
                    prefetch_next_panel(w, N, K, n0, k0, kc);
                    for (int64_t i = m0; i < m1;) {
                        const int mr = tile_rows(m1 - i);
                        switch (mr) {
                        case 6: TILE(6); break;
                        case 5: TILE(5); break;
                        case 4: TILE(4); break;
                        case 3: TILE(3); break;
                        case 2: TILE(2); break;
                        default: TILE(1); break;
                        }
                        i += mr;
                    }
                }
            }
        }
    }
}

/* Few rows (decode at small batch, draft verification): y[M, N] = x[M, K] W^T straight from the
 * weight in its own layout, W [N, K] row-major, each weight element read and widened once. One
 * weight row at a time, so that each thread reads its share of W as a single sequential stream
 * (4 rows read side by side ran at about half the bandwidth: short interleaved streams defeat
 * the hardware prefetcher); 32 inputs a step into 4 accumulators per row of x (4 rows: 16 ymm),
 * summed across lanes at the end; rows 5-8 run a second pass over the weight row, from L1. Each
 * row of x goes through the same operations whatever M is, so a row's result does not depend on
 * the rows beside it: a draft verification of up to 7 drafts computes its rows exactly as
 * decoding computes them one by one. Up to 8 rows this ran faster than half_gemm
 * (docs/performance.md). */
static inline __attribute__((always_inline)) void gemv_row(
    const float *x, const uint16_t *w, void *y, int64_t N, int64_t K, int mr, int is_fp16,
    int out_bf16)
{
    __m256 acc[4][4];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
        #pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
    }
    const int64_t K32 = K & ~(int64_t)31, K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K32; k += 32) {
        const __m256 w0 = widen8(w + k, is_fp16), w1 = widen8(w + k + 8, is_fp16);
        const __m256 w2 = widen8(w + k + 16, is_fp16), w3 = widen8(w + k + 24, is_fp16);
        #pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
            if (r < mr) {
                const float *xr = x + r * K + k;
                acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, acc[r][1]);
                acc[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, acc[r][2]);
                acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, acc[r][3]);
            }
        }
    }
    for (int64_t k = K32; k < K8; k += 8) {
        const __m256 wv = widen8(w + k, is_fp16);
        #pragma GCC unroll 4
        for (int r = 0; r < 4; ++r)
            if (r < mr) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r][0]);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
        if (r < mr) {
            float t = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                         _mm256_add_ps(acc[r][2], acc[r][3])));
            for (int64_t k = K8; k < K; ++k) t += x[r * K + k] * half_to_float(w[k], is_fp16);
            act_st(y, r * N, t, out_bf16);
        }
    }
}

void half_gemv(const float *x, const uint16_t *w, void *y, int64_t M, int64_t N, int64_t K,
               int is_fp16, int out_bf16, int num_threads)
{
    if (M < 1 || M > 8) return;
    char *yb = y;
    const int64_t ys = out_bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t r0 = 0; r0 < M; r0 += 4) {  /* rows 4-7 re-read the weight row from L1 */
            const float *xr = x + r0 * K;
            char *yr = yb + (r0 * N + n) * ys;
            switch (M - r0) {
            case 1: gemv_row(xr, w + n * K, yr, N, K, 1, is_fp16, out_bf16); break;
            case 2: gemv_row(xr, w + n * K, yr, N, K, 2, is_fp16, out_bf16); break;
            case 3: gemv_row(xr, w + n * K, yr, N, K, 3, is_fp16, out_bf16); break;
            default: gemv_row(xr, w + n * K, yr, N, K, 4, is_fp16, out_bf16); break;
            }
        }
    }
}


#else  /* no AVX2 + FMA + F16C: half_gemm_simd() says so and callers keep their own path */

int half_gemm_simd(void) { return 0; }


void half_gemv(const float *x, const uint16_t *w, void *y, int64_t M, int64_t N, int64_t K,
               int is_fp16, int out_bf16, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)is_fp16; (void)out_bf16;
    (void)num_threads;
}

void half_gemm(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N,
               int64_t K, int is_fp16, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)is_fp16; (void)num_threads;
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) \
    && defined(__AVX512BF16__)
/* bf16 activations times bf16 weights with the CPU's bf16 dot-product instruction (vdpbf16ps:
 * for each of 16 fp32 lanes, acc += a0 b0 + a1 b1 over a pair of bf16 inputs), the products of
 * a bf16 GEMM with fp32 sums, as torch computes it. Only where x is bf16 already (a bf16 model);
 * K must be even. Uses transpose8 above. */
#include <immintrin.h>
#include <string.h>

int half_gemm_bf16dot(void) { return 1; }

#define MR16 12  /* rows per tile: 12 zmm accumulators, one weight load per 12 dot products */

static inline int tile_rows16(int64_t rows)
{
    const int64_t tiles = (rows + MR16 - 1) / MR16;
    return (int)((rows + tiles - 1) / tiles);
}

/* buf[p][c] = the pair (W[c][2p], W[c][2p + 1]) as 32 bits, p < kc / 2, c < 16 (0 past ncols):
 * blocks of 8 rows x 8 pairs transposed in registers (pairs move as 32-bit lanes). */
static void pair_rows(const uint16_t *w, int64_t K, int ncols, int64_t kc, uint32_t *buf)
{
    const int64_t pc = kc / 2, p8 = pc & ~(int64_t)7;
    for (int h = 0; h < NR; h += 8) {
        for (int64_t p = 0; p < p8; p += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; ++c)
                r[c] = h + c < ncols ? _mm256_loadu_ps((const float *)(w + (h + c) * K + 2 * p))
                                     : _mm256_setzero_ps();
            transpose8(r);
            for (int j = 0; j < 8; ++j) _mm256_store_ps((float *)(buf + (p + j) * NR + h), r[j]);
        }
        for (int64_t p = p8; p < pc; ++p)
            for (int c = 0; c < 8; ++c) {
                uint32_t v = 0;
                if (h + c < ncols) memcpy(&v, w + (h + c) * K + 2 * p, 4);
                buf[p * NR + h + c] = v;
            }
    }
}

static inline __attribute__((always_inline)) void tile16(
    const uint16_t *x, int64_t ldx, const uint32_t *b, int64_t pc, float *y, int64_t ldy,
    int mr, int first, int ncols)
{
    __m512 acc[MR16];
    #pragma GCC unroll 12
    for (int r = 0; r < MR16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pc; ++p) {
        const __m512i bv = _mm512_load_si512((const void *)(b + p * NR));
        #pragma GCC unroll 12
        for (int r = 0; r < MR16; ++r) {
            if (r < mr) {
                int32_t a;
                memcpy(&a, x + r * ldx + 2 * p, 4);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(a), (__m512bh)bv);
            }
        }
    }
    const __mmask16 m = (__mmask16)((1u << ncols) - 1);
    #pragma GCC unroll 12
    for (int r = 0; r < MR16; ++r) {
        if (r < mr) {
            float *yr = y + r * ldy;
            if (!first) acc[r] = _mm512_add_ps(acc[r], _mm512_maskz_loadu_ps(m, yr));
            _mm512_mask_storeu_ps(yr, m, acc[r]);
        }
    }
}

#define TILE16(m) tile16(x + i * K + k0, K, buf, kc / 2, y + i * N + n0, N, m, k0 == 0, ncols)

void half_gemm_bf16(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                    int64_t K, int num_threads)
{
    const int64_t P = (N + NR - 1) / NR;
    int64_t MC = ((int64_t)1 << 20) / (K * 2);
    MC = MC < MR16 ? MR16 : (MC / MR16) * MR16;
    #pragma omp parallel num_threads(num_threads)
    {
        uint32_t buf[KC / 2 * NR] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t m1 = m0 + MC < M ? m0 + MC : M;
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < P; ++p) {
                const int64_t n0 = p * NR;
                const int ncols = (int)(N - n0 < NR ? N - n0 : NR);
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t kc = K - k0 < KC ? K - k0 : KC;
                    pair_rows(w + n0 * K + k0, K, ncols, kc, buf);
                    prefetch_next_panel(w, N, K, n0, k0, kc);
                    for (int64_t i = m0; i < m1;) {
                        const int mr = tile_rows16(m1 - i);
                        switch (mr) {
                        case 12: TILE16(12); break;
                        case 11: TILE16(11); break;
                        case 10: TILE16(10); break;
                        case 9: TILE16(9); break;
                        case 8: TILE16(8); break;
                        case 7: TILE16(7); break;
                        case 6: TILE16(6); break;
                        case 5: TILE16(5); break;
                        case 4: TILE16(4); break;
                        case 3: TILE16(3); break;
                        case 2: TILE16(2); break;
                        default: TILE16(1); break;
                        }
                        i += mr;
                    }
                }
            }
        }
    }
}

/* Up to 4 rows of bf16 x (half_gemv_bf16 runs 8 in two passes): one weight row at a time as in
 * half_gemv, 64 inputs a step into 2 accumulators per row of x (masked loads for the tail), no
 * widening. */
static inline __attribute__((always_inline)) void gemv_row16(
    const uint16_t *x, const uint16_t *w, void *y, int64_t N, int64_t K, int mr, int out_bf16)
{
    __m512 acc[4][2];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t K64 = K & ~(int64_t)63;
    for (int64_t k = 0; k < K64; k += 64) {
        const __m512i w0 = _mm512_loadu_si512((const void *)(w + k));
        const __m512i w1 = _mm512_loadu_si512((const void *)(w + k + 32));
        #pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
            if (r < mr) {
                const uint16_t *xr = x + r * K + k;
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_loadu_si512(
                    (const void *)xr), (__m512bh)w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_loadu_si512(
                    (const void *)(xr + 32)), (__m512bh)w1);
            }
        }
    }
    for (int64_t k = K64; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)0xFFFFFFFFu
                                        : (__mmask32)((1u << (K - k)) - 1);
        const __m512i wv = _mm512_maskz_loadu_epi16(m, w + k);
        #pragma GCC unroll 4
        for (int r = 0; r < 4; ++r)
            if (r < mr)
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_maskz_loadu_epi16(
                    m, x + r * K + k), (__m512bh)wv);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
        if (r < mr)
            act_st(y, r * N, _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])),
                      out_bf16);
}

void half_gemv_bf16(const uint16_t *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                    int64_t K, int out_bf16, int num_threads)
{
    if (M < 1 || M > 8) return;
    char *yb = y;
    const int64_t ys = out_bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t r0 = 0; r0 < M; r0 += 4) {  /* rows 4-7 re-read the weight row from L1 */
            const uint16_t *xr = x + r0 * K;
            char *yr = yb + (r0 * N + n) * ys;
            switch (M - r0) {
            case 1: gemv_row16(xr, w + n * K, yr, N, K, 1, out_bf16); break;
            case 2: gemv_row16(xr, w + n * K, yr, N, K, 2, out_bf16); break;
            case 3: gemv_row16(xr, w + n * K, yr, N, K, 3, out_bf16); break;
            default: gemv_row16(xr, w + n * K, yr, N, K, 4, out_bf16); break;
            }
        }
    }
}
#else  /* no AVX512-BF16: half_gemm_bf16dot() says so */
int half_gemm_bf16dot(void) { return 0; }
void half_gemm_bf16(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                    int64_t K, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
}
void half_gemv_bf16(const uint16_t *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                    int64_t K, int out_bf16, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)out_bf16; (void)num_threads;
}
#endif
