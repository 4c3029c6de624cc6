/* int8 weights x int16 activations (M >= a16_min_m; per channel, or G = 32), AVX2.
 *
 * With several activation rows the weight-only loops (w8_f32a.c) are bound by arithmetic, not by weight
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
#include "quant_cpu.h"
#ifdef __AVX2__
#define A16_X_BYTES (192 << 10)   /* int16 activation panel kept in L2 while weight rows stream */

/* x [M, K] -> xq [M, ldq] int16 (tail zeroed), sx[m] = max|x[m]| / Q. */
void a16_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t Q, int16_t *xq,
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

void a16_g32_row(const int16_t *xq, const int8_t *w, const uint16_t *sc, int64_t K, float *out) {
    a16_g32_1(xq, 0, w, sc, K, out);
}

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
#endif
