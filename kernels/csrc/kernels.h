/* The entry points csrc/step.c calls, declared once: each defining file includes this too, so
 * that the compiler holds the definitions and step.c's calls to the same signatures. */
#ifndef HYBRIDRT_KERNELS_H
#define HYBRIDRT_KERNELS_H

#include <stdint.h>

void rms_norm_bf16(const uint16_t *x, int64_t ld_x, const uint16_t *res, uint16_t *out,
                   uint16_t *res_out, const uint16_t *w, float eps, int64_t M, int64_t D,
                   int num_threads);
void silu_mul(const void *gate, int64_t ld_g, const void *up, int64_t ld_u, void *out,
              int64_t M, int64_t N, int bf, int num_threads);
int int4_gemm(const void *x, int x_bf, const uint8_t *qs, const uint8_t *codes,
              const uint16_t *scales, void *y, int y_bf, int64_t M, int64_t N, int64_t K,
              int64_t Kp, int isa, int num_threads);
void int4_set_one_row_nta(int on);
int int6_gemm(const void *x, int x_bf, const uint8_t *qs, const uint8_t *hs,
              const uint8_t *codes, const uint16_t *scales, void *y, int y_bf, int64_t M,
              int64_t N, int64_t K, int64_t Kp, int isa, int num_threads);
int int8_gemm_bf16(const uint16_t *x, const int8_t *qs, const uint16_t *sc, uint16_t *y,
                   int64_t M, int64_t N, int64_t K, int64_t Kp, int isa, int num_threads);
void half_gemv(const float *x, const uint16_t *w, void *y, int64_t M, int64_t N, int64_t K,
               int is_fp16, int out_bf16, int num_threads);
void half_gemv_bf16(const uint16_t *x, const uint16_t *w, void *y, int64_t M, int64_t N,
                    int64_t K, int out_bf16, int num_threads);
int gdn_fused(const void *mixed, int64_t ld_mixed, const void *z, int64_t ld_z,
              const void *a, int64_t ld_a, const void *bv, int64_t ld_b,
              const float *conv_taps, void *conv_states, float *ssm,
              const int64_t *slots, const int64_t *slots_out,
              const float *neg_exp_a, const float *dt_bias, const void *norm_w, float eps,
              void *out, int64_t B, int64_t L, int64_t K, int64_t HK, int64_t HV, int64_t DK,
              int64_t DV, int bf, int simd, int num_threads);
int attn_decode(const void *qg, int64_t ld_qg, const void *k, int64_t ld_k, const void *v,
                int64_t ld_v, const void *q_w, const void *k_w, float eps, const void *cos,
                const void *sin, int64_t R, void *k_cache, void *v_cache,
                const int64_t *slot_mapping, const int64_t *tables, int64_t M,
                const int64_t *ctx_lens, int64_t BS, float scale, void *out, int64_t B,
                int64_t L, int64_t H, int64_t HKV, int64_t D, int bf, int kvq, int simd,
                int num_threads);

#endif
