/* A gated attention layer's decode or verification tokens in one call, from the q/k/v
 * projections' outputs to the input of o_proj: B sequences of L new tokens each (decode: L = 1;
 * draft verification: L = 1 + k) over their paged KV, token t of a sequence with context n
 * (this step's tokens included) attending to positions 0 .. n - L + t.
 *
 * As the reference ops compute it (hybridrt/model.py GatedAttention, kernels/attention.py):
 *   q, k:  per head RMSNorm (zero-centred weight), rounded, then partial RoPE on the first R
 *          dims in rotate-half pairs, round(round(x cos) + round(rot(x) sin))
 *   cache: the token's k (normed, rotated) and v written to its KV slot
 *   attn:  softmax(scale q.k) v over the token's positions (its sequence's block table),
 *          in fp32, rounded; GQA: head h reads kv head h / (H / HKV)
 *   gate:  out = round(o * round(sigmoid(gate)))
 * "round" is to bf16 when the activations are bf16, nothing when they are fp32.
 *
 * Rows are tokens, sequence after sequence (row b L + t). qg [B L, H * 2D] holds per head D
 * query then D gate values; k, v [B L, HKV * D]; rows ld_* apart. cos, sin [B L, R]; q_w, k_w
 * [D]; caches [num_blocks, BS, HKV, D]; slot_mapping [B L] (flat slot block * BS + offset);
 * tables [B, M]; ctx_lens [B] (>= L); all in the activations' dtype or int64. The caller has
 * checked every slot, block and length against the caches. out [B L, H * D] contiguous.
 * Returns 0, or -1 where its scratch (the queries and partials) could not be allocated.
 *
 * kvq = 1: int8 caches [num_blocks, BS, HKV, W] in kernels/kvquant.py's layout, W = D + 4 D / G:
 * a (token, head) row's D codes, then one fp32 scale per group of G values (G = 32 where D
 * allows, else D); a value is code * scale. Written as kvquant.quantize does: scale =
 * max |x| / 127 over the group, code = round-to-even(x / scale) (0 for an all-zero group).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* y[0:D] = rope(round(rmsnorm(x))) for one head of token (row) b, as rounded values in fp32 */
static void norm_rope(const void *x, int64_t off, const void *w, float eps, const void *cos,
                      const void *sin, int64_t b, int64_t R, int64_t D, int bf, float *y)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < D; ++i) { const float v = act_ld(x, off + i, bf); ss += v * v; }
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; ++i)
        y[i] = act_round(act_ld(x, off + i, bf) * inv * (1.0f + act_ld(w, i, bf)), bf);
    float rot[R > 0 ? R : 1];
    const int64_t half = R / 2;
    for (int64_t i = 0; i < R; ++i) {
        const float c = act_ld(cos, b * R + i, bf), s = act_ld(sin, b * R + i, bf);
        const float rh = i < half ? -y[i + half] : y[i - half];
        rot[i] = act_round(act_round(y[i] * c, bf) + act_round(rh * s, bf), bf);
    }
    for (int64_t i = 0; i < R; ++i) y[i] = rot[i];
}

#define PB 32  /* positions scored per block of the online softmax */

static inline int64_t kv_group(int64_t D) { return D % 32 == 0 ? 32 : D; }

static inline float kv_scale(const char *row, int64_t D, int64_t G, int64_t i)
{
    float s;  /* (a division in the vector loops costs more than the rest of their step) */
    memcpy(&s, row + D + 4 * (G == 32 ? i >> 5 : i / G), 4);
    return s;
}

#if defined(__AVX512F__)
/* values i .. i + 15 of a cache row (fp32, bf16, or kvquant's int8 codes times their scale) */
static inline __m512 kv_ld16(const char *p, int64_t i, int64_t D, int64_t G, int bf, int kvq)
{
    if (!kvq) return act_ld16(p, i, bf, 0xFFFF);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(p + i)))), _mm512_set1_ps(kv_scale(p, D, G, i)));
}
#endif

