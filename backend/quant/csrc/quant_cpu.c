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
 * These weight-only loops are the reference numerics (w8_set_a16_min_m(0)); by default int8
 * (per channel, or groups of 32) takes int16 activations at 1 row (per channel also at 2) and
 * from a16_min_m = 5 rows on (w8_gemm at the end of the int8 section); int4 and int8 at 3-4 rows
 * stay here.
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

/* ---- int8 weights x int16 activations (M >= a16_min_m; per channel, or G = 32) ---------------
 *
 * With several activation rows the weight-only loops above are bound by arithmetic, not by weight
 * bytes: every weight is converted to fp32 (vpmovsxbd + vcvtdq2ps + scale) and then feeds fp32
 * FMAs, 8 multiply-adds per instruction. Here each activation row is quantized once per call to
 * int16 with one scale per row (symmetric, round to nearest: |x - sx * xq| <= sx / 2 with
 * sx = max|x[m, :]| / Q), the int8 weights are widened to int16 (vpmovsxbw, once per weight vector
 * and tile) and vpmaddwd does 16 multiply-adds per instruction into int32 lanes, exact.
 * Q = min(32767, (2^31 - 1) / (127 K)): the whole dot product fits int32 (K = 576: Q = 29357,
 * K = 1536: 11009), so the 8 sums of a tile reduce with 7 vphaddd. Then y = sum * (sw[n] * sx[m]).
 *
 * Measured on Zen 3 (docs/quantization.md, "int8 with int16 activations"): vpmaddwd issues once
 * per cycle, so the kernel peaks near MKL's fp32 sgemm rate, with no dequantization; int8
 * activations (llama.cpp's Q8_0 x Q8_0: vpsignb + vpmaddubsw + vpmaddwd per 32 pairs) would take
 * as many multiplies per pair on this core and round activations 100-250x more coarsely.
 *
 * Tile: 4 activation rows x 2 weight rows (8 int32 accumulators, no spills; 4 x 3 spilled under
 * gcc 12 and 3 x 3, 2 x 4 were slower). Loop order: the 2 weight rows stay in L1 while every
 * activation tile of a panel (A16_X_BYTES of int16 rows, L2) passes over them, so weights
 * streaming from memory are read once per panel (decode: once) and each byte feeds M / 4 tiles.
 * GGUF Q8_0's groups of 32 (G = 32, K % 32 == 0): a16_tile_g32 below (4 x 1, group sums folded by
 * vphaddd, one FMA per 4 groups): 1.3-1.6x the weight-only loops at M >= 8, but 0.6-0.9x fp32 MKL
 * above 32 rows (QuantLinear's torch path keeps dequantize + BLAS there). A convert + FMA per group
 * (3 x 3 and 4 x 1 tiles, tried first) was no faster than the weight-only loops. Other G < K: those.
 */
#ifdef __AVX2__
#define A16_X_BYTES (192 << 10)   /* int16 activation panel kept in L2 while weight rows stream */
static int64_t a16_min_m = 5;        /* backend/quant/cpu.py sets it at load */
void w8_set_a16_min_m(int64_t m) { a16_min_m = m; }   /* 0: never (weight-only loops for every M) */
int64_t w8_a16_min_m(void) { return a16_min_m; }

static inline int64_t a16_q(int64_t K) {     /* |dot| <= K * Q * 127 fits int32 */
    int64_t q = (int64_t)2147483647 / (127 * (K > 0 ? K : 1));
    return q < 32767 ? q : q < 1 ? 1 : 32767;
}

/* x [M, K] -> xq [M, ldq] int16 (tail zeroed), sx[m] = max|x[m]| / Q. */
static void a16_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t Q, int16_t *xq,
                         int64_t ldq, float *sx, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        int16_t *q = xq + m * ldq;
        __m256 mx = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(r + k)));
        float amax = 0.f, t[8];
        _mm256_storeu_ps(t, mx);
        for (int j = 0; j < 8; j++) amax = t[j] > amax ? t[j] : amax;
        for (; k < K; k++) { float a = r[k] < 0 ? -r[k] : r[k]; amax = a > amax ? a : amax; }
        float s = amax / (float)Q, inv = amax > 0.f ? (float)Q / amax : 0.f;
        sx[m] = s;
        __m256 iv = _mm256_set1_ps(inv);
        for (k = 0; k + 16 <= K; k += 16) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), iv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k + 8), iv));
            _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
        }
        for (; k < K; k++) {
            float v = r[k] * inv;
            q[k] = (int16_t)(v >= 0 ? (int32_t)(v + 0.5f) : -(int32_t)(-v + 0.5f));
        }
        for (; k < ldq; k++) q[k] = 0;
    }
}

