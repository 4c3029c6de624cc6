/* Paged attention and KV store for CPU, straight through the block table (no gather copies).
 *
 * Built and loaded by kernels/cpu.py (cc -O3 -march=native -fopenmp-simd, called through ctypes,
 * which drops the GIL for the call). Layouts, as in kernels/reference.py:
 *
 *   query, out        [num_tokens, Hq, D]            fp32
 *   k_cache, v_cache  [num_blocks, block_size, Hkv, D]  fp32 or bf16 (raw uint16)
 *   block_tables      [num_seqs, table_stride]       int32
 *
 * attend_*: for each listed query row r, attend over the first ctx[r] tokens of sequence seq[r]:
 * softmax(q . k * scale) . v in fp32, the G = Hq / Hkv query heads of one KV head sharing each key
 * and value load. Scores for a whole context are kept (two passes: exact max, then exp/sum), the
 * same arithmetic as the torch path up to summation order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_f32((p)[i])

#define DEFINE_ATTEND(NAME, KT, LOAD)                                                              \
int NAME(const float *q, const KT *kc, const KT *vc, const int32_t *tables, int64_t table_stride,  \
         const int64_t *rows, const int32_t *seq, const int32_t *ctx, int64_t nrows, int64_t hq,   \
         int64_t hkv, int64_t d, int64_t bs, float scale, float *out) {                            \
    int64_t g_n = hq / hkv, max_ctx = 0;                                                           \
    for (int64_t r = 0; r < nrows; r++) if (ctx[r] > max_ctx) max_ctx = ctx[r];                     \
    float *scores = malloc(sizeof(float) * (size_t)(g_n * max_ctx + g_n * d + 1));                 \
    if (!scores) return -1;                                                                        \
    float *acc = scores + g_n * max_ctx;                                                           \
    for (int64_t r = 0; r < nrows; r++) {                                                          \
        const int64_t n = ctx[r];                                                                  \
        const int32_t *table = tables + (int64_t)seq[r] * table_stride;                           \
        for (int64_t h = 0; h < hkv; h++) {                                                        \
            const float *qh = q + (rows[r] * hq + h * g_n) * d;                                    \
            for (int64_t t = 0; t < n; t++) {                                                      \
                const KT *k = kc + (((int64_t)table[t / bs] * bs + t % bs) * hkv + h) * d;         \
                for (int64_t g = 0; g < g_n; g++) {                                                \
                    const float *qg = qh + g * d;                                                  \
                    float s = 0.f;                                                                 \
                    _Pragma("omp simd reduction(+:s)")                                             \
                    for (int64_t i = 0; i < d; i++) s += qg[i] * LOAD(k, i);                       \
                    scores[g * n + t] = s * scale;                                                 \
                }                                                                                  \
            }                                                                                      \
            for (int64_t g = 0; g < g_n; g++) {                                                    \
                float *sg = scores + g * n, m = -INFINITY, sum = 0.f;                              \
                for (int64_t t = 0; t < n; t++) m = sg[t] > m ? sg[t] : m;                         \
                for (int64_t t = 0; t < n; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }         \
                float inv = 1.f / sum;                                                             \
                for (int64_t t = 0; t < n; t++) sg[t] *= inv;                                      \
            }                                                                                      \
            memset(acc, 0, sizeof(float) * (size_t)(g_n * d));                                     \
            for (int64_t t = 0; t < n; t++) {                                                      \
                const KT *v = vc + (((int64_t)table[t / bs] * bs + t % bs) * hkv + h) * d;         \
                for (int64_t g = 0; g < g_n; g++) {                                                \
                    float p = scores[g * n + t], *a = acc + g * d;                                 \
                    _Pragma("omp simd")                                                            \
                    for (int64_t i = 0; i < d; i++) a[i] += p * LOAD(v, i);                        \
                }                                                                                  \
            }                                                                                      \
            memcpy(out + (rows[r] * hq + h * g_n) * d, acc, sizeof(float) * (size_t)(g_n * d));    \
        }                                                                                          \
    }                                                                                              \
    free(scores);                                                                                  \
    return 0;                                                                                      \
}

DEFINE_ATTEND(attend_f32, float, LOAD_F32)
DEFINE_ATTEND(attend_bf16, uint16_t, LOAD_BF16)

/* Copy each token's K and V rows (Hkv * D elements of elem_size bytes) to its slot; slot < 0 skips. */
void store_kv(const void *key, const void *value, void *kc, void *vc, const int64_t *slots,
              int64_t ntok, int64_t row_bytes) {
    for (int64_t i = 0; i < ntok; i++) {
        if (slots[i] < 0) continue;
        memcpy((char *)kc + slots[i] * row_bytes, (const char *)key + i * row_bytes, (size_t)row_bytes);
        memcpy((char *)vc + slots[i] * row_bytes, (const char *)value + i * row_bytes, (size_t)row_bytes);
    }
}
