/* bf16 weights on AVX2 + FMA: the fused step's bf16 linears on every x86-64 host without
 * AVX512-BF16 (issue 28). Linked into the decode library by kernels/cpu.py; decode_cpu.c's
 * linear_bf16 picks these kernels at run time (no VDPBF16PS, or the Model's ``bf16_avx2`` flag).
 *
 * Numerics: the contract of the VDPBF16PS path. Each input row is rounded to bf16 (RNE, as torch's
 * .to(bfloat16) and f32_to_half), the bf16 weight is widened to fp32 exactly (its 16 bits moved to
 * the top of a 32-bit lane), and every product of two bf16 values is exact in fp32, so the only
 * roundings are the fp32 accumulation's: the result is bf16(x) W^T + bias in fp32, as VDPBF16PS
 * and AMX compute it, up to summation order.
 *
 * Widening: one 32-byte load of 16 weights, then vpunpcklwd / vpunpckhwd with a zero register put
 * each weight in the high half of a 32-bit lane. That is 2 shuffles per 16 weights (vpmovzxwd +
 * vpslld: 4) but it takes the weights in lane order [0-3, 8-11] and [4-7, 12-15], so the rounded
 * inputs are stored once per linear in that order (bf16_avx2_inputs) and the tiles pair them with
 * the widened weights directly. The last K % 16 inputs stay in place and are summed scalar.
 *
 *   xr row t, one block of 16 k:  [ x0 x1 x2 x3 x8 x9 x10 x11 | x4 x5 x6 x7 x12 x13 x14 x15 ]
 *                                   pairs with unpacklo(0, w)    pairs with unpackhi(0, w)
 *
 * Tiles: as decode_cpu.c's fp32 tiles -- R weight rows g rows apart (the STREAMS parts of a row
 * range, so the weights stream from DRAM as parallel sequential streams) x T input rows, R x T
 * 8-lane accumulators. Every tile shape runs the same per-output sequence of FMAs (the low half,
 * then the high half of each 16-k block, then the scalar tail), so which tile or thread computes
 * an output never changes its bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define STREAMS 4                  /* as decode_cpu.c: rows from 4 parts of the range */

int bf16_avx2_supported(void) { return 1; }

/* x rounded to bf16 (RNE, as f32_to_half: NaN kept, made quiet), as an fp32 value. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u & 0x7fffffff) > 0x7f800000 ? (u | 0x400000) : u + 0x7fff + ((u >> 16) & 1);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline __m256 round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* xr [M, K] fp32 = x rounded to bf16 (RNE); permute: each full 16-k block in the order above (the
 * tiles: two 128-bit lane swaps per block), else in place (BLAS). xr must not alias x. */
void bf16_avx2_inputs(const float *x, int64_t M, int64_t K, float *xr, int permute) {
    for (int64_t t = 0; t < M; t++) {
        const float *xt = x + t * K;
        float *o = xr + t * K;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m256 a = round8_bf16(_mm256_loadu_ps(xt + k)), b = round8_bf16(_mm256_loadu_ps(xt + k + 8));
            _mm256_storeu_ps(o + k, permute ? _mm256_permute2f128_ps(a, b, 0x20) : a);        /* 0-3, 8-11 */
            _mm256_storeu_ps(o + k + 8, permute ? _mm256_permute2f128_ps(a, b, 0x31) : b);    /* 4-7, 12-15 */
        }
        for (; k < K; k++) o[k] = round_bf16(xt[k]);
    }
}

/* out[0..n) = w[0..n) widened to fp32 (exact): a block of weights for BLAS (decode_cpu.c). */
void bf16_avx2_widen(const uint16_t *w, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(out + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i))), 16));
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)w[i] << 16;
        memcpy(out + i, &u, sizeof u);
    }
}

