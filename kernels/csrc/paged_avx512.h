/* AVX-512 rows of paged_cpu.c's attention (included by it where the compiler targets AVX-512F):
 * head dims that are a multiple of 16 (32, 64, 96, 128), fp16 / bf16 caches (fp32 ones keep the
 * 8-lane rows: nothing to widen, no gain measured).
 *
 * Why: the 8-lane rows (DEFINE_ROW_VEC) widen a half cache's block into an fp32 scratch first and
 * then read it once per query head; on a Zen 4 core the widening pass and its stores took about a
 * third of a decode's attention, the FMAs less than half. Here each K / V vector of 16 values is
 * loaded and widened in registers once per KV head and multiplied into every query head of its GQA
 * group (up to GH of them at a time: SmolLM2's 3), 4 tokens x GH heads of accumulators in flight.
 *
 * Same contract as paged_cpu.c: fp32 math, scores of all heads first (exact max), softmax, V
 * accumulated token by token in fp32; only the summation order of a score's D products differs
 * from the 8-lane rows (16 partial sums folded to 8, then hsum4's tree). Block-major as there: every
 * head of a block before the next block, whose rows are prefetched meanwhile. */

static inline __m512 ld16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 ld16_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* 16 lanes -> 8: lane i + lane i + 8 */
static inline v8 fold16(__m512 a) {
    return (v8)_mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* Scores of GH query heads (q: their rows, D = 16 NZ apart) against m tokens of one KV head
 * (k: the first token's row of that head, rows row_stride apart): s[h n + t] for t < m. */
#define DEFINE_QK16(SFX, KT, NZ, GH)                                                                \
static inline void qk16_##SFX##_##NZ##_##GH(const float *q, const KT *k, int64_t row_stride, int64_t m, \
                                            float scale, float *s, int64_t n) {                    \
    __m512 qv[GH][NZ];                                                                              \
    for (int h = 0; h < GH; h++) for (int j = 0; j < NZ; j++) qv[h][j] = _mm512_loadu_ps(q + (h * NZ + j) * 16); \
    int64_t t = 0;                                                                                  \
    for (; t + 4 <= m; t += 4, k += 4 * row_stride) {                                               \
        __m512 a[GH][4];                                                                            \
        for (int u = 0; u < 4; u++) {                                                               \
            const __m512 kz = ld16_##SFX(k + u * row_stride);                                       \
            for (int h = 0; h < GH; h++) a[h][u] = _mm512_mul_ps(qv[h][0], kz);                     \
        }                                                                                           \
        for (int j = 1; j < NZ; j++)                                                                \
            for (int u = 0; u < 4; u++) {                                                           \
                const __m512 kz = ld16_##SFX(k + u * row_stride + 16 * j);                          \
                for (int h = 0; h < GH; h++) a[h][u] = _mm512_fmadd_ps(qv[h][j], kz, a[h][u]);      \
            }                                                                                       \
        for (int h = 0; h < GH; h++)                                                                \
            hsum4(fold16(a[h][0]), fold16(a[h][1]), fold16(a[h][2]), fold16(a[h][3]), scale, s + h * n + t); \
    }                                                                                               \
    for (; t < m; t++, k += row_stride) {                                                           \
        __m512 a[GH];                                                                               \
        const __m512 kz = ld16_##SFX(k);                                                            \
        for (int h = 0; h < GH; h++) a[h] = _mm512_mul_ps(qv[h][0], kz);                            \
        for (int j = 1; j < NZ; j++) {                                                              \
            const __m512 kj = ld16_##SFX(k + 16 * j);                                               \
            for (int h = 0; h < GH; h++) a[h] = _mm512_fmadd_ps(qv[h][j], kj, a[h]);                \
        }                                                                                           \
        for (int h = 0; h < GH; h++) s[h * n + t] = hsum(fold16(a[h])) * scale;                     \
    }                                                                                               \
}

/* o[h D ..] += sum_t p[h n + t] v_t for GH heads over m tokens of one KV head. */
#define DEFINE_PV16(SFX, KT, NZ, GH)                                                                \
static inline void pv16_##SFX##_##NZ##_##GH(const float *p, int64_t n, const KT *v, int64_t row_stride, \
                                            int64_t m, float *o) {                                 \
    __m512 acc[GH][NZ];                                                                             \
    for (int h = 0; h < GH; h++) for (int j = 0; j < NZ; j++) acc[h][j] = _mm512_loadu_ps(o + (h * NZ + j) * 16); \
    for (int64_t t = 0; t < m; t++, v += row_stride) {                                              \
        __m512 pb[GH];                                                                              \
        for (int h = 0; h < GH; h++) pb[h] = _mm512_set1_ps(p[h * n + t]);                          \
        for (int j = 0; j < NZ; j++) {                                                              \
            const __m512 vz = ld16_##SFX(v + 16 * j);                                               \
            for (int h = 0; h < GH; h++) acc[h][j] = _mm512_fmadd_ps(pb[h], vz, acc[h][j]);         \
        }                                                                                           \
    }                                                                                               \
    for (int h = 0; h < GH; h++) for (int j = 0; j < NZ; j++) _mm512_storeu_ps(o + (h * NZ + j) * 16, acc[h][j]); \
}

