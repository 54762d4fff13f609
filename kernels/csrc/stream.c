/* A streaming read of an fp32 buffer, for the weight-streaming bandwidth ceiling of
 * ``hybridrt bench throughput`` (hybridrt/ceilings.py).
 *
 * stream_sum(x, n, threads) -> the sum of x[0..n): each thread reads one contiguous slice with
 * the widest vector loads this build has (AVX-512, else AVX2, else scalar), into four independent
 * accumulators, so the loop is limited by memory, not by the add latency; fp32 sums of blocks of
 * 64 Ki floats are added up in fp64. The sum is returned so the compiler cannot drop the reads;
 * the tests check it against torch's sum.
 * stream_vector_bytes() -> the width of those loads in bytes (64, 32 or 4).
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
