/* Weight-only quantized GEMMs for CPU: y[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias), fp32.
 *
 * Built and loaded by backend/quant/cpu.py through kernels/cpu.py's build cache (cc -O3
 * -march=native -fopenmp, ctypes, GIL dropped during the call). OpenMP resolves to the libgomp
 * torch already loaded (same soname), so the kernel shares torch's thread pool instead of
 * starting a second one that would spin against it on a small machine.
 *
 * Layouts (backend/quant/layout.py):
 *   int8: w int8 [N, K] row-major; scales fp16 [N, NG], NG = ceil(K / G) (G = K: per output
 *         channel; G = 32: GGUF Q8_0 blocks): W[n,k] = w[n,k] * scales[n, k / G]
 *   int4: w uint8 [N, KB * 16], KB = ceil(K / 32) blocks of 32 values, byte j of a block holds
 *         value j in its low nibble and value j + 16 in its high one (GGUF Q4_0/Q4_1's order);
 *         scales, zeros fp16 [N, NG], NG = ceil(K / G), G a multiple of 32:
 *         W[n,k] = (q[n,k] - 8) * scales[n, k / G] + zeros[n, k / G]
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
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}
static inline float h2f(uint16_t h) {     /* IEEE half -> float, subnormals included */
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 31) u = sign | 0x7f800000u | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else {
        float f = (float)m * (1.0f / 16777216.0f);     /* m * 2^-24 */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f; memcpy(&f, &u, 4); return f;
}
static inline v8 i8_to_f32(const int8_t *p) {
#ifdef __AVX2__
    /* gcc scalarizes __builtin_convertvector from an 8-byte vector: say vpmovsxbd + vcvtdq2ps */
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8 x; memcpy(&x, &f, sizeof x); return x;
#else
    v8i8 q; memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, v8);
#endif
}

/* Activation rows per weight pass: 8 while at least 8 are left (each dequantized weight vector
 * feeds 8 FMA chains, and is dequantized half as often as with 4-row tiles), then 4, then 1..3. */
#define MT_MAX 8
static inline int64_t m_tile(int64_t left) { return left >= 8 ? 8 : left >= 4 ? 4 : left; }

/* ---- int8 ------------------------------------------------------------------------------------- */

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

void w8_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
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
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
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
        for (int64_t k = 0; k < K; k++) out[n * K + k] = (float)w[n * K + k] * h2f(scales[n * ng + k / G]);
}

/* ---- int4 ------------------------------------------------------------------------------------- */

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