/* Heads per call by register budget: GH x NZ query (or output) vectors + 4 GH score accumulators. */
#define GH_MAX(NZ) ((NZ) <= 2 ? 4 : (NZ) <= 4 ? 3 : 2)

#define DEFINE_KV16(SFX, KT, NZ)                                                                    \
DEFINE_QK16(SFX, KT, NZ, 1) DEFINE_QK16(SFX, KT, NZ, 2) DEFINE_QK16(SFX, KT, NZ, 3) DEFINE_QK16(SFX, KT, NZ, 4) \
DEFINE_PV16(SFX, KT, NZ, 1) DEFINE_PV16(SFX, KT, NZ, 2) DEFINE_PV16(SFX, KT, NZ, 3) DEFINE_PV16(SFX, KT, NZ, 4) \
static void wrow_##SFX##_##NZ(const float *qrow, const KT *kc, const KT *vc, const int32_t *table, int64_t n, \
                               int64_t bs, int64_t hq, int64_t hkv, float scale, float *s, float *o) { \
    const int64_t D = 16 * NZ, row_stride = hkv * D, g_n = hq / hkv;                                \
    const int64_t blk = bs * row_stride, nb = (n + bs - 1) / bs;                                    \
    const int64_t row_bytes = row_stride * (int64_t)sizeof(KT);                                     \
    for (int64_t b = 0, t0 = 0; b < nb; b++, t0 += bs) {                                            \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                                \
        if (b + 1 < nb) prefetch_block(kc, table, b + 1, n, bs, row_bytes);                         \
        const KT *kb = kc + (int64_t)table[b] * blk;                                                \
        for (int64_t qh = 0; qh < hq;) {                                                            \
            const int64_t h = qh / g_n, left = (h + 1) * g_n - qh;                                  \
            const int gh = (int)(left < GH_MAX(NZ) ? left : GH_MAX(NZ));                            \
            const float *qq = qrow + qh * D;                                                        \
            const KT *k = kb + h * D;                                                               \
            float *sh = s + qh * n + t0;                                                            \
            switch (gh) {                                                                           \
            case 1: qk16_##SFX##_##NZ##_1(qq, k, row_stride, m, scale, sh, n); break;               \
            case 2: qk16_##SFX##_##NZ##_2(qq, k, row_stride, m, scale, sh, n); break;               \
            case 3: qk16_##SFX##_##NZ##_3(qq, k, row_stride, m, scale, sh, n); break;               \
            default: qk16_##SFX##_##NZ##_4(qq, k, row_stride, m, scale, sh, n);                     \
            }                                                                                       \
            qh += gh;                                                                               \
        }                                                                                           \
    }                                                                                               \
    for (int64_t qh = 0; qh < hq; qh++) softmax(s + qh * n, n);                                     \
    memset(o, 0, sizeof(float) * (size_t)(hq * D));                                                 \
    if (nb > 0) prefetch_block(vc, table, 0, n, bs, row_bytes);                                     \
    for (int64_t b = 0, t0 = 0; b < nb; b++, t0 += bs) {                                            \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                                \
        if (b + 1 < nb) prefetch_block(vc, table, b + 1, n, bs, row_bytes);                         \
        const KT *vb = vc + (int64_t)table[b] * blk;                                                \
        for (int64_t qh = 0; qh < hq;) {                                                            \
            const int64_t h = qh / g_n, left = (h + 1) * g_n - qh;                                  \
            const int gh = (int)(left < GH_MAX(NZ) ? left : GH_MAX(NZ));                            \
            const float *ph = s + qh * n + t0;                                                      \
            const KT *v = vb + h * D;                                                               \
            float *oh = o + qh * D;                                                                 \
            switch (gh) {                                                                           \
            case 1: pv16_##SFX##_##NZ##_1(ph, n, v, row_stride, m, oh); break;                      \
            case 2: pv16_##SFX##_##NZ##_2(ph, n, v, row_stride, m, oh); break;                      \
            case 3: pv16_##SFX##_##NZ##_3(ph, n, v, row_stride, m, oh); break;                      \
            default: pv16_##SFX##_##NZ##_4(ph, n, v, row_stride, m, oh);                            \
            }                                                                                       \
            qh += gh;                                                                               \
        }                                                                                           \
    }                                                                                               \
}

#define DEFINE_ROWS16(SFX, KT) DEFINE_KV16(SFX, KT, 2) DEFINE_KV16(SFX, KT, 4) DEFINE_KV16(SFX, KT, 6) \
                               DEFINE_KV16(SFX, KT, 8)
DEFINE_ROWS16(bf16, uint16_t)
DEFINE_ROWS16(f16, uint16_t)

/* 1 and the row done where D has a 16-lane kernel, else 0. */
#define ROW16(SFX, d, ...)                                                                          \
    ((d) == 32 ? (wrow_##SFX##_2(__VA_ARGS__), 1) : (d) == 64 ? (wrow_##SFX##_4(__VA_ARGS__), 1) : \
     (d) == 96 ? (wrow_##SFX##_6(__VA_ARGS__), 1) : (d) == 128 ? (wrow_##SFX##_8(__VA_ARGS__), 1) : 0)