static inline double hsum_i32d(__m256i v) {       /* exact: 8 int32 lanes summed in double */
    __m256d d = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(v)),
                              _mm256_cvtepi32_pd(_mm256_extracti128_si256(v, 1)));
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}
static inline __m256i ld_w16(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i ld_x16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 8 int32 vectors -> their 8 horizontal sums, in order. */
static inline __m256i hsum8_i32(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m256i a4, __m256i a5,
                                __m256i a6, __m256i a7) {
    __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    __m256i b2 = _mm256_hadd_epi32(a4, a5), b3 = _mm256_hadd_epi32(a6, a7);
    __m256i c0 = _mm256_hadd_epi32(b0, b1), c1 = _mm256_hadd_epi32(b2, b3);   /* per 128-bit half */
    return _mm256_add_epi32(_mm256_permute2x128_si256(c0, c1, 0x20), _mm256_permute2x128_si256(c0, c1, 0x31));
}

/* Per channel: out[m * NR + n] = sum_k xq[m, k] * w[n, k] (exact, int32 by a16_q's bound). */
static inline __attribute__((always_inline)) void
a16_tile_pc(const int16_t *xq, int64_t ldq, const int8_t *w, int64_t K, int MR, int NR, int32_t *out) {
    __m256i acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256i wv[4];
        for (int n = 0; n < NR; n++) wv[n] = ld_w16(w + n * K + k);
        for (int m = 0; m < MR; m++) {
            __m256i xv = ld_x16(xq + m * ldq + k);
            for (int n = 0; n < NR; n++)
                acc[m * NR + n] = _mm256_add_epi32(acc[m * NR + n], _mm256_madd_epi16(xv, wv[n]));
        }
    }
    _mm256_storeu_si256((__m256i *)out, hsum8_i32(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
    for (; k < K; k++)
        for (int m = 0; m < MR; m++)
            for (int n = 0; n < NR; n++) out[m * NR + n] += (int32_t)xq[m * ldq + k] * w[n * K + k];
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
/* GGUF Q8_0's groups of 32 (G = 32, K % 32 == 0): 4 activation rows x 1 weight row. A group's two
 * vpmaddwd give one int32 vector per row; 4 groups' vectors are folded by 3 vphaddd into one
 * vector whose lanes hold groups g..g+3 (low and high halves), converted once and multiplied by
 * the 4 scales in one FMA, instead of a convert + FMA per group. */
static inline __attribute__((always_inline)) void
a16_tile_g32(const int16_t *xq, int64_t ldq, const int8_t *w, const uint16_t *sc, int64_t K, int MR,
             float *out) {
    __m256 facc[4];
    for (int m = 0; m < MR; m++) facc[m] = _mm256_setzero_ps();
    int64_t ng = K / 32, g = 0;
    for (; g + 4 <= ng; g += 4) {
        const int8_t *wg = w + g * 32;
        __m256i h[4][2];
        for (int half = 0; half < 2; half++) {
            __m256i w0 = ld_w16(wg + 64 * half), w1 = ld_w16(wg + 64 * half + 16);
            __m256i w2 = ld_w16(wg + 64 * half + 32), w3 = ld_w16(wg + 64 * half + 48);
            for (int m = 0; m < MR; m++) {
                const int16_t *xm = xq + m * ldq + g * 32 + 64 * half;
                __m256i v0 = _mm256_add_epi32(_mm256_madd_epi16(ld_x16(xm), w0), _mm256_madd_epi16(ld_x16(xm + 16), w1));
                __m256i v1 = _mm256_add_epi32(_mm256_madd_epi16(ld_x16(xm + 32), w2), _mm256_madd_epi16(ld_x16(xm + 48), w3));
                h[m][half] = _mm256_hadd_epi32(v0, v1);
            }
        }
        __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + g)));
        __m256 sv = _mm256_set_m128(s4, s4);
        for (int m = 0; m < MR; m++)
            facc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(h[m][0], h[m][1])), sv, facc[m]);
    }
    float tail[4] = {0.f, 0.f, 0.f, 0.f};
    for (; g < ng; g++) {                                        /* the last ng % 4 groups */
        __m256i w0 = ld_w16(w + g * 32), w1 = ld_w16(w + g * 32 + 16);
        float s = h2f(sc[g]);
        for (int m = 0; m < MR; m++) {
            const int16_t *xm = xq + m * ldq + g * 32;
            __m256i v = _mm256_add_epi32(_mm256_madd_epi16(ld_x16(xm), w0), _mm256_madd_epi16(ld_x16(xm + 16), w1));
            tail[m] += s * (float)hsum_i32(v);
        }
    }
    for (int m = 0; m < MR; m++) out[m] = hsum(*(v8 *)&facc[m]) + tail[m];
}
#define A16_G32(MR) static void a16_g32_##MR(const int16_t *xq, int64_t ldq, const int8_t *w, \
    const uint16_t *sc, int64_t K, float *out) { a16_tile_g32(xq, ldq, w, sc, K, MR, out); }