/* x[0:D] -> an int8 row (codes, then the groups' scales) */
static void kv_quant(const float *x, int64_t D, char *dst)
{
    const int64_t G = kv_group(D);
    for (int64_t g0 = 0; g0 < D; g0 += G) {
        float amax = 0.0f;
        for (int64_t i = g0; i < g0 + G; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float s = amax / 127.0f, safe = s > 0.0f ? s : 1.0f;
        for (int64_t i = g0; i < g0 + G; ++i) {
            float c = nearbyintf(x[i] / safe);
            c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
            dst[i] = (char)(int8_t)c;
        }
        memcpy(dst + D + 4 * (g0 / G), &s, 4);
    }
}

/* q . (an int8 row's values) */
static inline float q8_dot(const float *q, const char *kp, int64_t D, int64_t G, int simd)
{
    const int8_t *c = (const int8_t *)kp;
#if defined(__AVX512F__)
    if (simd == 2) {
        __m512 d16 = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16)
            d16 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), kv_ld16(kp, i, D, G, 0, 1), d16);
        return _mm512_reduce_add_ps(d16);
    }
#endif
#if SIMD_MAX >= 1
    if (simd == 1) {
        __m256 d8 = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(c + i)))), _mm256_set1_ps(kv_scale(kp, D, G, i)));
            d8 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), x, d8);
        }
        return hsum8(d8);
    }
#endif
    float dot = 0.0f;
    for (int64_t i = 0; i < D; ++i) dot += q[i] * ((float)c[i] * kv_scale(kp, D, G, i));
    return dot;
}

/* acc += w (an int8 row's values) */
static inline void q8_axpy(float w, const char *vp, int64_t D, int64_t G, float *acc, int simd)
{
    const int8_t *c = (const int8_t *)vp;
#if defined(__AVX512F__)
    if (simd == 2) {
        const __m512 w16 = _mm512_set1_ps(w);
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(w16, kv_ld16(vp, i, D, G, 0, 1),
                                                      _mm512_loadu_ps(acc + i)));
        return;
    }
#endif
#if SIMD_MAX >= 1
    if (simd == 1) {
        const __m256 w8 = _mm256_set1_ps(w);
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(c + i)))), _mm256_set1_ps(kv_scale(vp, D, G, i)));
            _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(w8, x, _mm256_loadu_ps(acc + i)));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < D; ++i) acc[i] += w * ((float)c[i] * kv_scale(vp, D, G, i));
}

/* Flash-decoding: a row's context is cut into partitions of SPLIT positions, fixed by absolute
 * position; a task scores one partition for the G = H / HKV query heads of one KV head (each K
 * and V row read once for all of them), leaving per head its partial (max m, sum l, acc[D]);
 * then each (row, head) merges its partitions in partition order. Which thread runs which
 * task, and how many rows the call has, change nothing in a row's arithmetic: batch-invariant
 * mode stays bitwise. A row of at most SPLIT positions has one partial, merged as itself: the
 * arithmetic of one online softmax over the whole row. */
#define SPLIT 512
#define SCRATCH_FLOATS ((int64_t)1 << 22)  /* partials held at once (rows taken in passes) */

/* q . (a K row: fp32, bf16 or kvquant's int8) */
static inline float k_dot(const float *q, const char *kp, int64_t D, int64_t G, int bf, int kvq,
                          int simd)
{
    if (kvq) return q8_dot(q, kp, D, G, simd);
#if defined(__AVX512F__)
    if (simd == 2) {
        __m512 d16 = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16)
            d16 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), act_ld16(kp, i, bf, 0xFFFF), d16);
        return _mm512_reduce_add_ps(d16);
    }
#endif
#if SIMD_MAX >= 1
    if (simd == 1) {
        __m256 d8 = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8)
            d8 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), act_ld8(kp, i, bf), d8);
        return hsum8(d8);
    }
#endif
    float dot = 0.0f;
    if (bf)
        for (int64_t i = 0; i < D; ++i) dot += q[i] * bf16_to_f32(((const uint16_t *)kp)[i]);
    else for (int64_t i = 0; i < D; ++i) dot += q[i] * ((const float *)kp)[i];
    return dot;
}

/* a K or V row's values in fp32, as the loads above widen them (the same bits), so that the
 * G query heads of its KV head read it widened once */
static inline void widen_row(const char *p, int64_t D, int64_t G, int bf, int kvq, float *dst)
{
    if (kvq) {
        const int8_t *c = (const int8_t *)p;
        for (int64_t g0 = 0; g0 < D; g0 += G) {
            const float sc = kv_scale(p, D, G, g0);
            for (int64_t i = g0; i < g0 + G; ++i) dst[i] = (float)c[i] * sc;
        }
    } else if (bf) {
        for (int64_t i = 0; i < D; ++i) dst[i] = bf16_to_f32(((const uint16_t *)p)[i]);
    } else {
        memcpy(dst, p, sizeof(float) * (size_t)D);
    }
}

