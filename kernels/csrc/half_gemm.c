/* y = x W^T with half-precision (bf16 or fp16) weights, fp32 activations and fp32 sums, for
 * CPUs without half-precision matrix instructions (AVX2 + FMA + F16C).
 *
 * x: [M, K] fp32 row-major; y: [M, N] fp32 row-major; W [N, K] row-major, as the model holds it
 * (no second copy). half_gemm: each thread takes a range of panels of 16 output columns. Per
 * panel and block of KC inputs the weights are widened to fp32 and transposed once
 * (widen_rows), into a thread-local buffer buf[k][c] that stays in L1, and every tile of up to 6
 * rows of x runs over it with a 6 x 16 register tile (12 ymm accumulators, one broadcast of x per
 * row and k). Blocks of MC rows keep the part of x that is re-read for every panel within about
 * 1 MiB. half_gemv (up to 8 rows): each weight element read and widened once; half_gemv_rows
 * (any number of rows): half_gemv's tiles over L2-sized panels of W, which kernels/linear.py
 * takes over half_gemm where it measured faster (bf16 dot products at any row count, the fma
 * path up to 32 rows).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

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

/* Few rows (decode at small batch, draft verification): y[M, N] = x[M, K] W^T for M <= 8,
 * straight from the weight in its own layout, W [N, K] row-major. A tile is all M rows of x by
 * NB consecutive weight rows: 8 inputs a step, each weight vector loaded and widened once and
 * multiplied into the M rows' accumulators, so that the product's arithmetic per weight byte
 * grows with M while its memory traffic does not; NB (gemv_nb) is chosen per M so that the M x NB
 * accumulators hide the FMA latency and fit the registers. Every (row, weight row) pair has one
 * accumulator that runs over k in order and is summed across lanes by the same tree (reduce8),
 * whatever M and NB are: a row's result does not depend on the rows beside it (a verification
 * of up to 7 drafts computes its rows exactly as decoding does them one by one). Threads take
 * contiguous ranges of tiles, each one stream through its share of W. */
#ifdef __AVX512VL__
#define GEMV_REGS 32 /* ymm registers this build can use */
#else
#define GEMV_REGS 16
#endif

/* weight rows per tile for M rows of x on the fma path: M * NB accumulators and the live
 * vectors within the registers, at least 8 accumulators where that fits */
#if GEMV_REGS == 32
#define FMA_NB(M) ((M) <= 2 ? 8 : (M) == 3 ? 5 : (M) <= 5 ? 4 : 3)
#else
#define FMA_NB(M) ((M) == 1 ? 6 : (M) <= 3 ? 4 : (M) == 4 ? 3 : (M) <= 6 ? 2 : 1)
#endif

/* Where a tile of NB weight rows from w starts prefetching: the tile at least 8 KiB ahead. A
 * tile reads its NB rows side by side, NB short streams that the hardware prefetcher follows
 * badly (without this, 4 rows read side by side ran at about half the read loop's bandwidth);
 * the tiles ahead are one contiguous block, prefetched into L2 line by line as the tile runs. */
static inline const char *prefetch_base(const uint16_t *w, int64_t K, int NB)
{
    const int64_t tile = (int64_t)NB * K * 2;
    return (const char *)w + tile * (1 + (8192 - 1) / tile);
}

/* 8 vectors -> one vector of their 8 lane sums, in order: each sum the tree of hsum8
 * ((v[i] + v[i + 4]), then + the pair 2 over, then the two) */