A16_G32(1) A16_G32(2) A16_G32(3) A16_G32(4)
typedef void (*a16_g32_fn)(const int16_t *, int64_t, const int8_t *, const uint16_t *, int64_t, float *);
static const a16_g32_fn A16_G32_FN[4] = {a16_g32_1, a16_g32_2, a16_g32_3, a16_g32_4};

#define A16_PC(MR, NR) static void a16_pc_##MR##_##NR(const int16_t *xq, int64_t ldq, const int8_t *w, \
    int64_t K, int32_t *out) { a16_tile_pc(xq, ldq, w, K, MR, NR, out); }
#define A16_MR 4
#define A16_NR 2
A16_PC(1, 1) A16_PC(1, 2) A16_PC(1, 3) A16_PC(1, 4) A16_PC(2, 1) A16_PC(2, 2) A16_PC(2, 3) A16_PC(2, 4)
A16_PC(3, 1) A16_PC(3, 2) A16_PC(4, 1) A16_PC(4, 2)

typedef void (*a16_pc_fn)(const int16_t *, int64_t, const int8_t *, int64_t, int32_t *);
static const a16_pc_fn A16_PC_FN[4][4] = {
    {a16_pc_1_1, a16_pc_1_2, a16_pc_1_3, a16_pc_1_4}, {a16_pc_2_1, a16_pc_2_2, a16_pc_2_3, a16_pc_2_4},
    {a16_pc_3_1, a16_pc_3_2, NULL, NULL}, {a16_pc_4_1, a16_pc_4_2, NULL, NULL}};   /* <= 8 sums */

void w8_gemv_a16(const float *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t G,
                 const float *bias, int64_t N, float *y, int nthreads);   /* below: M = 1 */
void w8_gemv2_a16(const float *x, int64_t ldx, int64_t K, const int8_t *w, const uint16_t *scales,
                  const float *bias, int64_t N, float *y, int64_t ldy, int nthreads);   /* M = 2 */

