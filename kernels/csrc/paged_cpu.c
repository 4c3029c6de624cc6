/* Paged attention and KV store for CPU, straight through the block table (no gather copies).
 *
 * Built and loaded by kernels/cpu.py (cc -O3 -march=native -fopenmp-simd, called through ctypes,
 * which drops the GIL for the call). Layouts, as in kernels/reference.py:
 *
 *   query, out        [num_tokens, Hq, D]               fp32
 *   k_cache, v_cache  [num_blocks, block_size, Hkv, D]  fp32 or bf16 (raw uint16)
 *   block_tables      [num_seqs, table_stride]          int32
 *
 * attend_*: for each listed query row r, attend over the first ctx[r] tokens of sequence seq[r]:
 * softmax(q . k * scale) . v in fp32. Two passes per (row, KV head): all scores (exact max), then
 * exp / sum / weighted V -- the same arithmetic as the torch path up to summation order.
 *
 * Speed: head dims that are multiples of 8 up to 128 take GCC/clang vector-extension code with the
 * query row and the output accumulator held in 8-float registers (ND = D / 8 a compile-time
 * constant, one instance per ND); any other D takes the plain loops.
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline float bf16_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline v8 ld_f32(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline v8 ld_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8 x;
    memcpy(&x, &u, sizeof x);
    return x;
}
static inline float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* s[0..4) = horizontal sums of a0..a3 (one reduction tree for four tokens' scores, instead of
 * four separate ones: the per-token reduction was the score loop's main cost). */
static inline void hsum4(v8 a0, v8 a1, v8 a2, v8 a3, float scale, float *s) {
#ifdef __AVX__
    __m256 t0 = _mm256_hadd_ps((__m256)a0, (__m256)a1), t1 = _mm256_hadd_ps((__m256)a2, (__m256)a3);
    __m256 u = _mm256_hadd_ps(t0, t1);     /* [a0 a1 a2 a3] partial sums of lanes 0-3 | of lanes 4-7 */
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    _mm_storeu_ps(s, _mm_mul_ps(r, _mm_set1_ps(scale)));
#else
    s[0] = hsum(a0) * scale; s[1] = hsum(a1) * scale; s[2] = hsum(a2) * scale; s[3] = hsum(a3) * scale;
#endif
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_f32((p)[i])

/* softmax in place over n scores */
static void softmax(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

/* One (row, KV head, query head) with D = 8 * ND: scores into s[0..n), output into o[0..D). */
#define DEFINE_HEAD_VEC(NAME, KT, VLOAD, ND)                                                       \
static void NAME(const float *qg, const KT *kc, const KT *vc, const int32_t *table, int64_t n,     \
                 int64_t bs, int64_t row_stride, float scale, float *s, float *o) {                \
    v8 q[ND], acc[ND];                                                                             \
    for (int j = 0; j < ND; j++) { q[j] = ld_f32(qg + 8 * j); acc[j] = (v8){0}; }                  \
    for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, b++) {                                           \
        const KT *k = kc + (int64_t)table[b] * bs * row_stride;                                    \
        int64_t m = n - t0 < bs ? n - t0 : bs;                                                     \
        int64_t t = 0;                                                                             \
        for (; t + 4 <= m; t += 4, k += 4 * row_stride) {                                          \
            const KT *k1 = k + row_stride, *k2 = k1 + row_stride, *k3 = k2 + row_stride;           \
            v8 a0 = q[0] * VLOAD(k), a1 = q[0] * VLOAD(k1), a2 = q[0] * VLOAD(k2),                 \
               a3 = q[0] * VLOAD(k3);                                                              \
            for (int j = 1; j < ND; j++) {                                                         \
                a0 += q[j] * VLOAD(k + 8 * j); a1 += q[j] * VLOAD(k1 + 8 * j);                     \
                a2 += q[j] * VLOAD(k2 + 8 * j); a3 += q[j] * VLOAD(k3 + 8 * j);                    \
            }                                                                                      \
            hsum4(a0, a1, a2, a3, scale, s + t0 + t);                                              \
        }                                                                                          \
        for (; t < m; t++, k += row_stride) {                                                      \
            v8 a = q[0] * VLOAD(k);                                                                \
            for (int j = 1; j < ND; j++) a += q[j] * VLOAD(k + 8 * j);                             \
            s[t0 + t] = hsum(a) * scale;                                                           \
        }                                                                                          \
    }                                                                                              \
    softmax(s, n);                                                                                 \
    for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, b++) {                                           \
        const KT *v = vc + (int64_t)table[b] * bs * row_stride;                                    \
        int64_t m = n - t0 < bs ? n - t0 : bs;                                                     \
        for (int64_t t = 0; t < m; t++, v += row_stride) {                                         \
            v8 p = (v8){0} + s[t0 + t];                                                            \
            for (int j = 0; j < ND; j++) acc[j] += p * VLOAD(v + 8 * j);                           \
        }                                                                                          \
    }                                                                                              \
    for (int j = 0; j < ND; j++) memcpy(o + 8 * j, &acc[j], sizeof(v8));                           \
}

