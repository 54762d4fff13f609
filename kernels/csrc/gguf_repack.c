/* GGUF quantized blocks -> hybridrt's int8 / int4 / int6 panel formats (csrc/int8_gemm.c and
 * csrc/int4_gemm.c describe them), in one pass over the file's mapped bytes: the same numbers as
 * the torch code of hybridrt/gguf/blocks.py and tensors.py (which the tests hold it to, byte for
 * byte), here in C because that code makes a dozen passes over every weight (seconds at the
 * 0.8B shape, where llama.cpp starts in one).
 *
 * Types (GGML ids): Q8_0 (8) -> int8, its values and fp16 scales moved; Q4_0 (2), Q4_1 (3),
 * Q4_K (12) -> int4, the 4-bit values kept, each group's step and minimum (a negative step
 * counted from the top) as 8-bit codes of bf16 superblock scales; Q6_K (14) -> int6, each group
 * on the grid of its half with the larger scale, the other half rounded once onto it.
 * ``rows`` (NULL: in order) gives each output row's source row, ``groups`` (NULL: in order) each
 * output group's source group of 32 inputs (the converter's value-head reordering undone).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define NR 16
#define QK 32
#define SBG 8
#define CODES 255.0f

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

static float f16_to_f32(const uint8_t *p)
{
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } c;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    c.u = sign | (exp == 31 ? 0x7f800000u | man << 13 : (exp + 112) << 23 | man << 13);
    return c.f;
}

/* 32 bytes holding values k (low nibble) and k + 32 (high) of 64 -> the groups of 32 in nibble
 * order (byte k: value k low, k + 16 high): ``hi`` 0 the first group, 1 the second */
static void split_pairs(const uint8_t *x, int hi, uint8_t *nib)
{
    for (int k = 0; k < 16; ++k) {
        uint8_t a = x[k], b = x[k + 16];
        nib[k] = hi ? (uint8_t)((a >> 4) | (b & 0xf0)) : (uint8_t)((a & 0x0f) | (b << 4));
    }
}

/* Group ``g`` of a 4-bit row -> nib [16], *step >= 0, *minimum (W = step q - minimum) */
static void nibble_group(const uint8_t *row, int type, int64_t g, uint8_t *nib, float *step,
                         float *minimum)
{
    float d, m;
    if (type == T_Q4_0) {
        const uint8_t *b = row + g * 18;
        d = f16_to_f32(b);
        m = 8.0f * d;
        memcpy(nib, b + 2, 16);
    } else if (type == T_Q4_1) {
        const uint8_t *b = row + g * 20;
        d = f16_to_f32(b);
        m = -f16_to_f32(b + 2);
        memcpy(nib, b + 4, 16);
    } else {  /* Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of values */
        const uint8_t *b = row + (g / SBG) * 144, *s = b + 4;
        int j = (int)(g % SBG), sc, mn;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
            mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        }
        d = f16_to_f32(b) * (float)sc;
        m = f16_to_f32(b + 2) * (float)mn;
        split_pairs(b + 16 + (j / 2) * 32, j % 2, nib);
    }
    if (d < 0) {  /* the same values as step -d, q' = 15 - q, minimum m - 15 d */
        float t = 15.0f * d;
        m = m - t;
        d = -d;
        for (int k = 0; k < 16; ++k) nib[k] ^= 0xff;
    }
    *step = d + 0.0f;
    *minimum = m + 0.0f;
}