/* acc += w (a V row) */
static inline void v_axpy(float w, const char *vp, int64_t D, int64_t G, int bf, int kvq,
                          int simd, float *acc)
{
    if (kvq) { q8_axpy(w, vp, D, G, acc, simd); return; }
#if defined(__AVX512F__)
    if (simd == 2) {
        const __m512 w16 = _mm512_set1_ps(w);
        for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(w16, act_ld16(vp, i, bf, 0xFFFF),
                                                      _mm512_loadu_ps(acc + i)));
        return;
    }
#endif
#if SIMD_MAX >= 1
    if (simd == 1) {
        const __m256 w8 = _mm256_set1_ps(w);
        for (int64_t i = 0; i < D; i += 8)
            _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(w8, act_ld8(vp, i, bf),
                                                      _mm256_loadu_ps(acc + i)));
        return;
    }
#endif
    if (bf)
        for (int64_t i = 0; i < D; ++i) acc[i] += w * bf16_to_f32(((const uint16_t *)vp)[i]);
    else for (int64_t i = 0; i < D; ++i) acc[i] += w * ((const float *)vp)[i];
}

#if defined(__AVX512F__)
#define GQ_MAX 16  /* query heads per KV head the AVX-512 partition routine takes */

#define PF 128  /* positions ahead whose K and V rows are read early (far rows only) */
#define FAR 2048  /* a row's context from which its tasks read rows PF ahead */

/* the K and V rows of position pos + PF (hw bytes from off), if pos + PF < end, read now (one
 * byte a cache line, the values dropped) so that they are near when their turn comes: the
 * blocks of a context lie anywhere, and the hardware prefetchers stop at each page. Loads, not
 * prefetch instructions: with _mm_prefetch (T0, T1, any distance) one layer at 16384 cached
 * tokens took as long as without it (3.0-3.2 ms, 2 threads, cold), with these loads 2.1 ms
 * (hybridrt bench attention; docs/long_context.md) */
static inline void touch_rows(const char *kc, const char *vc, const int64_t *tab, int64_t BS,
                              int64_t row, int64_t off, int64_t pos, int64_t end, int64_t hw)
{
    pos += PF;
    if (pos >= end) return;
    const int64_t at = (tab[pos / BS] * BS + pos % BS) * row + off;
    int t = 0;
    for (int64_t i = 0; i < hw; i += 64)
        t += ((const volatile char *)kc)[at + i] + ((const volatile char *)vc)[at + i];
    (void)t;
}

/* out[t] = the sum of v[t]'s 16 lanes, t < n (<= 16): halves added down to 4 lanes, then
 * pairs of vectors through hadd */
static inline void hsum16(const __m512 *v, int64_t n, float *out)
{
    __m128 x[16];
    for (int64_t t = 0; t < n; ++t) {
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v[t]),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                           _mm512_castps_pd(v[t]), 1)));
        x[t] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
    int64_t t = 0;
    for (; t + 4 <= n; t += 4)
        _mm_storeu_ps(out + t, _mm_hadd_ps(_mm_hadd_ps(x[t], x[t + 1]),
                                           _mm_hadd_ps(x[t + 2], x[t + 3])));
    for (; t < n; ++t) {
        const __m128 h = _mm_hadd_ps(x[t], x[t]);
        out[t] = _mm_cvtss_f32(_mm_hadd_ps(h, h));
    }
}

/* acc of head g (at acc + aoff[g]) += w[g][j] (rows of PB) v_j over the np rows vp, for the
 * CW 16-lane chunks from i0: GQ x CW accumulators in registers, each chunk of v_j widened once
 * (kv_ld16) for the GQ heads; per lane the fma's in position order */
static inline __attribute__((always_inline)) void v_accum(
    const float *w, const char *const *vp, int64_t np, int64_t i0, const int64_t CW,
    const int64_t GQ, int64_t D, int64_t G, int bf, int kvq, float *acc, const int64_t *aoff)
{
    __m512 r[16];
    for (int64_t g = 0; g < GQ; ++g)
        for (int64_t c = 0; c < CW; ++c)
            r[g * CW + c] = _mm512_loadu_ps(acc + aoff[g] + i0 + 16 * c);
    for (int64_t j = 0; j < np; ++j) {
        __m512 x[16];
        for (int64_t c = 0; c < CW; ++c) x[c] = kv_ld16(vp[j], i0 + 16 * c, D, G, bf, kvq);
        for (int64_t g = 0; g < GQ; ++g) {
            const __m512 wv = _mm512_set1_ps(w[g * PB + j]);
            for (int64_t c = 0; c < CW; ++c)
                r[g * CW + c] = _mm512_fmadd_ps(wv, x[c], r[g * CW + c]);
        }
    }
    for (int64_t g = 0; g < GQ; ++g)
        for (int64_t c = 0; c < CW; ++c)
            _mm512_storeu_ps(acc + aoff[g] + i0 + 16 * c, r[g * CW + c]);
}