static inline __m256 reduce8(const __m256 v[8])
{
    __m256 s[4], t[2];
    for (int i = 0; i < 4; ++i)
        s[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i) {
        const __m256d a = _mm256_castps_pd(s[2 * i]), b = _mm256_castps_pd(s[2 * i + 1]);
        t[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88),
                                   _mm256_shuffle_ps(t[0], t[1], 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline __attribute__((always_inline)) void gemv_tile(
    const float *x, const uint16_t *w, void *y, int64_t N, int64_t K, int M, int NB,
    int64_t k0, int64_t k1, float *part, int is_fp16, int out_bf16)
{
    __m256 acc[24];
    #pragma GCC unroll 24
    for (int i = 0; i < M * NB; ++i)
        acc[i] = k0 ? _mm256_load_ps(part + 8 * i) : _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7, kend = k1 < K8 ? k1 : K8;
    const char *ahead = prefetch_base(w, K, NB);
    for (int64_t k = k0; k < kend; k += 8) {
        if ((k & 31) == 0)
            #pragma GCC unroll 8
            for (int j = 0; j < NB; ++j) _mm_prefetch(ahead + (k * NB + 32 * j) * 2, _MM_HINT_T1);
        #pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
            const __m256 wv = widen8(w + j * K + k, is_fp16);
            #pragma GCC unroll 8
            for (int m = 0; m < M; ++m)
                acc[m * NB + j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv,
                                                  acc[m * NB + j]);
        }
    }
    if (k1 < K) {  /* a block of K: the sums so far, lane by lane, for the next block */
        #pragma GCC unroll 24
        for (int i = 0; i < M * NB; ++i) _mm256_store_ps(part + 8 * i, acc[i]);
        return;
    }
    if (K8 < K) {  /* the last K % 8 inputs, zeros past K */
        const int r = (int)(K - K8);
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(r), lanes);
        #pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
            uint16_t t[8] = {0};
            memcpy(t, w + j * K + K8, (size_t)r * 2);
            const __m256 wv = widen8(t, is_fp16);
            #pragma GCC unroll 8
            for (int m = 0; m < M; ++m)
                acc[m * NB + j] = _mm256_fmadd_ps(_mm256_maskload_ps(x + m * K + K8, mask), wv,
                                                  acc[m * NB + j]);
        }
    }
    #pragma GCC unroll 3
    for (int b = 0; b < (M * NB + 7) / 8; ++b) {
        __m256 v[8];
        #pragma GCC unroll 8
        for (int i = 0; i < 8; ++i)
            v[i] = b * 8 + i < M * NB ? acc[b * 8 + i] : _mm256_setzero_ps();
        float s[8];
        _mm256_storeu_ps(s, reduce8(v));
        const int count = M * NB - b * 8 < 8 ? M * NB - b * 8 : 8;
        /* the sums b * 8 .. b * 8 + count: rows and columns from their index */
        for (int i = 0; i < count; ++i) {
            const int a = b * 8 + i;
            act_st(y, (int64_t)(a / NB) * N + a % NB, s[i], out_bf16);
        }
    }
}

/* The tiles of M rows (a literal at each call) over W: N / NB tiles of NB weight rows, then
 * the last N % NB weight rows one at a time (the same sums: a pair's arithmetic does not depend
 * on NB); threads take contiguous ranges. */
#define GEMV_ROWS(MM, TILE, ...)                                                             \
    do {                                                                                     \
        const int NB = NB_OF(MM);                                                            \
        const int64_t full = N / NB, tiles = full + N % NB;                                  \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                \
        for (int64_t t = 0; t < tiles; ++t) {                                                \
            if (t < full)                                                                    \
                TILE(x, w + t * NB * K, yb + t * NB * ys, N, K, MM, NB, 0, K, NULL,          \
                     __VA_ARGS__);                                                           \
            else                                                                             \
                TILE(x, w + (full * NB + t - full) * K, yb + (full * NB + t - full) * ys, N, \
                     K, MM, 1, 0, K, NULL, __VA_ARGS__);                                     \
        }                                                                                    \
    } while (0)

