/* Paged attention for CPU, straight through the block table (no gather copies).
 *
 * Built and loaded by kernels/cpu.py with kv_half.c (cc -O3 -march=native -fopenmp-simd, called
 * through ctypes, which drops the GIL for the call). Layouts, as in kernels/reference.py:
 *
 *   query, out        [num_tokens, Hq, D]               fp32
 *   k_cache, v_cache  [num_blocks, block_size, Hkv, D]  fp32, fp16 or bf16 (raw uint16)
 *   block_tables      [num_seqs, table_stride]          int32
 *
 * attend_*: for each listed query row r, attend over the first ctx[r] tokens of sequence seq[r]:
 * softmax(q . k * scale) . v in fp32. Two passes per (row, KV head): all scores (exact max), then
 * exp / sum / weighted V -- the same arithmetic as the torch path up to summation order. A half
 * cache (kv_cache_dtype fp16 / bf16) is widened to fp32 on load (F16C vcvtph2ps; bf16: zero-extend
 * and shift), the math stays fp32.
 *
 * Speed: head dims 32, 48, 64, 96, 128 take GCC/clang vector-extension code with a head's query and
 * output accumulator held in 8-float registers (ND = D / 8 a compile-time constant, one instance
 * per ND), walking the context block by block for all heads at once with the next block prefetched
 * (DEFINE_ROW_VEC); any other D takes the plain loops, head by head. Where the build targets
 * AVX-512F, half caches with head dims 32, 64, 96, 128 take paged_avx512.h's 16-lane rows instead:
 * each K / V vector loaded and widened in registers once per KV head for every query head of its
 * GQA group (paged_set_wide(0): these 8-lane rows, for A/B and tests).
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h"

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline float bf16_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float (exact; subnormals, inf and NaN included). */
static inline float f16_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    if (e == 0x1f) u = sign | 0x7f800000 | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else {                                  /* subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

static inline v8 ld_f32(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
/* 8 bf16 -> 8 fp32. With AVX2 one vpmovzxwd + vpslld (GCC's generic convertvector of a 128-bit
 * vector to a 256-bit one took ~5 instructions and made the bf16 loop slower than fp32's). */
static inline v8 ld_bf16(const uint16_t *p) {
#ifdef __AVX2__
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (v8)_mm256_castsi256_ps(u);
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8 x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}
static inline v8 ld_f16(const uint16_t *p) {
#ifdef __F16C__
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8 x;
    for (int i = 0; i < 8; i++) x[i] = f16_f32(p[i]);
    return x;
#endif
}
static inline float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* A block's used rows as fp32 (n a multiple of 8): half caches are widened once per block into w,
 * not once per query head that reads them (a GQA group of g heads read each row g times); the
 * values are exact, so every sum is the same as widening at each load. fp32: the block itself. */
static inline const float *widen_f32(const float *p, int64_t n, float *w) { (void)n; (void)w; return p; }
static inline const float *widen_bf16(const uint16_t *p, int64_t n, float *w) {
    for (int64_t i = 0; i < n; i += 8) { v8 x = ld_bf16(p + i); memcpy(w + i, &x, sizeof x); }
    return w;
}
static inline const float *widen_f16(const uint16_t *p, int64_t n, float *w) {
    for (int64_t i = 0; i < n; i += 8) { v8 x = ld_f16(p + i); memcpy(w + i, &x, sizeof x); }
    return w;
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
#define LOAD_F16(p, i) f16_f32((p)[i])


/* softmax in place over n scores. With AVX2 + FMA the max and exp run 8 lanes at a time (exp8; the
 * scalar expf of every score was about a third of a decode's attention time at 48-wide heads). */
static void softmax(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
        float mm[8];
        _mm256_storeu_ps(mm, mv);
        for (int i = 0; i < 8; i++) m = mm[i] > m ? mm[i] : m;
    }
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float a8[8];
    _mm256_storeu_ps(a8, acc);
    sum = ((a8[0] + a8[4]) + (a8[1] + a8[5])) + ((a8[2] + a8[6]) + (a8[3] + a8[7]));
    for (; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
#else
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    for (t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
#endif
    float inv = 1.f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* Bring the used rows of a sequence's b-th block (of n context tokens; rows of row_bytes in a
 * cache of block_bytes per block) towards L1/L2 ahead of use. */
static inline void prefetch_block(const void *cache, const int32_t *table, int64_t b, int64_t n,
                                  int64_t bs, int64_t row_bytes) {
    const char *p = (const char *)cache + (int64_t)table[b] * bs * row_bytes;
    const int64_t rows = n - b * bs < bs ? n - b * bs : bs, bytes = rows * row_bytes;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

#if defined(__AVX512F__)
#include "paged_avx512.h"
#endif
/* 0: the 8-lane rows even where the 16-lane ones exist (A/B, tests); the 16-lane ones by default. */
static int wide_rows = 1;
void paged_set_wide(int on) { wide_rows = on; }

/* One query row, every head, D = 8 * ND: scores into s[qh * n + t], output into o[qh * D ..].
 * Block-major: every head of a block is done before the next block, whose rows are prefetched
 * meanwhile, so each block is read from memory once as one contiguous run (a head-major walk read
 * each head's 192-byte slices at a 1-KiB stride through the whole context, once per head: latency-
 * bound, ~10 GB/s, and a half cache then gained only ~10 %). Per head the arithmetic is unchanged:
 * scores in 4-token groups (hsum4), softmax, V accumulated token by token in fp32. */
#define DEFINE_ROW_VEC(NAME, KT, WIDEN, ND)                                                        \
static void NAME(const float *qrow, const KT *kc, const KT *vc, const int32_t *table, int64_t n,   \
                 int64_t bs, int64_t hq, int64_t hkv, float scale, float *s, float *o, float *wk) { \
    const int64_t D = 8 * ND, row_stride = hkv * D, g_n = hq / hkv;                                \
    const int64_t blk = bs * row_stride, nb = (n + bs - 1) / bs;                                   \
    const int64_t row_bytes = row_stride * (int64_t)sizeof(KT);                                    \
    for (int64_t b = 0, t0 = 0; b < nb; b++, t0 += bs) {                                           \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                               \
        if (b + 1 < nb) prefetch_block(kc, table, b + 1, n, bs, row_bytes);                        \
        const float *kb = WIDEN(kc + (int64_t)table[b] * blk, m * row_stride, wk);                 \
        for (int64_t qh = 0; qh < hq; qh++) {                                                      \
            v8 q[ND];                                                                              \
            for (int j = 0; j < ND; j++) q[j] = ld_f32(qrow + qh * D + 8 * j);                     \
            const float *k = kb + (qh / g_n) * D;                                                  \
            float *sh = s + qh * n + t0;                                                           \
            int64_t t = 0;                                                                         \
            for (; t + 4 <= m; t += 4, k += 4 * row_stride) {                                      \
                const float *k1 = k + row_stride, *k2 = k1 + row_stride, *k3 = k2 + row_stride;    \
                v8 a0 = q[0] * ld_f32(k), a1 = q[0] * ld_f32(k1), a2 = q[0] * ld_f32(k2),          \
                   a3 = q[0] * ld_f32(k3);                                                         \
                for (int j = 1; j < ND; j++) {                                                     \
                    a0 += q[j] * ld_f32(k + 8 * j); a1 += q[j] * ld_f32(k1 + 8 * j);               \
                    a2 += q[j] * ld_f32(k2 + 8 * j); a3 += q[j] * ld_f32(k3 + 8 * j);              \
                }                                                                                  \
                hsum4(a0, a1, a2, a3, scale, sh + t);                                              \
            }                                                                                      \
            for (; t < m; t++, k += row_stride) {                                                  \
                v8 a = q[0] * ld_f32(k);                                                           \
                for (int j = 1; j < ND; j++) a += q[j] * ld_f32(k + 8 * j);                        \
                sh[t] = hsum(a) * scale;                                                           \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int64_t qh = 0; qh < hq; qh++) softmax(s + qh * n, n);                                    \
    memset(o, 0, sizeof(float) * (size_t)(hq * D));                                                \
    if (nb > 0) prefetch_block(vc, table, 0, n, bs, row_bytes);                                    \
    for (int64_t b = 0, t0 = 0; b < nb; b++, t0 += bs) {                                           \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                               \
        if (b + 1 < nb) prefetch_block(vc, table, b + 1, n, bs, row_bytes);                        \
        const float *vb = WIDEN(vc + (int64_t)table[b] * blk, m * row_stride, wk);                 \
        for (int64_t qh = 0; qh < hq; qh++) {                                                      \
            v8 acc[ND];                                                                            \
            float *oh = o + qh * D;                                                                \
            for (int j = 0; j < ND; j++) acc[j] = ld_f32(oh + 8 * j);                              \
            const float *v = vb + (qh / g_n) * D;                                                  \
            const float *ph = s + qh * n + t0;                                                     \
            for (int64_t t = 0; t < m; t++, v += row_stride) {                                     \
                v8 p = (v8){0} + ph[t];                                                            \
                for (int j = 0; j < ND; j++) acc[j] += p * ld_f32(v + 8 * j);                      \
            }                                                                                      \
            for (int j = 0; j < ND; j++) memcpy(oh + 8 * j, &acc[j], sizeof(v8));                  \
        }                                                                                          \
    }                                                                                              \
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

#if defined(__AVX512F__)
#define ROWS16(SFX, d, ...) ROW16(SFX, d, __VA_ARGS__)
#else
#define ROWS16(SFX, d, ...) 0
#endif

#define NO_ROWS16(SFX, d, ...) 0

#define DEFINE_ATTEND(NAME, KT, SFX, LOAD, WIDE)                                                   \
DEFINE_ROW_VEC(row4_##SFX, KT, widen_##SFX, 4)                                                     \
DEFINE_ROW_VEC(row6_##SFX, KT, widen_##SFX, 6)                                                     \
DEFINE_ROW_VEC(row8_##SFX, KT, widen_##SFX, 8)                                                     \
DEFINE_ROW_VEC(row12_##SFX, KT, widen_##SFX, 12)                                                   \
DEFINE_ROW_VEC(row16_##SFX, KT, widen_##SFX, 16)                                                   \
DEFINE_HEAD_ANY(head_any_##SFX, KT, LOAD)                                                          \
int NAME(const float *q, const KT *kc, const KT *vc, const int32_t *tables, int64_t table_stride,  \
         const int64_t *rows, const int32_t *seq, const int32_t *ctx, int64_t nrows, int64_t hq,   \
         int64_t hkv, int64_t d, int64_t bs, float scale, float *out) {                            \
    int64_t g_n = hq / hkv, max_ctx = 1;                                                           \
    for (int64_t r = 0; r < nrows; r++) if (ctx[r] > max_ctx) max_ctx = ctx[r];                     \
    float *s = malloc(sizeof(float) * (size_t)(max_ctx * hq));                                     \
    float *wk = malloc(sizeof(float) * (size_t)(bs * hkv * d));     /* one widened block */        \
    if (!s || !wk) { free(s); free(wk); return -1; }                                               \
    for (int64_t r = 0; r < nrows; r++) {                                                          \
        const int32_t *table = tables + (int64_t)seq[r] * table_stride;                           \
        const float *qr = q + rows[r] * hq * d;                                                    \
        float *orow = out + rows[r] * hq * d;                                                      \
        if (wide_rows && WIDE(SFX, d, qr, kc, vc, table, ctx[r], bs, hq, hkv, scale, s, orow))  \
            continue;                                                                              \
        switch (d) {                                                                               \
        case 32: row4_##SFX(qr, kc, vc, table, ctx[r], bs, hq, hkv, scale, s, orow, wk); continue;     \
        case 48: row6_##SFX(qr, kc, vc, table, ctx[r], bs, hq, hkv, scale, s, orow, wk); continue;     \
        case 64: row8_##SFX(qr, kc, vc, table, ctx[r], bs, hq, hkv, scale, s, orow, wk); continue;     \
        case 96: row12_##SFX(qr, kc, vc, table, ctx[r], bs, hq, hkv, scale, s, orow, wk); continue;    \
        case 128: row16_##SFX(qr, kc, vc, table, ctx[r], bs, hq, hkv, scale, s, orow, wk); continue;   \
        }                                                                                          \
        for (int64_t qh = 0; qh < hq; qh++) {                                                      \
            const int64_t h = qh / g_n;                                                            \
            head_any_##SFX(qr + qh * d, kc + h * d, vc + h * d, table, ctx[r], bs, hkv * d, d,     \
                           scale, s, orow + qh * d);                                               \
        }                                                                                          \
    }                                                                                              \
    free(s);                                                                                       \
    free(wk);                                                                                      \
    return 0;                                                                                      \
}

/* fp32 caches keep the 8-lane rows (no widening to save: even on Zen 4; fp32 stays the oracle's
 * summation order); half caches take the 16-lane rows where built. */
DEFINE_ATTEND(attend_f32, float, f32, LOAD_F32, NO_ROWS16)
DEFINE_ATTEND(attend_bf16, uint16_t, bf16, LOAD_BF16, ROWS16)
DEFINE_ATTEND(attend_f16, uint16_t, f16, LOAD_F16, ROWS16)