/* Group ``g`` of a Q6_K row -> q [32] in [0, 63], *step >= 0, *minimum */
static void six_bit_group(const uint8_t *row, int64_t g, uint8_t *q, float *step, float *minimum)
{
    const uint8_t *b = row + (g / SBG) * 210;
    int j = (int)(g % SBG), half = j / 4, r = j % 4;
    const uint8_t *ql = b + 64 * half + 32 * (r % 2), *qh = b + 128 + 32 * half;
    const int8_t *sc = (const int8_t *)(b + 192) + 2 * j;
    float d = f16_to_f32(b + 208);
    int s[2] = { sc[0], sc[1] };
    if (d < 0) {
        s[0] = -s[0];
        s[1] = -s[1];
        d = -d;
    }
    int big = abs(s[1]) > abs(s[0]), sb = s[big];
    int scale = abs(sb) > 0 ? abs(sb) : 1, offset = sb < 0 ? 31 : 32;
    int shift = r < 2 ? 0 : 4;
    for (int k = 0; k < 32; ++k)
        q[k] = (uint8_t)(((ql[k] >> shift) & 15) | ((qh[k] >> (2 * r)) & 3) << 4);
    /* the half that gives the scale keeps its values (q, or 63 - q for a negative scale); a
     * group of scale 0 is all 32 (its value 0, as the torch path writes it) */
    if (sb == 0) memset(q, 32, 32);
    else if (sb < 0)
        for (int k = 16 * big; k < 16 * big + 16; ++k) q[k] = (uint8_t)(63 - q[k]);
    float so = (float)s[1 - big], fs = (float)scale;
    for (int k = 16 * (1 - big); k < 16 * (1 - big) + 16; ++k) {
        int qq = (int)nearbyintf((float)(q[k] - 32) * so / fs) + offset;
        q[k] = (uint8_t)(qq < 0 ? 0 : qq > 63 ? 63 : qq);
    }
    *step = d * (float)abs(sb);
    *minimum = (float)offset * *step;
}

/* tensors.py's _superblock_scale: the bf16 scale whose 8-bit codes reach vmax */
static uint16_t superblock_scale(float vmax)
{
    uint16_t s = f32_to_bf16(vmax / CODES);
    if (bf16_to_f32(s) * CODES < vmax) s = (uint16_t)(s + 1);
    return s;
}

/* tensors.py's _codes */
static uint8_t code(float v, float scale)
{
    float c = scale > 0 ? nearbyintf(v / scale) : 0.0f;
    c = c < 0 ? 0 : c > CODES ? CODES : c;
    if (v > 0 && c == 0) c = 1;
    return (uint8_t)c;
}

static void q8_0_panel(const uint8_t *src, int64_t row_bytes, int64_t N, int64_t G, int64_t p,
                       const int64_t *rows, const int64_t *groups, int8_t *qs, uint16_t *scales,
                       int *bad)
{
    for (int64_t g = 0; g < G; ++g) {
        int8_t *out = qs + (p * G + g) * 8 * NR * 4;  /* [8, 16, 4] */
        uint16_t *sc = scales + (p * G + g) * NR;
        for (int c = 0; c < NR; ++c) {
            int64_t n = p * NR + c;
            if (n >= N) {
                sc[c] = 0;
                for (int k4 = 0; k4 < 8; ++k4) memset(out + (k4 * NR + c) * 4, 0, 4);
                continue;
            }
            const uint8_t *b = src + (rows ? rows[n] : n) * row_bytes
                               + (groups ? groups[g] : g) * 34;
            sc[c] = (uint16_t)(b[0] | b[1] << 8);
            for (int k4 = 0; k4 < 8; ++k4) {
                memcpy(out + (k4 * NR + c) * 4, b + 2 + 4 * k4, 4);
                for (int j = 0; j < 4; ++j) *bad |= (int8_t)b[2 + 4 * k4 + j] == -128;
            }
        }
    }
}