/* One partition [pbeg, pend) for the NH KV heads from off0 and GQ (<= GQ_MAX) query heads each:
 * q0 [NH GQ, D] (normed, rotated), the acc of KV head hk's query head g at acc0 + hk khs +
 * aoff[g] ([D], zeroed by the caller), m0, l0 [NH GQ]. The GQ heads are one row's heads of a KV
 * head or, for verification rows of one sequence sharing the partition, several rows' heads.
 * Block by block of PB positions, head after
 * head, so that a block's rows (all heads) are read while they are near: the scores of PJ
 * positions for all GQ heads at once (PJ GQ accumulators in registers, each K load widened once
 * in registers, each query chunk loaded once for the PJ positions); exp16 gives the weights of
 * 16 positions at once; the sums l add them in position order; then v_accum adds the block's V
 * rows into the heads' acc (acc[i] = fma(w_j, v_j[i], acc[i]) in position order). far: the
 * rows PF positions ahead are read early (touch_rows). A head's arithmetic depends on neither
 * NH nor far. */
static inline __attribute__((always_inline)) void partition16(
    const float *q0, const char *kc, const char *vc, const int64_t *tab, int64_t BS, int64_t row,
    int64_t off0, int64_t NH, int64_t pbeg, int64_t pend, int64_t D, int64_t G, int bf, int kvq,
    float scale, const int64_t GQ, float *acc0, int64_t khs, const int64_t *aoff, float *m0,
    float *l0, int64_t hw, int far)
{
    float s[GQ_MAX][PB];
    for (int64_t pos = pbeg - PF; far && pos < pbeg; ++pos)  /* the first PF rows */
        touch_rows(kc, vc, tab, BS, row, off0, pos, pend, NH * hw);
    for (int64_t p0 = pbeg; p0 < pend; p0 += PB) {
        const int64_t np = pend - p0 < PB ? pend - p0 : PB;
        for (int64_t hk = 0; hk < NH; ++hk) {
            const float *q = q0 + hk * GQ * D;
            float *acc = acc0 + hk * khs, *m = m0 + hk * GQ, *l = l0 + hk * GQ;
            const int64_t off = off0 + hk * hw;
            /* PJ positions at a time: PJ x GQ accumulators (16 where GQ divides 16) in registers,
             * each query chunk loaded once for the PJ positions; a position past the block
             * re-reads the block's first row and is dropped */
            const int64_t PJ = GQ <= 16 ? 16 / GQ : 1;
            for (int64_t j0 = 0; j0 < np; j0 += PJ) {
                const char *kp[16];
                for (int64_t jj = 0; jj < PJ; ++jj) {
                    const int64_t pos = p0 + (j0 + jj < np ? j0 + jj : 0);
                    kp[jj] = kc + (tab[pos / BS] * BS + pos % BS) * row + off;
                    if (far && hk == 0 && j0 + jj < np)
                        touch_rows(kc, vc, tab, BS, row, off0, pos, pend, NH * hw);
                }
                __m512 d[16];
                for (int64_t t = 0; t < PJ * GQ; ++t) d[t] = _mm512_setzero_ps();
                for (int64_t i = 0; i < D; i += 16) {
                    __m512 qv[GQ_MAX];
                    for (int64_t g = 0; g < GQ; ++g) qv[g] = _mm512_loadu_ps(q + g * D + i);
                    for (int64_t jj = 0; jj < PJ; ++jj) {
                        const __m512 k = kv_ld16(kp[jj], i, D, G, bf, kvq);
                        for (int64_t g = 0; g < GQ; ++g)
                            d[jj * GQ + g] = _mm512_fmadd_ps(qv[g], k, d[jj * GQ + g]);
                    }
                }
                float sum[16];
                hsum16(d, PJ * GQ, sum);
                for (int64_t jj = 0; jj < PJ && j0 + jj < np; ++jj)
                    for (int64_t g = 0; g < GQ; ++g) s[g][j0 + jj] = sum[jj * GQ + g] * scale;
            }
            for (int64_t g = 0; g < GQ; ++g) {
                __m512 bm16 = _mm512_set1_ps(-INFINITY);  /* the max: exact in any order */
                for (int64_t j = 0; j < np; j += 16) {
                    const __mmask16 mk = np - j >= 16 ? 0xFFFF : (__mmask16)((1u << (np - j)) - 1);
                    bm16 = _mm512_mask_max_ps(bm16, mk, bm16, _mm512_maskz_loadu_ps(mk, s[g] + j));
                }
                const float bm = _mm512_reduce_max_ps(bm16);
                if (bm > m[g]) {  /* rescale what was summed under the old maximum */
                    const float cf = expf(m[g] - bm);
                    const __m512 c = _mm512_set1_ps(cf);
                    float *a = acc + aoff[g];
                    for (int64_t i = 0; i < D; i += 16)
                        _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_loadu_ps(a + i), c));
                    l[g] *= cf;
                    m[g] = bm;
                }
                for (int64_t j = 0; j < np; j += 16) {
                    const __mmask16 mk = np - j >= 16 ? 0xFFFF : (__mmask16)((1u << (np - j)) - 1);
                    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s[g] + j),
                                                   _mm512_set1_ps(m[g]));
                    _mm512_mask_storeu_ps(s[g] + j, mk, exp16(x));
                }
            }
            /* the sums in position order, the heads' chains side by side */
            for (int64_t j = 0; j < np; ++j)
                for (int64_t g = 0; g < GQ; ++g) l[g] += s[g][j];
            const char *vp[PB];
            for (int64_t j = 0; j < np; ++j) {
                const int64_t pos = p0 + j;
                vp[j] = vc + (tab[pos / BS] * BS + pos % BS) * row + off;
            }
            /* acc[g] += w_j v_j in position order, CW 16-lane chunks of all GQ heads in
             * registers at a time, each V chunk widened once in registers for the GQ heads */
            const int64_t CW = GQ <= 16 ? 16 / GQ : 1;
            int64_t i0 = 0;
            for (; i0 + 16 * CW <= D; i0 += 16 * CW)
                v_accum(&s[0][0], vp, np, i0, CW, GQ, D, G, bf, kvq, acc, aoff);
            for (; i0 < D; i0 += 16)
                v_accum(&s[0][0], vp, np, i0, 1, GQ, D, G, bf, kvq, acc, aoff);
        }
    }
}

