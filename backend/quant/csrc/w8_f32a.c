/* int8 weight-only loops: fp32 activations, weights dequantized in registers.
 *
 * Why these loops: decode (M = 1..16) reads every weight once per step, so the kernel is bound by
 * weight bytes: int8 reads a quarter and int4 about a seventh of fp32. Each weight vector is
 * dequantized in registers (q * s, or q * s + (z - 8 s)) once and used for up to 8 activation rows
 * (MT), with NA independent accumulator chains per row so that every tile keeps at least 4 (M < 8)
 * or 8 FMA chains in flight. 8-row tiles (M >= 8) dequantize each weight half as often as 4-row
 * ones and keep 8 chains busy: 1.1-1.4x at M = 8 and 16 (docs/quantization.md). int8 at M >= 8
 * goes one step further (w8_pair_4): two weight rows x 4 activation rows, so each x vector loaded
 * feeds two FMAs (loads, not FMAs, bound the one-row tiles): another 1.15-1.5x at M = 16. The same
 * pairing for int4 spilled registers (two unpacked blocks + 8 accumulators) and was slower.
 * Scales are fp16 (raw uint16 here), widened once per group. Per-group partial sums with a
 * scale applied afterwards were tried first: with G = 32 their per-group bookkeeping cost more
 * than the multiply-adds.
 * These weight-only loops are the reference numerics (w8_set_a16_min_m(0)); by default int8
 * (per channel, or groups of 32) takes int16 activations at 1 row (per channel also at 2) and
 * from a16_min_m = 5 rows on (w8_gemm.c); int4 and int8 at 3-4 rows
 * stay here.
 */
#include "quant_cpu.h"

#define W8_ROWS(MT, NA)                                                                            \
static void w8_rows_##MT(const float *x, int64_t ldx, const int8_t *w, const uint16_t *sc,         \
                         int64_t K, int64_t G, float *acc) {                                       \
    v8 a[MT][NA];                                                                                  \
    float tail[MT];                                                                                \
    for (int m = 0; m < MT; m++) {                                                                 \
        tail[m] = 0.f;                                                                             \
        for (int j = 0; j < NA; j++) a[m][j] = (v8){0};                                            \
    }                                                                                              \
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {                                            \
        int64_t k1 = k0 + G < K ? k0 + G : K, k = k0;                                              \
        float s = h2f(sc[g]);                                                                      \
        v8 sv = (v8){0} + s;                                                                       \
        for (; k + 32 <= k1; k += 32) {                                                            \
            v8 wv[4] = {i8_to_f32(w + k) * sv, i8_to_f32(w + k + 8) * sv,                          \
                        i8_to_f32(w + k + 16) * sv, i8_to_f32(w + k + 24) * sv};                   \
            for (int m = 0; m < MT; m++)                                                           \
                for (int j = 0; j < 4; j++) a[m][j % NA] += ld8(x + m * ldx + k + 8 * j) * wv[j];  \
        }                                                                                          \
        for (; k + 8 <= k1; k += 8) {                                                              \
            v8 wv = i8_to_f32(w + k) * sv;                                                         \
            for (int m = 0; m < MT; m++) a[m][0] += ld8(x + m * ldx + k) * wv;                     \
        }                                                                                          \
        for (; k < k1; k++)                                                                        \
            for (int m = 0; m < MT; m++) tail[m] += x[m * ldx + k] * ((float)w[k] * s);            \
    }                                                                                              \
    for (int m = 0; m < MT; m++) {                                                                 \
        for (int j = 1; j < NA; j++) a[m][0] += a[m][j];                                           \
        acc[m] = hsum(a[m][0]) + tail[m];                                                          \
    }                                                                                              \
}
W8_ROWS(1, 4)
W8_ROWS(2, 2)
W8_ROWS(3, 1)
W8_ROWS(4, 2)
W8_ROWS(8, 1)

/* Two weight rows x 4 activation rows: each x vector loaded feeds 2 FMAs and each dequantized
 * weight vector 4 (8 chains); used for M >= 8, where the kernel is compute-bound. */
