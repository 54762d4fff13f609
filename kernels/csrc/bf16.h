/* bf16 <-> fp32 for the C kernels, and loads and stores of activations that are either fp32 or
 * bf16 (``bf``): rounding to nearest even, NaN kept a NaN, as torch's .to(torch.bfloat16). */
#ifndef HYBRIDRT_BF16_H
#define HYBRIDRT_BF16_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } c = { .u = (uint32_t)h << 16 };
    return c.f;
}

static inline uint16_t f32_to_bf16(float f)
{
    union { float f; uint32_t u; } c = { .f = f };
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* p[i] as fp32, p holding bf16 (bf) or fp32 values */
static inline float act_ld(const void *p, int64_t i, int bf)
{
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void act_st(void *p, int64_t i, float v, int bf)
{
    if (bf) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* v as the activations' dtype holds it: rounded to bf16, or unchanged */
static inline float act_round(float v, int bf) { return bf ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* 8 lanes at a time (AVX2), whole vectors only: the same conversions and roundings */
static inline __m256 act_ld8(const void *p, int64_t i, int bf)
{
    if (bf)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

static inline __m256i round_bf16_bits8(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    const __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_and_si256(_mm256_blendv_epi8(r, nan, isnan),
                            _mm256_set1_epi32((int)0xffff0000u));
}

static inline __m256 act_round8(__m256 v, int bf)
{
    return bf ? _mm256_castsi256_ps(round_bf16_bits8(v)) : v;
}

static inline void act_st8(void *p, int64_t i, __m256 v, int bf)
{
    if (bf) {
        const __m256i h = _mm256_srli_epi32(round_bf16_bits8(v), 16);  /* 8 x 16 bits, zero-extended */
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h),
                                                _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
    } else {
        _mm256_storeu_ps((float *)p + i, v);
    }
}

/* e^x as exp16 below computes it, 2^n applied in two halves through the exponent bits (each
 * a normal number), so that overflow to inf and subnormal results come out as there */
static inline __m256 exp8(__m256 x)
{
    const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(89.0f)),
                                    _mm256_set1_ps(-104.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1), bias = _mm256_set1_epi32(127);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)));
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

static inline __m256 silu8(__m256 x)
{
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(
        _mm256_setzero_ps(), x))));
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The widest vector loops the fused kernels (gdn_fused.c, attn_decode.c) have in this build:
 * 2 AVX-512, 1 AVX2, 0 none; a call's ``simd`` (the caller's choice) is capped at it. */
#if defined(__AVX512F__)
#define SIMD_MAX 2
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_MAX 1
#else
#define SIMD_MAX 0
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 lanes at a time (AVX-512): the same conversions and roundings as above; m masks the lanes
 * a load or store touches (the tail of a row). */
static inline __m512 act_ld16(const void *p, int64_t i, int bf, __mmask16 m)
{
    if (bf)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* v rounded to bf16 (nearest even, NaN kept a NaN), as fp32 bits */
static inline __m512i round_bf16_bits16(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
    const __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_and_si512(_mm512_mask_mov_epi32(r, isnan, nan),
                            _mm512_set1_epi32((int)0xffff0000u));
}

static inline __m512 act_round16(__m512 v, int bf)
{
    return bf ? _mm512_castsi512_ps(round_bf16_bits16(v)) : v;
}

static inline void act_st16(void *p, int64_t i, __m512 v, int bf, __mmask16 m)
{
    if (bf)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(
            _mm512_srli_epi32(round_bf16_bits16(v), 16)));
    else
        _mm512_mask_storeu_ps((float *)p + i, m, v);
}

/* e^x to about an ulp of expf (Cephes' expf polynomial on x - n ln 2, scaled by 2^n with
 * vscalefps: inf above ~88.7, 0 below ~-103.9, NaN kept) */
static inline __m512 exp16(__m512 x)
{
    const __m512 xc = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)),
                                    _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512 e = _mm512_scalef_ps(y, n);
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

static inline __m512 silu16(__m512 x)
{
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(
        _mm512_setzero_ps(), x))));
}
#endif

#endif