/* partition16 with GQ a constant (1, 2, 4, 8, 12 or 16) where it is one, so that the heads'
 * score accumulators stay in registers */
static void partition16_any(const float *q, const char *kc, const char *vc, const int64_t *tab,
                            int64_t BS, int64_t row, int64_t off, int64_t NH, int64_t pbeg,
                            int64_t pend, int64_t D, int64_t G, int bf, int kvq, float scale,
                            int64_t GQ, float *acc, int64_t khs, const int64_t *aoff,
                            float *m, float *l, int64_t hw, int far)
{
#define PART(n) partition16(q, kc, vc, tab, BS, row, off, NH, pbeg, pend, D, G, bf, kvq, scale, \
                            n, acc, khs, aoff, m, l, hw, far)
    switch (GQ) {
    case 1: PART(1); break;
    case 2: PART(2); break;
    case 4: PART(4); break;
    case 8: PART(8); break;
    case 12: PART(12); break;
    case 16: PART(16); break;
    default: PART(GQ);
    }
#undef PART
}

/* A full partition p of cnt verification rows of one sequence (from the pass's row r, rows
 * sharing all its positions), scored at once for their query heads of the NH KV heads from
 * hk0: each K and V row read and widened once for all of them. Each head's arithmetic is the
 * one partition16 gives it alone (per head, in the same order), so a row's bytes are the ones
 * it gets as a decode row. Partials as attn_decode's step 3 keeps them. */
