/* int4: weight-only loops (fp32 activations, each block unpacked and dequantized in registers,
 * up to 8 activation rows per pass) and the dequantizer. */
#include "quant_cpu.h"

static inline int q4_at(const uint8_t *row, int64_t k) {
    uint8_t b = row[(k >> 5) * 16 + (k & 15)];
    return (k & 16) ? (b >> 4) : (b & 15);
}

/* q as fp32 for 32 values of one block: out[0..1] = values 0..15, out[2..3] = 16..31. */
static inline void q4_block(const uint8_t *blk, v8 out[4]) {
#ifdef __AVX2__
    /* spelled out: gcc scalarizes the generic version's byte -> float conversions */
    __m128i b = _mm_loadu_si128((const __m128i *)blk), m = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    __m256 f[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
    memcpy(out, f, sizeof f);
#else
    for (int j = 0; j < 16; j++) {
        out[j / 8][j % 8] = (float)(blk[j] & 15);
        out[2 + j / 8][j % 8] = (float)(blk[j] >> 4);
    }
#endif
}

#define W4_ROWS(MT, NA)                                                                            \
static void w4_rows_##MT(const float *x, int64_t ldx, const uint8_t *w, const uint16_t *sc,        \
                         const uint16_t *zr, int64_t K, int64_t G, float *acc) {                   \
    v8 a[MT][NA];                                                                                  \
    float tail[MT];                                                                                \
    for (int m = 0; m < MT; m++) {                                                                 \
        tail[m] = 0.f;                                                                             \
        for (int j = 0; j < NA; j++) a[m][j] = (v8){0};                                            \
    }                                                                                              \
    int64_t kfull = K & ~(int64_t)31;                                                              \
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) {                                            \
        int64_t k1 = k0 + G < K ? k0 + G : K, kv = k1 < kfull ? k1 : kfull, k = k0;                \
        float s = h2f(sc[g]), zz = h2f(zr[g]) - 8.f * s;     /* W = q * s + zz */                  \
        v8 sv = (v8){0} + s, zv = (v8){0} + zz;                                                    \
        for (; k < kv; k += 32) {                                                                  \
            v8 wv[4];                                                                              \
            q4_block(w + (k >> 5) * 16, wv);                                                       \
            for (int j = 0; j < 4; j++) wv[j] = wv[j] * sv + zv;                                   \
            for (int m = 0; m < MT; m++)                                                           \
                for (int j = 0; j < 4; j++) a[m][j % NA] += ld8(x + m * ldx + k + 8 * j) * wv[j];  \
        }                                                                                          \
        for (; k < k1; k++) {                                  /* K % 32 tail only */              \
            float wk = (float)q4_at(w, k) * s + zz;                                                \
            for (int m = 0; m < MT; m++) tail[m] += x[m * ldx + k] * wk;                           \
        }                                                                                          \
    }                                                                                              \
    for (int m = 0; m < MT; m++) {                                                                 \
        for (int j = 1; j < NA; j++) a[m][0] += a[m][j];                                           \
        acc[m] = hsum(a[m][0]) + tail[m];                                                          \
    }                                                                                              \
}
W4_ROWS(1, 4)
W4_ROWS(2, 2)
W4_ROWS(3, 1)
W4_ROWS(4, 2)
W4_ROWS(8, 1)

void w4_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, const uint16_t *scales,
             const uint16_t *zeros, int64_t G, const float *bias, int64_t N, float *y, int64_t ldy,
             int nthreads) {
    int64_t ng = (K + G - 1) / G, kb = (K + 31) / 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * kb * 16;
        const uint16_t *sc = scales + n * ng, *zr = zeros + n * ng;
        float acc[MT_MAX];
        for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
            mt = m_tile(M - m0);
            const float *xm = x + m0 * ldx;
            switch (mt) {
                case 1: w4_rows_1(xm, ldx, wr, sc, zr, K, G, acc); break;
                case 2: w4_rows_2(xm, ldx, wr, sc, zr, K, G, acc); break;
                case 3: w4_rows_3(xm, ldx, wr, sc, zr, K, G, acc); break;
                case 4: w4_rows_4(xm, ldx, wr, sc, zr, K, G, acc); break;
                default: w4_rows_8(xm, ldx, wr, sc, zr, K, G, acc); break;
            }
            for (int64_t m = 0; m < mt; m++)
                y[(m0 + m) * ldy + n] = acc[m] + (bias ? bias[n] : 0.f);
        }
    }
}

void w4_dequant(const uint8_t *w, const uint16_t *scales, const uint16_t *zeros, int64_t G, int64_t N,
                int64_t K, float *out, int nthreads) {
    int64_t ng = (K + G - 1) / G, kb = (K + 31) / 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            int64_t g = n * ng + k / G;
            float s = h2f(scales[g]);
            out[n * K + k] = (float)q4_at(w + n * kb * 16, k) * s + (h2f(zeros[g]) - 8.f * s);
        }
}