static void w8_pair_4(const float *x, int64_t ldx, const int8_t *w0, const int8_t *w1,
                      const uint16_t *sc0, const uint16_t *sc1, int64_t K, int64_t G, float *acc0,
                      float *acc1) {
    v8 a0[4] = {{0}}, a1[4] = {{0}};
    float t0[4] = {0}, t1[4] = {0};
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        int64_t k1 = k0 + G < K ? k0 + G : K, k = k0;
        float s0 = h2f(sc0[g]), s1 = h2f(sc1[g]);
        v8 sv0 = (v8){0} + s0, sv1 = (v8){0} + s1;
        for (; k + 8 <= k1; k += 8) {
            v8 u0 = i8_to_f32(w0 + k) * sv0, u1 = i8_to_f32(w1 + k) * sv1;
            for (int m = 0; m < 4; m++) {
                v8 xv = ld8(x + m * ldx + k);
                a0[m] += xv * u0;
                a1[m] += xv * u1;
            }
        }
        for (; k < k1; k++)
            for (int m = 0; m < 4; m++) {
                t0[m] += x[m * ldx + k] * ((float)w0[k] * s0);
                t1[m] += x[m * ldx + k] * ((float)w1[k] * s1);
            }
    }
    for (int m = 0; m < 4; m++) {
        acc0[m] = hsum(a0[m]) + t0[m];
        acc1[m] = hsum(a1[m]) + t1[m];
    }
}

#ifndef W8_STREAMS
#define W8_STREAMS 4
#endif
/* Weight-only path: fp32 activations, weights dequantized in registers (exported for A/B). */
void w8_gemm_f32a(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                  int64_t G, const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    int64_t ng = (K + G - 1) / G;
    if (M >= 8) {                    /* pairs of weight rows x 4-row tiles; the rest row by row */
        int64_t m4 = M & ~(int64_t)3, np = N / 2;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t p = 0; p < np + (N & 1); p++) {
            int64_t n = 2 * p;
            if (p < np) {
                float acc0[4], acc1[4];
                for (int64_t m0 = 0; m0 < m4; m0 += 4) {
                    w8_pair_4(x + m0 * ldx, ldx, w + n * K, w + (n + 1) * K, scales + n * ng,
                              scales + (n + 1) * ng, K, G, acc0, acc1);
                    for (int m = 0; m < 4; m++) {
                        y[(m0 + m) * ldy + n] = acc0[m] + (bias ? bias[n] : 0.f);
                        y[(m0 + m) * ldy + n + 1] = acc1[m] + (bias ? bias[n + 1] : 0.f);
                    }
                }
            } else {                                 /* the odd last row */
                float acc[MT_MAX];
                for (int64_t m0 = 0; m0 < m4; m0 += 4) {
                    w8_rows_4(x + m0 * ldx, ldx, w + n * K, scales + n * ng, K, G, acc);
                    for (int m = 0; m < 4; m++) y[(m0 + m) * ldy + n] = acc[m] + (bias ? bias[n] : 0.f);
                }
            }
        }
        if (m4 == M) return;
        x += m4 * ldx; y += m4 * ldy; M -= m4;       /* 1..3 rows left: the loop below */
    }
    /* One row per call, per channel: W8_STREAMS consecutive rows taken from as many parts of the row
     * range (as many DRAM streams side by side): 1.13-1.19x on 80 MB of SmolLM2-shaped weights; at
     * M = 2-4 and with groups of 32 it was 0.90-0.97x, so those keep one stream. */
    const int64_t S = M == 1 && G >= K ? W8_STREAMS : 1, qn = N / S;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < N; j++) {
        int64_t n = j < S * qn ? (j % S) * qn + j / S : j;
        const int8_t *wr = w + n * K;
        const uint16_t *sc = scales + n * ng;
        float acc[MT_MAX];
        for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
            mt = m_tile(M - m0);
            const float *xm = x + m0 * ldx;
            switch (mt) {
                case 1: w8_rows_1(xm, ldx, wr, sc, K, G, acc); break;
                case 2: w8_rows_2(xm, ldx, wr, sc, K, G, acc); break;
                case 3: w8_rows_3(xm, ldx, wr, sc, K, G, acc); break;
                case 4: w8_rows_4(xm, ldx, wr, sc, K, G, acc); break;
                default: w8_rows_8(xm, ldx, wr, sc, K, G, acc); break;
            }
            for (int64_t m = 0; m < mt; m++)
                y[(m0 + m) * ldy + n] = acc[m] + (bias ? bias[n] : 0.f);
        }
    }
}

void w8_dequant(const int8_t *w, const uint16_t *scales, int64_t G, int64_t N, int64_t K, float *out,
                int nthreads) {
    int64_t ng = (K + G - 1) / G;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < ng; g++) {             /* one scale per group: the inner loop vectorizes */
            int64_t k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
            float s = h2f(scales[n * ng + g]);
            const int8_t *wr = w + n * K;
            float *o = out + n * K;
            for (int64_t k = k0; k < k1; k++) o[k] = (float)wr[k] * s;
        }
}