static void joint(const float *qs, float *parts, int64_t r, int64_t cnt, int64_t hk0,
                  int64_t NH, int64_t p, int64_t NP, int64_t PW, int64_t H, int64_t GQ,
                  int64_t D, const char *kc, const char *vc, const int64_t *tab, int64_t BS,
                  int64_t row, int64_t hw, int64_t pbeg, int64_t G, int bf, int kvq,
                  float scale, int far)
{
    const int64_t J = cnt * GQ;  /* heads scored together per KV head */
    float q[NH * J * D], m[NH * J], l[NH * J], *pp[NH * J];  /* pp: each head's partial */
    int64_t aoff[GQ_MAX];
    for (int64_t j = 0; j < J; ++j) aoff[j] = ((j / GQ) * H + j % GQ) * NP * PW;
    for (int64_t hk = 0; hk < NH; ++hk)
        for (int64_t j = 0; j < J; ++j) {
            const int64_t h = (r + j / GQ) * H + (hk0 + hk) * GQ + j % GQ, t = hk * J + j;
            memcpy(q + t * D, qs + h * D, sizeof(float) * (size_t)D);
            pp[t] = parts + (h * NP + p) * PW;
            memset(pp[t] + 2, 0, sizeof(float) * (size_t)D);
            m[t] = -INFINITY;
            l[t] = 0.0f;
        }
    float *acc0 = parts + ((r * H + hk0 * GQ) * NP + p) * PW + 2;
    partition16_any(q, kc, vc, tab, BS, row, hk0 * hw, NH, pbeg, pbeg + SPLIT, D, G, bf, kvq,
                    scale, J, acc0, GQ * NP * PW, aoff, m, l, hw, far);
    for (int64_t t = 0; t < NH * J; ++t) {
        pp[t][0] = m[t];
        pp[t][1] = l[t];
    }
}
#endif