/* Per output channel (G >= K) or GGUF Q8_0 groups (G = 32, K % 32 == 0); other groups: weight-only. */
void w8_gemm_a16(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                 int64_t G, const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    const int g32 = G == 32 && K % 32 == 0 && K > 32;
    if (M == 1 && (G >= K || g32)) { w8_gemv_a16(x, K, w, scales, G, bias, N, y, nthreads); return; }
    if (M == 2 && G >= K) { w8_gemv2_a16(x, ldx, K, w, scales, bias, N, y, ldy, nthreads); return; }
    if (G < K && !g32) { w8_gemm_f32a(x, M, K, ldx, w, scales, G, bias, N, y, ldy, nthreads); return; }
    const int MR = A16_MR, NR = g32 ? 1 : A16_NR;
    int64_t ng = (K + G - 1) / G;
    int64_t ldq = (K + 15) & ~(int64_t)15, Q = a16_q(K);
    int16_t *xq = aligned_alloc(64, (size_t)((M * ldq * 2 + 63) & ~(int64_t)63));
    float *sx = malloc((size_t)M * sizeof(float));
    a16_quantize(x, ldx, M, K, Q, xq, ldq, sx, nthreads);
    int64_t nb = ((N + nthreads - 1) / nthreads + 11) / 12 * 12;     /* weight rows per thread */
    int64_t nblocks = (N + nb - 1) / nb;
    int64_t mb = (A16_X_BYTES / (2 * ldq)) / MR * MR;               /* activation rows per L2 panel */
    if (mb < MR) mb = MR;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t n_lo = b * nb, n_hi = n_lo + nb < N ? n_lo + nb : N;
        int32_t acc[8];
        for (int64_t m_lo = 0; m_lo < M; m_lo += mb) {
            int64_t m_hi = m_lo + mb < M ? m_lo + mb : M;
            for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR) {   /* NR weight rows stay in L1 ...   */
                int nr = n_hi - n0 < NR ? (int)(n_hi - n0) : NR;
                float ws[A16_NR];
                for (int j = 0; j < nr; j++) ws[j] = g32 ? 1.f : h2f(scales[n0 + j]);
                for (int64_t m0 = m_lo; m0 < m_hi; m0 += MR) {  /* ... for every activation tile */
                    int mr = m_hi - m0 < MR ? (int)(m_hi - m0) : MR;
                    if (g32) {
                        float f[4];
                        A16_G32_FN[mr - 1](xq + m0 * ldq, ldq, w + n0 * K, scales + n0 * ng, K, f);
                        for (int i = 0; i < mr; i++) y[(m0 + i) * ldy + n0] = f[i] * sx[m0 + i] + (bias ? bias[n0] : 0.f);
                        continue;
                    }
                    A16_PC_FN[mr - 1][nr - 1](xq + m0 * ldq, ldq, w + n0 * K, K, acc);
                    for (int i = 0; i < mr; i++)
                        for (int j = 0; j < nr; j++)
                            y[(m0 + i) * ldy + n0 + j] = (float)acc[i * nr + j] * (ws[j] * sx[m0 + i])
                                                         + (bias ? bias[n0 + j] : 0.f);
                }
            }
        }
    }
    free(xq);
    free(sx);
}

/* One activation row (decode at 1 stream; issue 16, fourth round). Bound by weight bytes, and
 * there the weight-only loop (vpmovsxbd + vcvtdq2ps + scale + FMA per 8 weights) was arithmetic-
 * bound at ~12 GB/s of int8 per channel (7.6 GB/s with groups of 32) on this Zen 3. Here: the row
 * quantized to int16 as above, then per 16 weights one vpmovsxbw + vpmaddwd + vpaddd. Per channel,
 * 4 weight rows at once taken from the 4 quarters of the row range (4 DRAM streams side by side,
 * each int16 x vector loaded once for the 4): ~20-22 GB/s on SmolLM2's 135 M int8 weights,
 * 1.6-1.75x; groups of 32: a16_g32_1 row by row in the same 4-stream order, ~16 GB/s, 2.1x
 * (docs/quantization.md). */
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
            a16_g32_1(xq, ldq, w + n * K, scales + n * ng, K, &f);
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
#else
void w8_set_a16_min_m(int64_t m) { (void)m; }
int64_t w8_a16_min_m(void) { return 0; }
void w8_gemm_a16(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                 int64_t G, const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    w8_gemm_f32a(x, M, K, ldx, w, scales, G, bias, N, y, ldy, nthreads);
}
#endif

/* The entry point (QuantLinear's CPU path and the fused decode step): int16 activations from
 * a16_min_m rows on (AVX2 builds; tolerance in docs/quantization.md), else weight-only. */
void w8_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
             int64_t G, const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
#ifdef __AVX2__
    /* int16 activations (w8_gemm_a16 routes 1 row and, per channel, 2 rows to its GEMVs) for
     * per-channel or Q8_0-grouped weights at 1-2 rows and from a16_min_m rows on */
    const int rows_ok = M == 1 || (M == 2 && G >= K) || M >= a16_min_m;
    if (a16_min_m > 0 && rows_ok && (G >= K || (G == 32 && K % 32 == 0 && K > 32))) {
        w8_gemm_a16(x, M, K, ldx, w, scales, G, bias, N, y, ldy, nthreads);
        return;
    }
#endif
    w8_gemm_f32a(x, M, K, ldx, w, scales, G, bias, N, y, ldy, nthreads);
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
