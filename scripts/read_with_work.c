/* How much of the read loop's bandwidth a 4-bit GEMV can keep once it does the least work its
 * format asks (docs/performance.md, "## int4", "What the read leaves"). Two threads each stream
 * their half of a 512 MiB buffer (2 MiB huge pages) laid out as the 4-bit format's three
 * streams (per group of 16 columns x 32 inputs: 256 bytes of nibbles and 32 of codes; per 8
 * groups: 64 bytes of scales), and per group either
 *   read: add the loaded vectors (what the read loop does, over the same three streams);
 *   dot:  unpack the nibbles (and, shift, and) and 8 AVX-512 VNNI dot products with a row of x
 *         held in registers: the least a one-row product of this format can do;
 *   full: dot plus the format's fp32 steps a group (the codes widened to fp32, step and minimum
 *         products, two fused multiply-adds), as csrc/int4_gemm.c's one-row tile does them.
 * The three alternate rep by rep, so that each rep's figures come from the same seconds of the
 * machine; a rep's "read" says which of the machine's read levels it caught.
 *
 *   cc -O2 -march=native -fopenmp scripts/read_with_work.c -o /tmp/read_with_work
 *   OMP_NUM_THREADS=2 /tmp/read_with_work 30             # 30 reps over 512 MiB
 *   OMP_NUM_THREADS=2 /tmp/read_with_work 30 600 1000    # 600 KiB, 1000 passes a rep: from L2
 *
 * Needs AVX-512 VNNI (it exits otherwise).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <omp.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { READ, DOT, FULL, MODES };

static float run(const uint8_t *qs, const uint8_t *codes, const uint8_t *scales, int64_t groups,
                 int mode)
{
    float out = 0.0f;
    #pragma omp parallel reduction(+ : out)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t g0 = groups * t / T / 8 * 8, g1 = t == T - 1 ? groups : groups * (t + 1) / T / 8 * 8;
        const __m512i low = _mm512_set1_epi8(0x0f), x = _mm512_set1_epi32(0x01fe03fd);
        __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
        __m512 acc = _mm512_setzero_ps(), D = _mm512_set1_ps(1e-3f), M = D;
        for (int64_t g = g0; g < g1; ++g) {
            const uint8_t *q = qs + g * 256, *c = codes + g * 32;
            if (g % 8 == 0) {
                const __m512i s = _mm512_loadu_si512(scales + g / 8 * 64);
                if (mode == READ) s2 = _mm512_add_epi32(s2, s);
                else { D = _mm512_castsi512_ps(s); M = _mm512_castsi512_ps(_mm512_srli_epi32(s, 1)); }
            }
            const __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64),
                          v2 = _mm512_loadu_si512(q + 128), v3 = _mm512_loadu_si512(q + 192);
            if (mode == READ) {
                s0 = _mm512_add_epi32(s0, _mm512_add_epi32(v0, v1));
                s1 = _mm512_add_epi32(s1, _mm512_add_epi32(v2, v3));
                s3 = _mm512_add_epi32(s3, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c)));
                continue;
            }
            __m512i lo = _mm512_setzero_si512(), hi = lo;
            lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v0, low), x);
            lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v1, low), x);
            lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v2, low), x);
            lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v3, low), x);
            hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(v0, 4), low), x);
            hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(v1, 4), low), x);
            hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(v2, 4), low), x);
            hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(v3, 4), low), x);
            const __m512i dot = _mm512_add_epi32(lo, hi);
            if (mode == DOT) {
                s0 = _mm512_add_epi32(s0, dot);
                s3 = _mm512_add_epi32(s3, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c)));
                continue;
            }
            const __m512 dw = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c))));
            const __m512 mw = _mm512_mul_ps(M, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)))));
            const __m512 dx = _mm512_set1_ps(1e-2f + (float)(g & 1)), dxs = _mm512_set1_ps(3e-2f);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc);
            acc = _mm512_fnmadd_ps(mw, dxs, acc);
        }
        const __m512i s = _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
        out += (float)_mm512_reduce_add_epi32(s) + _mm512_reduce_add_ps(acc);
    }
    return out;
}

int main(int argc, char **argv)
{
    const int reps = argc > 1 ? atoi(argv[1]) : 20;
    const int64_t kib = argc > 2 ? atoll(argv[2]) : 512 << 10;  /* the buffer, KiB */
    const int passes = argc > 3 ? atoi(argv[3]) : 1;            /* passes over it a rep */
    if (reps < 1 || kib < 64 || passes < 1) {
        fprintf(stderr, "usage: read_with_work [REPS [KIB [PASSES]]]\n");
        return 2;
    }
    const int64_t groups = (kib << 10) / (256 + 32 + 8) / 8 * 8;
    const int64_t bytes = groups * (256 + 32 + 8);
    uint8_t *buf = aligned_alloc(1 << 21, (size_t)((bytes >> 21) + 1) << 21);
    if (buf == NULL) return 1;
    madvise(buf, (size_t)((bytes >> 21) + 1) << 21, MADV_HUGEPAGE);
    for (int64_t i = 0; i < bytes; ++i) buf[i] = (uint8_t)(i * 131 + 7);
    const uint8_t *qs = buf, *codes = buf + groups * 256, *scales = codes + groups * 32;
    volatile float sink = 0.0f;
    sink += run(qs, codes, scales, groups, READ);  /* warm-up */
    printf("%d threads, %.2f MiB a pass, %d passes a rep; GB/s per rep, and dot / read, full / "
           "read\n", omp_get_max_threads(), bytes / 1048576.0, passes);
    for (int r = 0; r < reps; ++r) {
        double gb[MODES];
        for (int m = 0; m < MODES; ++m) {
            const int mode = (m + r) % MODES;  /* the order turns rep by rep */
            const double t = now();
            for (int k = 0; k < passes; ++k) sink += run(qs, codes, scales, groups, mode);
            gb[mode] = (double)bytes * passes / (now() - t) / 1e9;
        }
        printf("rep %2d: read %5.1f  dot %5.1f  full %5.1f   dot/read %.2f  full/read %.2f\n", r,
               gb[READ], gb[DOT], gb[FULL], gb[DOT] / gb[READ], gb[FULL] / gb[READ]);
    }
    return sink == 12345.0f;
}
#else
int main(void)
{
    fprintf(stderr, "read_with_work: needs a build with AVX-512 VNNI (-march=native on such a CPU)\n");
    return 2;
}
#endif
