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

#endif