/* ROWS(m, ...) with m the literal 1..8 that n is (8 for more) */
#define SWITCH_ROWS(n, ROWS, ...)                                                            \
    switch (n) {                                                                             \
    case 1: ROWS(1, __VA_ARGS__); break;                                                     \
    case 2: ROWS(2, __VA_ARGS__); break;                                                     \
    case 3: ROWS(3, __VA_ARGS__); break;                                                     \
    case 4: ROWS(4, __VA_ARGS__); break;                                                     \
    case 5: ROWS(5, __VA_ARGS__); break;                                                     \
    case 6: ROWS(6, __VA_ARGS__); break;                                                     \
    case 7: ROWS(7, __VA_ARGS__); break;                                                     \
    default: ROWS(8, __VA_ARGS__); break;                                                    \
    }

#define GEMV_SWITCH(TILE, ...) SWITCH_ROWS(M, GEMV_ROWS, TILE, __VA_ARGS__)

void half_gemv(const float *x, const uint16_t *w, void *y, int64_t M, int64_t N, int64_t K,
               int is_fp16, int out_bf16, int num_threads)
{
    if (M < 1 || M > 8) return;
    char *yb = y;
    const int64_t ys = out_bf16 ? 2 : 4;
#define NB_OF(MM) FMA_NB(MM)
    GEMV_SWITCH(gemv_tile, is_fp16, out_bf16)
#undef NB_OF
}

/* Any number of rows, each (row, weight row) pair computed by the tiles above exactly as
 * half_gemv computes it for 1 to 8 rows (batch-invariant mode: a row's result is the same
 * alone, among 7 others or in a prompt of 500; kernels/linear.py). Threads take panels of
 * weight rows sized to stay in L2 (PANEL_BYTES), and every tile of up to 8 rows of x runs over
 * a panel before the next panel is read: the weight streams from memory once, not once per
 * 8 rows. A panel's rows are a multiple of 24, so the tiles of every row count fill it. */
#define PANEL_BYTES (384 * 1024)

static inline int64_t panel_rows(int64_t K, int64_t elem)
{
    const int64_t p = PANEL_BYTES / (K * elem) / 24 * 24;
    return p > 24 ? p : 24;
}

/* Where K is longer than ROWS_KC, each tile runs over blocks of K, so that the 8 rows of x
 * it reads stay in L1 (16 KiB of bf16 x; fp32 x blocked at 512 ran slower at K = 1024)
 * instead of coming from L2 for every weight row: a tile's sums carry from block to block in
 * `part`, lane by lane, so every lane adds the same products in the same order as without
 * blocks (the same results, bit for bit). Panels are then ROWS_BLOCK_PANEL weight rows, their
 * sums (8 rows x 48 vectors) on the stack. */
#define ROWS_KC 1024
#define ROWS_BLOCK_PANEL 48

#define SPAN_ROWS(MM, TILE, ...)                                                             \
    do {                                                                                     \
        const int NB = NB_OF(MM);                                                            \
        int64_t n = n0;                                                                      \
        for (; n + NB <= n1; n += NB)                                                        \
            TILE(xr, w + n * K, yr + n * ys, N, K, MM, NB, k0, k1,                           \
                 blocked ? part + (n - n0) * 8 * vw : NULL, __VA_ARGS__);                     \
        for (; n < n1; ++n)                                                                  \
            TILE(xr, w + n * K, yr + n * ys, N, K, MM, 1, k0, k1,                            \
                 blocked ? part + (n - n0) * 8 * vw : NULL, __VA_ARGS__);                     \
    } while (0)