static void bit_panel(const uint8_t *src, int64_t row_bytes, int type, int64_t N, int64_t G,
                      int64_t p, const int64_t *rows, const int64_t *groups, uint8_t *qs,
                      uint8_t *hs, uint8_t *codes, uint16_t *scales, int *negative)
{
    const int64_t S = (G + SBG - 1) / SBG;
    uint8_t vals[NR][SBG][QK];
    float step[NR][SBG], mn[NR][SBG];
    for (int64_t s = 0; s < S; ++s) {
        int ng = (int)(G - s * SBG < SBG ? G - s * SBG : SBG);
        for (int c = 0; c < NR; ++c) {
            int64_t n = p * NR + c;
            const uint8_t *row = n < N ? src + (rows ? rows[n] : n) * row_bytes : NULL;
            float dmax = 0.0f, mmax = 0.0f;
            for (int i = 0; i < ng; ++i) {
                int64_t g = s * SBG + i, from = groups ? groups[g] : g;
                if (!row) {
                    memset(vals[c][i], 0, QK);
                    step[c][i] = mn[c][i] = 0.0f;
                } else if (type == T_Q6_K) {
                    six_bit_group(row, from, vals[c][i], &step[c][i], &mn[c][i]);
                } else {
                    nibble_group(row, type, from, vals[c][i], &step[c][i], &mn[c][i]);
                }
                if (mn[c][i] < 0) *negative = 1;
                if (step[c][i] > dmax) dmax = step[c][i];
                if (mn[c][i] > mmax) mmax = mn[c][i];
            }
            uint16_t D = superblock_scale(dmax), M = superblock_scale(mmax);
            uint16_t *sc = scales + (p * S + s) * 2 * NR;  /* [2, 16] */
            sc[c] = D;
            sc[NR + c] = M;
            for (int i = 0; i < ng; ++i) {
                int64_t g = s * SBG + i;
                uint8_t *cd = codes + (p * G + g) * 2 * NR;
                cd[c] = code(step[c][i], bf16_to_f32(D));
                cd[NR + c] = code(mn[c][i], bf16_to_f32(M));
            }
        }
        for (int i = 0; i < ng; ++i) {
            int64_t g = s * SBG + i;
            uint8_t *out = qs + (p * G + g) * 4 * 4 * NR;  /* [4, 64] */
            for (int c = 0; c < NR; ++c) {
                const uint8_t *v = vals[c][i];
                if (type != T_Q6_K) {
                    for (int r = 0; r < 4; ++r) memcpy(out + r * 4 * NR + 4 * c, v + 4 * r, 4);
                    continue;
                }
                for (int r = 0; r < 4; ++r)
                    for (int j = 0; j < 4; ++j) {
                        int k = 4 * r + j;
                        out[r * 4 * NR + 4 * c + j] =
                            (uint8_t)((v[k] & 15) | (v[k + 16] & 15) << 4);
                    }
                uint8_t *h = hs + (p * G + g) * 2 * 4 * NR;  /* [2, 64] */
                for (int hh = 0; hh < 2; ++hh)
                    for (int j = 0; j < 4; ++j) {
                        uint8_t byte = 0;
                        for (int r = 0; r < 4; ++r)
                            byte |= (uint8_t)((v[16 * hh + 4 * r + j] >> 4) << (2 * r));
                        h[hh * 4 * NR + 4 * c + j] = byte;
                    }
            }
        }
    }
}

/* A GGUF tensor of ``type`` ([N, K], K a multiple of its block; ``row_bytes`` a row) -> the
 * packed tensors (hs NULL but for Q6_K; ``codes`` unused for Q8_0, whose fp16 scales go to
 * ``scales``). Returns 0; 1 when a Q8_0 value is -128 (outside the int8 kernels' range); 2 when
 * a group's minimum is negative (not in the int4 format: the caller quantizes again); -1 for a
 * type this does not take. */
int gguf_repack(const uint8_t *src, int64_t row_bytes, int type, int64_t N, int64_t K,
                const int64_t *rows, const int64_t *groups, uint8_t *qs, uint8_t *hs,
                uint8_t *codes, uint16_t *scales, int num_threads)
{
    if (type != T_Q8_0 && type != T_Q4_0 && type != T_Q4_1 && type != T_Q4_K && type != T_Q6_K)
        return -1;
    const int64_t P = (N + NR - 1) / NR, G = K / QK;
    int bad = 0, negative = 0;
    if (num_threads > P) num_threads = (int)P;
    if (num_threads < 1) num_threads = 1;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 16) \
        reduction(|:bad, negative)
    for (int64_t p = 0; p < P; ++p) {
        if (type == T_Q8_0)
            q8_0_panel(src, row_bytes, N, G, p, rows, groups, (int8_t *)qs, scales, &bad);
        else
            bit_panel(src, row_bytes, type, N, G, p, rows, groups, qs, hs, codes, scales,
                      &negative);
    }
    return bad ? 1 : negative ? 2 : 0;
}