/* Any D: plain loops. */
#define DEFINE_HEAD_ANY(NAME, KT, LOAD)                                                            \
static void NAME(const float *qg, const KT *kc, const KT *vc, const int32_t *table, int64_t n,     \
                 int64_t bs, int64_t row_stride, int64_t d, float scale, float *s, float *o) {     \
    for (int64_t t = 0; t < n; t++) {                                                              \
        const KT *k = kc + ((int64_t)table[t / bs] * bs + t % bs) * row_stride;                    \
        float a = 0.f;                                                                             \
        for (int64_t i = 0; i < d; i++) a += qg[i] * LOAD(k, i);                                   \
        s[t] = a * scale;                                                                          \
    }                                                                                              \
    softmax(s, n);                                                                                 \
    memset(o, 0, sizeof(float) * (size_t)d);                                                       \
    for (int64_t t = 0; t < n; t++) {                                                              \
        const KT *v = vc + ((int64_t)table[t / bs] * bs + t % bs) * row_stride;                    \
        for (int64_t i = 0; i < d; i++) o[i] += s[t] * LOAD(v, i);                                 \
    }                                                                                              \
}

#define DEFINE_ATTEND(NAME, KT, SFX, LOAD)                                                         \
DEFINE_HEAD_VEC(head4_##SFX, KT, ld_##SFX, 4)                                                      \
DEFINE_HEAD_VEC(head6_##SFX, KT, ld_##SFX, 6)                                                      \
DEFINE_HEAD_VEC(head8_##SFX, KT, ld_##SFX, 8)                                                      \
DEFINE_HEAD_VEC(head12_##SFX, KT, ld_##SFX, 12)                                                    \
DEFINE_HEAD_VEC(head16_##SFX, KT, ld_##SFX, 16)                                                    \
DEFINE_HEAD_ANY(head_any_##SFX, KT, LOAD)                                                          \
int NAME(const float *q, const KT *kc, const KT *vc, const int32_t *tables, int64_t table_stride,  \
         const int64_t *rows, const int32_t *seq, const int32_t *ctx, int64_t nrows, int64_t hq,   \
         int64_t hkv, int64_t d, int64_t bs, float scale, float *out) {                            \
    int64_t g_n = hq / hkv, max_ctx = 1;                                                           \
    for (int64_t r = 0; r < nrows; r++) if (ctx[r] > max_ctx) max_ctx = ctx[r];                     \
    float *s = malloc(sizeof(float) * (size_t)max_ctx);                                            \
    if (!s) return -1;                                                                             \
    for (int64_t r = 0; r < nrows; r++) {                                                          \
        const int32_t *table = tables + (int64_t)seq[r] * table_stride;                           \
        for (int64_t qh = 0; qh < hq; qh++) {                                                      \
            const int64_t h = qh / g_n;                                                            \
            const float *qg = q + (rows[r] * hq + qh) * d;                                         \
            float *o = out + (rows[r] * hq + qh) * d;                                              \
            const KT *k = kc + h * d, *v = vc + h * d;                                             \
            switch (d) {                                                                           \
            case 32: head4_##SFX(qg, k, v, table, ctx[r], bs, hkv * d, scale, s, o); break;        \
            case 48: head6_##SFX(qg, k, v, table, ctx[r], bs, hkv * d, scale, s, o); break;        \
            case 64: head8_##SFX(qg, k, v, table, ctx[r], bs, hkv * d, scale, s, o); break;        \
            case 96: head12_##SFX(qg, k, v, table, ctx[r], bs, hkv * d, scale, s, o); break;       \
            case 128: head16_##SFX(qg, k, v, table, ctx[r], bs, hkv * d, scale, s, o); break;      \
            default: head_any_##SFX(qg, k, v, table, ctx[r], bs, hkv * d, d, scale, s, o);        \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    free(s);                                                                                       \
    return 0;                                                                                      \
}

DEFINE_ATTEND(attend_f32, float, f32, LOAD_F32)
DEFINE_ATTEND(attend_bf16, uint16_t, bf16, LOAD_BF16)

/* Copy each token's K and V rows (Hkv * D elements of elem_size bytes) to its slot; slot < 0 skips. */
void store_kv(const void *key, const void *value, void *kc, void *vc, const int64_t *slots,
              int64_t ntok, int64_t row_bytes) {
    for (int64_t i = 0; i < ntok; i++) {
        if (slots[i] < 0) continue;
        memcpy((char *)kc + slots[i] * row_bytes, (const char *)key + i * row_bytes, (size_t)row_bytes);
        memcpy((char *)vc + slots[i] * row_bytes, (const char *)value + i * row_bytes, (size_t)row_bytes);
    }
}