/* V: the floats of one accumulator vector */
#define ROWS_OVER_PANELS(TILE, V, ...)                                                       \
    do {                                                                                     \
        const int64_t kc = ROWS_KC, vw = (V);                                                \
        const int blocked = K > kc;                                                          \
        int64_t P = panel_rows(K, 2);                                                        \
        if (blocked && P > ROWS_BLOCK_PANEL) P = ROWS_BLOCK_PANEL;                           \
        const int64_t panels = (N + P - 1) / P;                                              \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                \
        for (int64_t p = 0; p < panels; ++p) {                                               \
            float part[ROWS_BLOCK_PANEL * 8 * (V)] __attribute__((aligned(64)));             \
            const int64_t n0 = p * P, n1 = n0 + P < N ? n0 + P : N;                          \
            for (int64_t r0 = 0; r0 < M; r0 += 8) {                                          \
                const int64_t mm = M - r0 < 8 ? M - r0 : 8;                                  \
                const __typeof__(x) xr = x + r0 * K;                                         \
                char *yr = yb + r0 * N * ys;                                                 \
                for (int64_t k0 = 0; k0 < K; k0 += kc) {                                     \
                    const int64_t k1 = K - k0 <= kc ? K : k0 + kc;                           \
                    SWITCH_ROWS(mm, SPAN_ROWS, TILE, __VA_ARGS__);                           \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    } while (0)

void half_gemv_rows(const float *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                    int64_t K, int is_fp16, int out_bf16, int num_threads)
{
    char *yb = y;
    const int64_t ys = out_bf16 ? 2 : 4;
#define NB_OF(MM) FMA_NB(MM)
    ROWS_OVER_PANELS(gemv_tile, 8, is_fp16, out_bf16);
#undef NB_OF
}


/* Many rows on the fma path, rows along the vector lanes: y[M, N] = x[M, K] W^T as outer
 * products of a vector of rows of x (x transposed once per call into groups of two vectors of
 * rows, xp[g][k][LANES_XR], rows past M and inputs past K zero) and one weight element
 * broadcast. Threads take contiguous ranges of panels of LANES_LP weight rows; a block of
 * LANES_KC inputs of a panel is widened to fp32 once (plain conversion, no transpose: wb[k /
 * 64][j][k % 64], so that a tile's broadcasts are one pointer and constant offsets), and every
 * group of rows runs its tiles over it: MV vectors of rows by NB weight rows of accumulators,
 * per input one load of each row vector and one broadcast of each weight element (half_gemm's
 * tile mirrored: there the weight must be transposed, here x, which is small and read for every
 * panel). The next panel is prefetched into L2 over the current one's tiles. Each (row, weight
 * row) sum is one FMA chain over each block of inputs from zero, the blocks added in order, in
 * whichever tile and lane the row lands: a row's result does not depend on M or on the rows
 * beside it (but it is not half_gemv's order, so the batch-invariant mode keeps gemv_rows). */
#ifdef __AVX512F__
typedef __m512 lvec;
#define LV 16
#define LV_LOAD(p) _mm512_load_ps(p)
#define LV_ZERO() _mm512_setzero_ps()
#define LV_BCAST(p) _mm512_set1_ps(*(p))
#define LV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define LV_ADD(a, b) _mm512_add_ps(a, b)
#define LV_STORE(p, v) _mm512_store_ps(p, v)
#define LANES_NB1 24 /* weight rows per tile: one vector of rows (24 accumulators) */
#define LANES_NB2 12 /* two vectors of rows */
#else
typedef __m256 lvec;
#define LV 8
#define LV_LOAD(p) _mm256_load_ps(p)
#define LV_ZERO() _mm256_setzero_ps()
#define LV_BCAST(p) _mm256_broadcast_ss(p)
#define LV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define LV_ADD(a, b) _mm256_add_ps(a, b)
#define LV_STORE(p, v) _mm256_store_ps(p, v)
#define LANES_NB1 12
#define LANES_NB2 6
#endif
#define LANES_XR (2 * LV) /* rows of x per group */
#define LANES_LP 24       /* weight rows per panel: a multiple of both NBs */
#define LANES_KB 64       /* the panel's inputs in blocks of 64: wb[k / 64][j][k % 64] */
#define LANES_KC 512      /* inputs widened at a time (a multiple of LANES_KB) */

int half_gemm_lanes_width(void) { return LV; }

static inline __attribute__((always_inline)) void lanes_tile(
    const float *xp, const float *wb, int64_t kc, int MV, int NB, float *part, int first,
    int last, int rows, int cols, void *y, int64_t ldy, int out_bf16, const char **pf,
    const char *pf_end, int pf_lines)
{
    lvec acc[2][LANES_NB1];
    #pragma GCC unroll 2
    for (int v = 0; v < MV; ++v)
        #pragma GCC unroll 24
        for (int j = 0; j < NB; ++j) acc[v][j] = LV_ZERO();
    const char *next = *pf;
    for (int64_t kb = 0; kb < kc; kb += LANES_KB) {
        const float *wk = wb + kb * LANES_LP;  /* this block's LANES_KB inputs of every row */
        for (int i = 0; i < pf_lines && next < pf_end; ++i, next += 64)
            _mm_prefetch(next, _MM_HINT_T1);
        for (int kk = 0; kk < LANES_KB; ++kk) {
            lvec a[2];
            #pragma GCC unroll 2
            for (int v = 0; v < MV; ++v) a[v] = LV_LOAD(xp + (kb + kk) * LANES_XR + v * LV);
            #pragma GCC unroll 24
            for (int j = 0; j < NB; ++j) {
                const lvec b = LV_BCAST(wk + j * LANES_KB + kk);
                #pragma GCC unroll 2
                for (int v = 0; v < MV; ++v) acc[v][j] = LV_FMA(a[v], b, acc[v][j]);
            }
        }
    }
    *pf = next;
    #pragma GCC unroll 2
    for (int v = 0; v < MV; ++v)  /* this block's sums added to the blocks' before */
        #pragma GCC unroll 24
        for (int j = 0; j < NB; ++j) {
            float *p = part + (v * NB + j) * LV;
            LV_STORE(p, first ? acc[v][j] : LV_ADD(LV_LOAD(p), acc[v][j]));
        }
    if (last)  /* part[v][j][lane]: row v * LV + lane, weight row j */
        for (int r = 0; r < rows; ++r)
            for (int j = 0; j < cols; ++j)
                act_st(y, r * ldy + j, part[((r / LV) * NB + j) * LV + r % LV], out_bf16);
}

/* w's rows n0 .. n0 + ncols (zeros up to LANES_LP), inputs k0 .. k0 + kc (kc a multiple of
 * LANES_KB; zeros past K), widened into wb[k / LANES_KB][j][k % LANES_KB] */
static void lanes_widen(const uint16_t *w, int64_t K, int64_t n0, int ncols, int64_t k0,
                        int64_t kc, float *wb, int is_fp16)
{
    for (int j = 0; j < LANES_LP; ++j)  /* each row's kc inputs in order: one stream */
        for (int64_t kb = 0; kb < kc; kb += LANES_KB) {
            float *d = wb + kb * LANES_LP + j * LANES_KB;
            const uint16_t *s = w + (n0 + j) * K + k0 + kb;
            if (j < ncols && k0 + kb + LANES_KB <= K) {
#ifdef __AVX512F__
                #pragma GCC unroll 4
                for (int k = 0; k < LANES_KB; k += 16) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(s + k));
                    _mm512_store_ps(d + k, is_fp16 ? _mm512_cvtph_ps(h)
                                    : _mm512_castsi512_ps(_mm512_slli_epi32(
                                          _mm512_cvtepu16_epi32(h), 16)));
                }
#else
                #pragma GCC unroll 8
                for (int k = 0; k < LANES_KB; k += 8)
                    _mm256_store_ps(d + k, widen8(s + k, is_fp16));
#endif
            } else {
                for (int k = 0; k < LANES_KB; ++k)
                    d[k] = j < ncols && k0 + kb + k < K ? half_to_float(s[k], is_fp16) : 0.0f;
            }
        }
}

int half_gemm_lanes(const void *x, int x_bf16, const uint16_t *w, void *y, int64_t M,
                    int64_t N, int64_t K, int is_fp16, int out_bf16, int num_threads)
{
    if (K <= 0) {  /* empty sums */
        memset(y, 0, (size_t)(M * N * (out_bf16 ? 2 : 4)));
        return 0;
    }
    /* K padded with zeros to a whole block (x and w both zero there: each sum gains +0s) */
    const int64_t Kp = (K + LANES_KB - 1) / LANES_KB * LANES_KB;
    const int64_t G = (M + LANES_XR - 1) / LANES_XR, P = (N + LANES_LP - 1) / LANES_LP;
    float *xp = aligned_alloc(64, (size_t)(G * Kp * LANES_XR * 4));
    if (!xp) return -1;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* x transposed by blocks of 8 rows x 8 inputs, each thread a range of inputs */
        #pragma omp for schedule(static)
        for (int64_t k = 0; k < Kp; k += 8)
            for (int64_t g = 0; g < G; ++g)
                for (int rb = 0; rb < LANES_XR; rb += 8) {
                    const int64_t m0 = g * LANES_XR + rb;
                    __m256 r[8];
                    for (int i = 0; i < 8; ++i) {
                        const int64_t m = m0 + i;
                        if (m < M && k + 8 <= K) {
                            r[i] = x_bf16 ? widen8((const uint16_t *)x + m * K + k, 0)
                                          : _mm256_loadu_ps((const float *)x + m * K + k);
                        } else {
                            float t[8];
                            for (int c = 0; c < 8; ++c)
                                t[c] = m >= M || k + c >= K ? 0.0f
                                       : x_bf16 ? bf16_to_f32(((const uint16_t *)x)[m * K + k + c])
                                                : ((const float *)x)[m * K + k + c];
                            r[i] = _mm256_loadu_ps(t);
                        }
                    }
                    transpose8(r);
                    for (int c = 0; c < 8; ++c)
                        _mm256_store_ps(xp + (g * Kp + k + c) * LANES_XR + rb, r[c]);
                }
        /* per thread: a block of the panel widened, and each tile's sums between blocks */
        float *wb = aligned_alloc(64, (size_t)LANES_LP * LANES_KC * 4);
        float *part = aligned_alloc(64, (size_t)(G * LANES_LP * LANES_XR * 4));
        if (!wb || !part) {
            #pragma omp atomic write
            failed = 1;
        }
        const int64_t ys = out_bf16 ? 2 : 4;
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; ++p) {
            if (!wb || !part) continue;
            const int64_t n0 = p * LANES_LP;
            const int ncols = (int)(N - n0 < LANES_LP ? N - n0 : LANES_LP);
            /* the next panel's weights prefetched into L2 while this one's tiles run, spread
             * over their blocks of inputs */
            const char *pf = (const char *)(w + (n0 + LANES_LP < N ? n0 + LANES_LP : N) * K);
            const char *pf_end =
                (const char *)(w + (n0 + 2 * LANES_LP < N ? n0 + 2 * LANES_LP : N) * K);
            const int64_t blocks = G * (LANES_LP / LANES_NB1) * (Kp / LANES_KB);
            const int pf_lines = (int)(((pf_end - pf) / 64 + blocks - 1) / blocks) + 1;
            for (int64_t k0 = 0; k0 < Kp; k0 += LANES_KC) {
                const int64_t kc = Kp - k0 < LANES_KC ? Kp - k0 : LANES_KC;
                const int first = k0 == 0, last = k0 + kc == Kp;
                lanes_widen(w, K, n0, ncols, k0, kc, wb, is_fp16);
                for (int64_t g = 0; g < G; ++g) {
                    const int rows =
                        (int)(M - g * LANES_XR < LANES_XR ? M - g * LANES_XR : LANES_XR);
                    const float *xg = xp + (g * Kp + k0) * LANES_XR;
                    float *pg = part + g * LANES_LP * LANES_XR;
                    char *yg = (char *)y + (g * LANES_XR * N + n0) * ys;
                    if (rows > LV) {
                        for (int j = 0; j < ncols; j += LANES_NB2)
                            lanes_tile(xg, wb + j * LANES_KB, kc, 2, LANES_NB2,
                                       pg + j * LANES_XR, first, last, rows,
                                       ncols - j < LANES_NB2 ? ncols - j : LANES_NB2,
                                       yg + j * ys, N, out_bf16, &pf, pf_end, pf_lines);
                    } else {
                        for (int j = 0; j < ncols; j += LANES_NB1)
                            lanes_tile(xg, wb + j * LANES_KB, kc, 1, LANES_NB1,
                                       pg + j * LANES_XR, first, last, rows,
                                       ncols - j < LANES_NB1 ? ncols - j : LANES_NB1,
                                       yg + j * ys, N, out_bf16, &pf, pf_end, pf_lines);
                    }
                }
            }
        }
        free(wb);
        free(part);
    }
    free(xp);
    return failed ? -1 : 0;
}

