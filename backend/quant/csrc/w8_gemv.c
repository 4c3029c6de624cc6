/* One activation row (decode at 1 stream; issue 16, fourth round). Bound by weight bytes, and
 * there the weight-only loop (vpmovsxbd + vcvtdq2ps + scale + FMA per 8 weights) was arithmetic-
 * bound at ~12 GB/s of int8 per channel (7.6 GB/s with groups of 32) on this Zen 3. Here: the row
 * quantized to int16 as above, then per 16 weights one vpmovsxbw + vpmaddwd + vpaddd. Per channel,
 * 4 weight rows at once taken from the 4 quarters of the row range (4 DRAM streams side by side,
 * each int16 x vector loaded once for the 4): ~20-22 GB/s on SmolLM2's 135 M int8 weights,
 * 1.6-1.75x; groups of 32: a16_g32_1 row by row in the same 4-stream order, ~16 GB/s, 2.1x
 * (docs/quantization.md). */
#include "quant_cpu.h"
#ifdef __AVX2__
static inline int32_t a16_dot1(const int16_t *xq, const int8_t *w, int64_t K) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(ld_w16(w + k), ld_x16(xq + k)));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(ld_w16(w + k + 16), ld_x16(xq + k + 16)));
    }
    for (; k + 16 <= K; k += 16) a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(ld_w16(w + k), ld_x16(xq + k)));
    int32_t t = hsum_i32(_mm256_add_epi32(a0, a1));
    for (; k < K; k++) t += (int32_t)xq[k] * w[k];
    return t;
}

void w8_gemv_a16(const float *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t G,
                 const float *bias, int64_t N, float *y, int nthreads) {
    int64_t ldq = (K + 15) & ~(int64_t)15, qn = N / 4;
    int16_t stack[4096], *xq = ldq <= 4096 ? stack : malloc((size_t)ldq * sizeof(int16_t));
    float sx;
    a16_quantize(x, K, 1, K, a16_q(K), xq, ldq, &sx, 1);
    if (G < K) {                   /* groups of 32: one row at a time (a16_g32_1), rows in 4 streams */
        int64_t ng = K / 32;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t j = 0; j < N; j++) {
            int64_t n = j < 4 * qn ? (j % 4) * qn + j / 4 : j;
            float f;
            a16_g32_row(xq, w + n * K, scales + n * ng, K, &f);
            y[n] = f * sx + (bias ? bias[n] : 0.f);
        }
        if (xq != stack) free(xq);
        return;
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < qn; i++) {
        const int8_t *w0 = w + i * K, *w1 = w + (qn + i) * K, *w2 = w + (2 * qn + i) * K, *w3 = w + (3 * qn + i) * K;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            __m256i xv = ld_x16(xq + k);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(ld_w16(w0 + k), xv));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(ld_w16(w1 + k), xv));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(ld_w16(w2 + k), xv));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(ld_w16(w3 + k), xv));
        }
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
        int32_t r[4];
        _mm_storeu_si128((__m128i *)r, _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
        for (; k < K; k++) {
            r[0] += (int32_t)xq[k] * w0[k]; r[1] += (int32_t)xq[k] * w1[k];
            r[2] += (int32_t)xq[k] * w2[k]; r[3] += (int32_t)xq[k] * w3[k];
        }
        for (int j = 0; j < 4; j++) {
            int64_t n = j * qn + i;
            y[n] = (float)r[j] * (h2f(scales[n]) * sx) + (bias ? bias[n] : 0.f);
        }
    }
    for (int64_t n = 4 * qn; n < N; n++)
        y[n] = (float)a16_dot1(xq, w + n * K, K) * (h2f(scales[n]) * sx) + (bias ? bias[n] : 0.f);
    if (xq != stack) free(xq);
}

/* Two activation rows, per channel (decode at 2 streams, 2-token prefill tails): the one-row
 * GEMV's 4 weight rows per pass, each widened weight vector used for both rows (8 int32
 * accumulators, no spills). */
void w8_gemv2_a16(const float *x, int64_t ldx, int64_t K, const int8_t *w, const uint16_t *scales,
                  const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    int64_t ldq = (K + 15) & ~(int64_t)15, qn = N / 4;
    int16_t stack[8192], *xq = 2 * ldq <= 8192 ? stack : malloc((size_t)(2 * ldq) * sizeof(int16_t));
    float sx[2];
    a16_quantize(x, ldx, 2, K, a16_q(K), xq, ldq, sx, 1);
    const int16_t *x0 = xq, *x1 = xq + ldq;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < qn; i++) {
        const int8_t *wr[4] = {w + i * K, w + (qn + i) * K, w + (2 * qn + i) * K, w + (3 * qn + i) * K};
        __m256i a0[4], a1[4];
        for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_si256();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            __m256i xv0 = ld_x16(x0 + k), xv1 = ld_x16(x1 + k);
            for (int j = 0; j < 4; j++) {
                __m256i u = ld_w16(wr[j] + k);
                a0[j] = _mm256_add_epi32(a0[j], _mm256_madd_epi16(u, xv0));
                a1[j] = _mm256_add_epi32(a1[j], _mm256_madd_epi16(u, xv1));
            }
        }
        __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0[0], a0[1]), _mm256_hadd_epi32(a0[2], a0[3]));
        __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a1[0], a1[1]), _mm256_hadd_epi32(a1[2], a1[3]));
        int32_t r0[4], r1[4];
        _mm_storeu_si128((__m128i *)r0, _mm_add_epi32(_mm256_castsi256_si128(h0), _mm256_extracti128_si256(h0, 1)));
        _mm_storeu_si128((__m128i *)r1, _mm_add_epi32(_mm256_castsi256_si128(h1), _mm256_extracti128_si256(h1, 1)));
        for (; k < K; k++)
            for (int j = 0; j < 4; j++) { r0[j] += (int32_t)x0[k] * wr[j][k]; r1[j] += (int32_t)x1[k] * wr[j][k]; }
        for (int j = 0; j < 4; j++) {
            int64_t n = j * qn + i;
            float s = h2f(scales[n]), b = bias ? bias[n] : 0.f;
            y[n] = (float)r0[j] * (s * sx[0]) + b;
            y[ldy + n] = (float)r1[j] * (s * sx[1]) + b;
        }
    }
    for (int64_t n = 4 * qn; n < N; n++) {
        float s = h2f(scales[n]), b = bias ? bias[n] : 0.f;
        y[n] = (float)a16_dot1(x0, w + n * K, K) * (s * sx[0]) + b;
        y[ldy + n] = (float)a16_dot1(x1, w + n * K, K) * (s * sx[1]) + b;
    }
    if (xq != stack) free(xq);
}
#endif
