/* One gated-delta-rule token per (sequence, value head), states updated in place in their pool.
 *
 * For each pair, with S = states[slot][h] ([DK, DV] fp32, row-major) and d = exp(g):
 *     delta = beta * (v - d * S^T k)
 *     o     = d * S^T q + (q . k) * delta        (= S'^T q)
 *     S'    = d * S + k delta^T
 * Pass 1 reads S once (S^T k and S^T q together); pass 2 rewrites it while it is still in L2
 * (64 KiB per pair at DK = DV = 128). The torch fallback needs three passes over the pool plus
 * the small batched products (kernels/delta_rule.py, _step_in_place).
 *
 * q, k: [B, H, DK]; v, out: [B, H, DV]; decay (= exp(g)), beta: [B, H]; all fp32 contiguous.
 * slots: [B] int64, the slot of each sequence; states: [num_slots, H, DK, DV].
 */
#include <stdint.h>

void gdn_decode_step(float *states, const int64_t *slots, const float *q, const float *k,
                     const float *v, const float *decay, const float *beta, float *out,
                     int64_t B, int64_t H, int64_t DK, int64_t DV, int num_threads)
{
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        float *S = states + (slots[b] * H + h) * DK * DV;
        const float *qq = q + bh * DK, *kk = k + bh * DK, *vv = v + bh * DV;
        const float d = decay[bh], bt = beta[bh];
        float kS[DV], qS[DV], delta[DV];
        for (int64_t j = 0; j < DV; ++j) { kS[j] = 0.0f; qS[j] = 0.0f; }
        float qk = 0.0f;
        for (int64_t i = 0; i < DK; ++i) {
            const float *row = S + i * DV;
            const float ki = kk[i], qi = qq[i];
            qk += qi * ki;
            for (int64_t j = 0; j < DV; ++j) { kS[j] += ki * row[j]; qS[j] += qi * row[j]; }
        }
        float *o = out + bh * DV;
        for (int64_t j = 0; j < DV; ++j) {
            delta[j] = bt * (vv[j] - d * kS[j]);
            o[j] = d * qS[j] + qk * delta[j];
        }
        for (int64_t i = 0; i < DK; ++i) {
            float *row = S + i * DV;
            const float ki = kk[i];
            for (int64_t j = 0; j < DV; ++j) row[j] = d * row[j] + ki * delta[j];
        }
    }
}