#else  /* no AVX2 + FMA + F16C: half_gemm_simd() says so and callers keep their own path */

int half_gemm_simd(void) { return 0; }


void half_gemv(const float *x, const uint16_t *w, void *y, int64_t M, int64_t N, int64_t K,
               int is_fp16, int out_bf16, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)is_fp16; (void)out_bf16;
    (void)num_threads;
}

void half_gemv_rows(const float *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                    int64_t K, int is_fp16, int out_bf16, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)is_fp16; (void)out_bf16;
    (void)num_threads;
}

void half_gemm(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N,
               int64_t K, int is_fp16, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)is_fp16; (void)num_threads;
}

int half_gemm_lanes_width(void) { return 0; }

int half_gemm_lanes(const void *x, int x_bf16, const uint16_t *w, void *y, int64_t M,
                    int64_t N, int64_t K, int is_fp16, int out_bf16, int num_threads)
{
    (void)x; (void)x_bf16; (void)w; (void)y; (void)M; (void)N; (void)K; (void)is_fp16;
    (void)out_bf16; (void)num_threads;
    return -1;
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

/* 16 vectors -> one vector of their 16 lane sums, in order, each by the same tree: lanes i and
 * i + 8, then i and i + 4, i and i + 2, and the last pair */
static inline __m512 reduce16(const __m512 v[16])
{
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; ++i)
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88),
                                   _mm512_shuffle_ps(u[0], u[1], 0xDD));
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* weight rows per tile for M rows of bf16 x: M * NB accumulators (16 or more where the 32
 * registers allow, the dot products' latency and the tile's loads hidden; 8 rows: 24, the x
 * loads fewer per dot product than with 16); up to 4 rows: one weight row at a time, a single
 * sequential stream (one row unprefetched; 8 rows side by side and prefetched made a decode
 * step's one-row products slower than that; docs/performance.md) */
#define DOT_NB(M) ((M) <= 4 ? 1 : (M) == 5 ? 4 : 3)

/* Up to 8 rows of bf16 x: half_gemv's tiles with 32 inputs a step and no widening (masked loads
 * for the tail); the same promise, each row's sums independent of M. */
static inline __attribute__((always_inline)) void gemv_tile16(
    const uint16_t *x, const uint16_t *w, void *y, int64_t N, int64_t K, int M, int NB,
    int64_t k0, int64_t k1, float *part, int out_bf16)
{
    __m512 acc[24];
    #pragma GCC unroll 24
    for (int i = 0; i < M * NB; ++i)
        acc[i] = k0 ? _mm512_load_ps(part + 16 * i) : _mm512_setzero_ps();
    const int64_t K32 = K & ~(int64_t)31, kend = k1 < K32 ? k1 : K32;
    const char *ahead = prefetch_base(w, K, NB);
    for (int64_t k = k0; k < kend; k += 32) {
        __m512i wv[8];
        #pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
            wv[j] = _mm512_loadu_si512((const void *)(w + j * K + k));
            if (M > 1) _mm_prefetch(ahead + (k * NB + 32 * j) * 2, _MM_HINT_T1);
        }
        #pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k));
            #pragma GCC unroll 8
            for (int j = 0; j < NB; ++j)
                acc[m * NB + j] = _mm512_dpbf16_ps(acc[m * NB + j], xv, (__m512bh)wv[j]);
        }
    }
    if (k1 < K) {  /* a block of K: the sums so far, lane by lane, for the next block */
        #pragma GCC unroll 24
        for (int i = 0; i < M * NB; ++i) _mm512_store_ps(part + 16 * i, acc[i]);
        return;
    }
    if (K32 < K) {  /* the last K % 32 inputs, zeros past K */
        const __mmask32 mk = (__mmask32)((1u << (K - K32)) - 1);
        __m512i wv[8];
        #pragma GCC unroll 8
        for (int j = 0; j < NB; ++j)
            wv[j] = _mm512_maskz_loadu_epi16(mk, w + j * K + K32);
        #pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + m * K + K32);
            #pragma GCC unroll 8
            for (int j = 0; j < NB; ++j)
                acc[m * NB + j] = _mm512_dpbf16_ps(acc[m * NB + j], xv, (__m512bh)wv[j]);
        }
    }
    #pragma GCC unroll 2
    for (int b = 0; b < (M * NB + 15) / 16; ++b) {
        __m512 v[16];
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
            v[i] = b * 16 + i < M * NB ? acc[b * 16 + i] : _mm512_setzero_ps();
        float s[16];
        _mm512_storeu_ps(s, reduce16(v));
        const int count = M * NB - b * 16 < 16 ? M * NB - b * 16 : 16;
        for (int i = 0; i < count; ++i) {
            const int a = b * 16 + i;
            act_st(y, (int64_t)(a / NB) * N + a % NB, s[i], out_bf16);
        }
    }
}