static inline float hsum8(__m256 a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 d = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* y[t, r g] (+)= xr[t] . w[r g] + bias[r g] for R bf16 rows g rows apart and T input rows; pf: the
 * next tile's rows to prefetch (first token group only: later ones find this tile in L1). */
#define DEFINE_ATILE(R, T)                                                                         \
static void atile_##R##_##T(const float *x, int64_t K, const uint16_t *w, int64_t g,               \
                            const float *bias, float *y, int64_t ldy, int acc, const uint16_t *pf) { \
    __m256 a[R][T];                                                                                \
    for (int r = 0; r < R; r++) for (int t = 0; t < T; t++) a[r][t] = _mm256_setzero_ps();         \
    const __m256i z = _mm256_setzero_si256();                                                      \
    const int64_t rs = g * K, kb = K & ~(int64_t)15;                                               \
    for (int64_t k = 0; k < kb; k += 16) {                                                         \
        if (pf && (k & 31) == 0)                                                                   \
            for (int r = 0; r < R; r++) __builtin_prefetch(pf + r * rs + k);                       \
        __m256i raw[R];                                                                            \
        __m256 wv[R];                                                                              \
        for (int r = 0; r < R; r++) {                                                              \
            raw[r] = _mm256_loadu_si256((const __m256i *)(w + r * rs + k));                        \
            wv[r] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, raw[r]));                         \
        }                                                                                          \
        for (int t = 0; t < T; t++) {                                                              \
            const __m256 xv = _mm256_loadu_ps(x + t * K + k);                                      \
            for (int r = 0; r < R; r++) a[r][t] = _mm256_fmadd_ps(wv[r], xv, a[r][t]);             \
        }                                                                                          \
        for (int r = 0; r < R; r++) wv[r] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, raw[r])); \
        for (int t = 0; t < T; t++) {                                                              \
            const __m256 xv = _mm256_loadu_ps(x + t * K + k + 8);                                  \
            for (int r = 0; r < R; r++) a[r][t] = _mm256_fmadd_ps(wv[r], xv, a[r][t]);             \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++)                                                                    \
        for (int t = 0; t < T; t++) {                                                              \
            float s = hsum8(a[r][t]);                                                              \
            for (int64_t i = kb; i < K; i++) s = fmaf(bf16_f32(w[r * rs + i]), x[t * K + i], s);  \
            if (bias) s += bias[r * g];                                                            \
            float *o = y + t * ldy + r * g;                                                        \
            *o = acc ? *o + s : s;                                                                 \
        }                                                                                          \
}
DEFINE_ATILE(4, 1) DEFINE_ATILE(4, 2) DEFINE_ATILE(3, 3) DEFINE_ATILE(2, 4)
DEFINE_ATILE(1, 1) DEFINE_ATILE(1, 2) DEFINE_ATILE(1, 3) DEFINE_ATILE(1, 4)

/* Rows [n0, n1) of y [M, N] (+)= xr [M, K] W^T + bias, W bf16 [N, K], xr from bf16_avx2_inputs:
 * up to 4 input rows per tile (4x1, 4x2, 3x3 + 1x3, 2x4 + 2x4: at most 13 of AVX2's 16 registers
 * live per half-block), the < STREAMS rows left one at a time. */
void bf16_avx2_rows(const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias, int64_t N,
                    float *y, int acc, int64_t n0, int64_t n1) {
    const int64_t g = (n1 - n0) / STREAMS;
    for (int64_t i = 0; i < g; i++) {
        const int64_t n = n0 + i;
        const uint16_t *w = W + n * K, *pf = i + 1 < g ? w + K : NULL;
        const float *b = bias ? bias + n : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4, pf = NULL) {
            const float *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: atile_4_1(xt, K, w, g, b, yt, N, acc, pf); break;
            case 2: atile_4_2(xt, K, w, g, b, yt, N, acc, pf); break;
            case 3: atile_3_3(xt, K, w, g, b, yt, N, acc, pf);
                    atile_1_3(xt, K, w + 3 * g * K, g, b ? b + 3 * g : NULL, yt + 3 * g, N, acc,
                              pf ? pf + 3 * g * K : NULL);
                    break;
            default: atile_2_4(xt, K, w, g, b, yt, N, acc, pf);
                     atile_2_4(xt, K, w + 2 * g * K, g, b ? b + 2 * g : NULL, yt + 2 * g, N, acc,
                               pf ? pf + 2 * g * K : NULL);
            }
        }
    }
    for (int64_t n = n0 + STREAMS * g; n < n1; n++) {
        const uint16_t *w = W + n * K;
        const float *b = bias ? bias + n : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const float *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: atile_1_1(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 2: atile_1_2(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 3: atile_1_3(xt, K, w, 1, b, yt, N, acc, NULL); break;
            default: atile_1_4(xt, K, w, 1, b, yt, N, acc, NULL);
            }
        }
    }
}
#else
/* No AVX2: bf16_supported() is 0 unless VDPBF16PS runs, so these are never called; they exist so
 * the library links on every CPU. */
int bf16_avx2_supported(void) { return 0; }
void bf16_avx2_inputs(const float *x, int64_t M, int64_t K, float *xr, int permute) {
    (void)x; (void)M; (void)K; (void)xr; (void)permute;
}
void bf16_avx2_widen(const uint16_t *w, int64_t n, float *out) { (void)w; (void)n; (void)out; }
void bf16_avx2_rows(const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias, int64_t N,
                    float *y, int acc, int64_t n0, int64_t n1) {
    (void)x; (void)M; (void)K; (void)W; (void)bias; (void)N; (void)y; (void)acc; (void)n0; (void)n1;
}
#endif