int attn_decode(const void *qg, int64_t ld_qg, const void *k, int64_t ld_k, const void *v,
                int64_t ld_v, const void *q_w, const void *k_w, float eps, const void *cos,
                const void *sin, int64_t R, void *k_cache, void *v_cache,
                const int64_t *slot_mapping, const int64_t *tables, int64_t M,
                const int64_t *ctx_lens, int64_t BS, float scale, void *out, int64_t B,
                int64_t L, int64_t H, int64_t HKV, int64_t D, int bf, int kvq, int simd,
                int num_threads)
{
    /* the vector loops take a head 16 (AVX-512) or 8 (AVX2) dims a step */
    simd = simd < SIMD_MAX ? simd : SIMD_MAX;
    if (simd == 2 && D % 16) simd = 1;
    if (simd == 1 && D % 8) simd = 0;
    /* a slot's and a head's bytes in the caches */
    const int64_t G = kv_group(D), W = kvq ? D + 4 * (D / G) : D, es = kvq ? 1 : bf ? 2 : 4;
    const int64_t row = HKV * W * es, hw = W * es, GQ = H / HKV, N = B * L;
    if (N == 0) return 0;
    /* partitions of the longest row; rows per pass so that their partials fit the scratch */
    int64_t most = 0;
    for (int64_t b = 0; b < B; ++b) most = ctx_lens[b] > most ? ctx_lens[b] : most;
    const int64_t NP = (most + SPLIT - 1) / SPLIT, PW = D + 2;
    int64_t RP = SCRATCH_FLOATS / (H * (NP * PW + D));
    RP = RP < 1 ? 1 : RP > N ? N : RP;
    float *scratch = malloc(sizeof(float) * (size_t)(RP * H * (NP * PW + D)));
    if (!scratch) return -1;
    float *qs = scratch, *parts = scratch + RP * H * D;  /* [RP, H, D], [RP, H, NP, PW] */
    #pragma omp parallel num_threads(num_threads)
    {
        /* 1. the new tokens' k (normed, rotated) and v into their KV slots */
        #pragma omp for schedule(static)
        for (int64_t th = 0; th < N * HKV; ++th) {
            const int64_t r = th / HKV, h = th % HKV, slot = slot_mapping[r];
            float kk[D];
            norm_rope(k, r * ld_k + h * D, k_w, eps, cos, sin, r, R, D, bf, kk);
            char *kd = (char *)k_cache + slot * row + h * hw;
            char *vd = (char *)v_cache + slot * row + h * hw;
            if (kvq) {
                float vv[D];
                for (int64_t i = 0; i < D; ++i) vv[i] = act_ld(v, r * ld_v + h * D + i, bf);
                kv_quant(kk, D, kd);
                kv_quant(vv, D, vd);
            } else for (int64_t i = 0; i < D; ++i) {
                act_st(kd, i, kk[i], bf);
                act_st(vd, i, act_ld(v, r * ld_v + h * D + i, bf), bf);
            }
        }
        for (int64_t r0 = 0; r0 < N; r0 += RP) {
            const int64_t nr = N - r0 < RP ? N - r0 : RP;
            /* 2. the queries, normed and rotated */
            #pragma omp for schedule(static)
            for (int64_t th = 0; th < nr * H; ++th) {
                const int64_t r = r0 + th / H, h = th % H;
                norm_rope(qg, r * ld_qg + h * 2 * D, q_w, eps, cos, sin, r, R, D, bf,
                          qs + th * D);
            }
            /* 3. per (row, NH KV heads, partition): the partials of their query heads; all of
             * a row's KV heads in one task (each cache row read whole, in order) where the
             * rows' partitions alone keep the threads busy */
            const int64_t NH = nr * NP >= 4 * num_threads ? HKV : 1, NG = HKV / NH;
#if defined(__AVX512F__)
            /* verification rows of a sequence scored together, RG at a time (AVX-512) */
            const int64_t RG = simd == 2 && L > 1 && 2 * GQ <= GQ_MAX
                               ? (L < GQ_MAX / GQ ? L : GQ_MAX / GQ) : 1;
#endif
            #pragma omp for schedule(dynamic)
            for (int64_t th = 0; th < nr * NG * NP; ++th) {
                const int64_t r = r0 + th / (NG * NP), hk0 = th / NP % NG * NH, p = th % NP;
                const int64_t b = r / L, n = ctx_lens[b] - L + r % L + 1;
                const int64_t pbeg = p * SPLIT, pend = n < pbeg + SPLIT ? n : pbeg + SPLIT;
                if (pbeg >= n) continue;
                const int64_t h00 = (r - r0) * H + hk0 * GQ;  /* the task's first (row, head) */
#if defined(__AVX512F__)
                if (RG > 1) {
                    /* a full partition of a group's first row is full for all its rows: the
                     * group's first row scores it for all of them, the others skip it */
                    const int64_t t = r % L, gbeg = r - t % RG, last = (b + 1) * L;
                    const int64_t gend = gbeg + RG < last ? gbeg + RG : last;
                    const int64_t lead = gbeg > r0 ? gbeg : r0;
                    const int64_t cnt = (gend < r0 + nr ? gend : r0 + nr) - lead;
                    if (cnt > 1 && pbeg + SPLIT <= ctx_lens[b] - L + lead % L + 1) {
                        if (lead != r) continue;
                        joint(qs, parts, r - r0, cnt, hk0, NH, p, NP, PW, H, GQ, D,
                              (const char *)k_cache, (const char *)v_cache, tables + b * M, BS,
                              row, hw, pbeg, G, bf, kvq, scale, n >= FAR);
                        continue;
                    }
                }
#endif
                float s[GQ][PB], mm[NH * GQ], ll[NH * GQ], x[D];
                for (int64_t g = 0; g < NH * GQ; ++g) {
                    float *acc = parts + ((h00 + g) * NP + p) * PW + 2;
                    for (int64_t i = 0; i < D; ++i) acc[i] = 0.0f;
                    mm[g] = -INFINITY;
                    ll[g] = 0.0f;
                }
#if defined(__AVX512F__)
                if (simd == 2 && GQ <= GQ_MAX) {
                    int64_t aoff[GQ_MAX];
                    for (int64_t g = 0; g < GQ; ++g) aoff[g] = g * NP * PW;
                    partition16_any(qs + h00 * D, (const char *)k_cache, (const char *)v_cache,
                                    tables + b * M, BS, row, hk0 * hw, NH, pbeg, pend, D, G, bf,
                                    kvq, scale, GQ, parts + (h00 * NP + p) * PW + 2,
                                    GQ * NP * PW, aoff, mm, ll, hw, n >= FAR);
                } else
#endif
                for (int64_t hk = hk0; hk < hk0 + NH; ++hk) {
                    const int64_t h0 = h00 + (hk - hk0) * GQ;
                    float *m = mm + (hk - hk0) * GQ, *l = ll + (hk - hk0) * GQ;
                    for (int64_t p0 = pbeg; p0 < pend; p0 += PB) {
                        const int64_t np = pend - p0 < PB ? pend - p0 : PB;
                        for (int64_t j = 0; j < np; ++j) {
                            const int64_t pos = p0 + j;
                            const int64_t slot = tables[b * M + pos / BS] * BS + pos % BS;
                            widen_row((const char *)k_cache + slot * row + hk * hw, D, G, bf,
                                      kvq, x);
                            for (int64_t g = 0; g < GQ; ++g)
                                s[g][j] = k_dot(qs + (h0 + g) * D, (const char *)x, D, G, 0, 0,
                                                simd) * scale;
                        }
                        for (int64_t g = 0; g < GQ; ++g) {
                            float bm = -INFINITY;
                            for (int64_t j = 0; j < np; ++j) bm = s[g][j] > bm ? s[g][j] : bm;
                            if (bm > m[g]) {  /* rescale what was summed under the old maximum */
                                float *acc = parts + ((h0 + g) * NP + p) * PW + 2;
                                const float c = expf(m[g] - bm);
                                for (int64_t i = 0; i < D; ++i) acc[i] *= c;
                                l[g] *= c;
                                m[g] = bm;
                            }
                        }
                        for (int64_t j = 0; j < np; ++j) {
                            const int64_t pos = p0 + j;
                            const int64_t slot = tables[b * M + pos / BS] * BS + pos % BS;
                            widen_row((const char *)v_cache + slot * row + hk * hw, D, G, bf,
                                      kvq, x);
                            for (int64_t g = 0; g < GQ; ++g) {
                                const float w = expf(s[g][j] - m[g]);
                                l[g] += w;
                                v_axpy(w, (const char *)x, D, G, 0, 0, simd,
                                       parts + ((h0 + g) * NP + p) * PW + 2);
                            }
                        }
                    }
                }
                for (int64_t g = 0; g < NH * GQ; ++g) {
                    parts[((h00 + g) * NP + p) * PW] = mm[g];
                    parts[((h00 + g) * NP + p) * PW + 1] = ll[g];
                }
            }
            /* 4. per (row, query head): its partials merged in partition order, then the gate */
            #pragma omp for schedule(static)
            for (int64_t th = 0; th < nr * H; ++th) {
                const int64_t r = r0 + th / H, h = th % H, b = r / L;
                const int64_t n = ctx_lens[b] - L + r % L + 1, np = (n + SPLIT - 1) / SPLIT;
                const float *pp = parts + th * NP * PW;
                float mx = -INFINITY;
                for (int64_t p = 0; p < np; ++p) mx = pp[p * PW] > mx ? pp[p * PW] : mx;
                float acc[D], l = 0.0f;
                for (int64_t p = 0; p < np; ++p) {
                    const float c = expf(pp[p * PW] - mx), *a = pp + p * PW + 2;
                    if (p == 0) {
                        l = pp[1] * c;
                        for (int64_t i = 0; i < D; ++i) acc[i] = a[i] * c;
                    } else {
                        l += pp[p * PW + 1] * c;
                        for (int64_t i = 0; i < D; ++i) acc[i] += a[i] * c;
                    }
                }
                const int64_t g0 = r * ld_qg + h * 2 * D + D;
                int64_t i0 = 0;
#if defined(__AVX512F__)
                for (; simd == 2 && i0 < D; i0 += 16) {
                    const __m512 o = act_round16(_mm512_div_ps(_mm512_loadu_ps(acc + i0),
                                                               _mm512_set1_ps(l)), bf);
                    const __m512 x = act_ld16(qg, g0 + i0, bf, 0xFFFF);
                    const __m512 g = act_round16(_mm512_div_ps(_mm512_set1_ps(1.0f),
                        _mm512_add_ps(_mm512_set1_ps(1.0f),
                                      exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))), bf);
                    act_st16(out, r * H * D + h * D + i0, _mm512_mul_ps(o, g), bf, 0xFFFF);
                }
#endif
#if SIMD_MAX >= 1
                for (; simd == 1 && i0 < D; i0 += 8) {
                    const __m256 o = act_round8(_mm256_div_ps(_mm256_loadu_ps(acc + i0),
                                                              _mm256_set1_ps(l)), bf);
                    const __m256 x = act_ld8(qg, g0 + i0, bf);
                    const __m256 g = act_round8(_mm256_div_ps(_mm256_set1_ps(1.0f),
                        _mm256_add_ps(_mm256_set1_ps(1.0f),
                                      exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)))), bf);
                    act_st8(out, r * H * D + h * D + i0, _mm256_mul_ps(o, g), bf);
                }
#endif
                for (int64_t i = i0; i < D; ++i) {
                    const float o = act_round(acc[i] / l, bf);
                    const float g = act_round(1.0f / (1.0f + expf(-act_ld(qg, g0 + i, bf))), bf);
                    act_st(out, r * H * D + h * D + i, o * g, bf);
                }
            }
        }
    }
    free(scratch);
    return 0;
}