void half_gemv_bf16(const uint16_t *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                    int64_t K, int out_bf16, int num_threads)
{
    if (M < 1 || M > 8) return;
    char *yb = y;
    const int64_t ys = out_bf16 ? 2 : 4;
#define NB_OF(MM) DOT_NB(MM)
    GEMV_SWITCH(gemv_tile16, out_bf16)
#undef NB_OF
}

/* half_gemv_rows for bf16 x: the tiles of half_gemv_bf16 over L2-sized panels */
void half_gemv_bf16_rows(const uint16_t *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                         int64_t K, int out_bf16, int num_threads)
{
    char *yb = y;
    const int64_t ys = out_bf16 ? 2 : 4;
#define NB_OF(MM) DOT_NB(MM)
    ROWS_OVER_PANELS(gemv_tile16, 16, out_bf16);
#undef NB_OF
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
void half_gemv_bf16_rows(const uint16_t *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                         int64_t K, int out_bf16, int num_threads)
{
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)out_bf16; (void)num_threads;
}
#endif

/* fp32 weights, any number of rows, each (row, weight row) pair by the same operations: 16
 * running sums over k (a lane per k mod 16), the tail into the first ones, then one fixed
 * tree (batch-invariant mode for fp32 models; BLAS picks its kernels and its split of k by the
 * shape). Plain C that the compiler vectorizes; threads take panels of weight rows as above,
 * every row of x passing over a panel while it is in cache. */
static inline float dot_f32(const float *a, const float *b, int64_t K)
{
    float acc[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; ++l) acc[l] += a[k + l] * b[k + l];
    for (int l = 0; k < K; ++k, ++l) acc[l] += a[k] * b[k];
    for (int s = 8; s > 0; s /= 2)
        for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
    return acc[0];
}

void f32_gemm_rows(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads)
{
    int64_t P = (256 * 1024) / (K * 4 > 0 ? K * 4 : 1);
    P = P > 8 ? P : 8;
    const int64_t panels = (N + P - 1) / P;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t n1 = (p + 1) * P < N ? (p + 1) * P : N;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = p * P; n < n1; ++n)
                y[m * N + n] = dot_f32(x + m * K, w + n * K, K);
    }
}
