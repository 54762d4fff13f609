/* What the machine allows, for the benchmarks' ceilings (hybridrt/bench/ceilings.py): a streaming
 * read of an fp32 buffer (the weight-streaming bandwidth) and register-only loops of each product
 * path's instructions (their arithmetic peak).
 *
 * stream_sum(x, n, threads) -> the sum of x[0..n): each thread reads one contiguous slice with
 * the widest vector loads this build has (AVX-512, else AVX2, else scalar), into four independent
 * accumulators, so the loop is limited by memory, not by the add latency; fp32 sums of blocks of
 * 64 Ki floats are added up in fp64. The sum is returned so the compiler cannot drop the reads;
 * the tests check it against torch's sum.
 * stream_vector_bytes() -> the width of those loads in bytes (64, 32 or 4).
 * dot_peak(kind, iters, threads) -> the arithmetic ceiling of a product kernel's inner step: each
 * thread runs ``iters`` rounds of 8 to 16 independent accumulations (as many as the registers
 * hold) with the instructions of one path
 * (DOT_FMA: ymm FMAs of fp32, the fma half path; DOT_BF16: zmm bf16 dot products, bf16dot;
 * DOT_VNNI: zmm u8 x s8 dot products, int8 vnni; DOT_AVX2_INT8: int8 avx2's sign, maddubs, madd
 * and add on ymm), operands in registers; returns a sum of the results (so that the loop stays).
 * dot_peak_has(kind) -> whether this build has that kind's instructions (dot_peak does nothing
 * otherwise); dot_peak_ops(kind) -> multiply-adds x 2 of one round of one thread.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

int stream_vector_bytes(void)
{
#if defined(__AVX512F__)
    return 64;
#elif defined(__AVX2__)
    return 32;
#else
    return 4;
#endif
}

static float sum_block(const float *x, int64_t n)
{
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(x + i));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(x + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_loadu_ps(x + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_loadu_ps(x + i + 48));
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + i + 24));
    }
    __m256 t = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_hadd_ps(h, h);
    s = _mm_cvtss_f32(_mm_hadd_ps(h, h));
#else
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (; i + 4 <= n; i += 4) {
        a0 += x[i]; a1 += x[i + 1]; a2 += x[i + 2]; a3 += x[i + 3];
    }
    s = (a0 + a1) + (a2 + a3);
#endif
    for (; i < n; ++i)
        s += x[i];
    return s;
}

/* blocks of 64 Ki floats summed in fp32, their sums in fp64: exact for integer values < 256 */
static double sum_slice(const float *x, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i += 1 << 16)
        s += sum_block(x + i, n - i < (1 << 16) ? n - i : (1 << 16));
    return s;
}

double stream_sum(const float *x, int64_t n, int num_threads)
{
    double total = 0.0;
    #pragma omp parallel num_threads(num_threads) reduction(+:total)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        const int64_t per = ((n + nt - 1) / nt + 15) / 16 * 16;  /* slices start on 64-byte boundaries */
        const int64_t lo = t * per, hi = lo + per < n ? lo + per : n;
        if (lo < n)
            total += sum_slice(x + lo, hi - lo);
    }
    return total;
}

enum { DOT_FMA = 0, DOT_BF16 = 1, DOT_VNNI = 2, DOT_AVX2_INT8 = 3 };

double dot_peak_ops(int kind)
{
    switch (kind) {
    case DOT_FMA: return 12.0 * 8 * 2;       /* 12 ymm FMAs of 8 lanes */
    case DOT_BF16: return 16.0 * 32 * 2;     /* 16 zmm dot products of 16 lanes x 2 pairs */
    case DOT_VNNI: return 16.0 * 64 * 2;     /* 16 zmm u8 x s8 of 16 lanes x 4 bytes */
    case DOT_AVX2_INT8: return 8.0 * 32 * 2; /* 4 rows x 2 halves of 32 bytes */
    default: return 0.0;
    }
}

/* the accumulators pass through an empty asm each round, so no round can be folded away */
#define KEEP(v) __asm__ volatile("" : "+v"(v))

static double peak_thread(int kind, int64_t iters)
{
    double out = -1.0;
    switch (kind) {
#if defined(__AVX2__) && defined(__FMA__)
    case DOT_FMA: {  /* 12 accumulators: within the 16 ymm of an AVX2 CPU */
        __m256 a[12], x = _mm256_set1_ps(1.0f), w = _mm256_set1_ps(1e-9f);
        #pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps((float)i);
        for (int64_t n = 0; n < iters; ++n) {
            #pragma GCC unroll 12
            for (int i = 0; i < 12; ++i) { a[i] = _mm256_fmadd_ps(x, w, a[i]); KEEP(a[i]); }
        }
        float s[8];
        #pragma GCC unroll 12
        for (int i = 1; i < 12; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
        _mm256_storeu_ps(s, a[0]);
        out = s[0];
        break;
    }
    case DOT_AVX2_INT8: {  /* as int8 avx2's step: per row of x, |x| and two halves of w */
        __m256i a[8];
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i w0 = _mm256_set1_epi8(-2), w1 = _mm256_set1_epi8(5);
        __m256i x = _mm256_set1_epi8(3);
        #pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) a[i] = _mm256_set1_epi32(i);
        for (int64_t n = 0; n < iters; ++n) {
            #pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
                KEEP(x);  /* a new row of x: nothing computed from it can be reused */
                const __m256i ax = _mm256_abs_epi8(x);
                a[2 * r] = _mm256_add_epi32(a[2 * r], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, x)), ones));
                a[2 * r + 1] = _mm256_add_epi32(a[2 * r + 1], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, x)), ones));
                KEEP(a[2 * r]);
                KEEP(a[2 * r + 1]);
            }
        }
        #pragma GCC unroll 8
        for (int i = 1; i < 8; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
        out = (double)_mm256_extract_epi32(a[0], 0);
        break;
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    case DOT_BF16: {
        __m512 a[16];
        const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(0x00010001);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps((float)i);
        for (int64_t n = 0; n < iters; ++n)
            #pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) { a[i] = _mm512_dpbf16_ps(a[i], x, w); KEEP(a[i]); }
        #pragma GCC unroll 16
        for (int i = 1; i < 16; ++i) a[0] = _mm512_add_ps(a[0], a[i]);
        out = _mm512_reduce_add_ps(a[0]);
        break;
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    case DOT_VNNI: {
        __m512i a[16];
        const __m512i x = _mm512_set1_epi32(0x01010101), w = _mm512_set1_epi32(0x02020202);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_epi32(i);
        for (int64_t n = 0; n < iters; ++n)
            #pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) { a[i] = _mm512_dpbusd_epi32(a[i], w, x); KEEP(a[i]); }
        #pragma GCC unroll 16
        for (int i = 1; i < 16; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
        out = (double)_mm512_reduce_add_epi32(a[0]);
        break;
    }
#endif
    default:
        (void)iters;
        break;
    }
    return out;
}

int dot_peak_has(int kind)
{
    switch (kind) {
#if defined(__AVX2__) && defined(__FMA__)
    case DOT_FMA: case DOT_AVX2_INT8: return 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    case DOT_BF16: return 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    case DOT_VNNI: return 1;
#endif
    default: return 0;
    }
}

double dot_peak(int kind, int64_t iters, int num_threads)
{
    if (!dot_peak_has(kind)) return 0.0;
    double total = 0.0;
    #pragma omp parallel num_threads(num_threads) reduction(+:total)
    total += peak_thread(kind, iters);
    return total;
}
