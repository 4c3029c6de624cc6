/* int8 in groups of 32 on a layout packed at load time, x int16 activations (issue 28: M >= 2).
 *
 * Why: the row-major tiles (w8_avx512.c, w8_a16.c) keep one group of one weight row per vector, so
 * every 32 multiply-adds cost a vpmaddwd, a vcvtdq2ps and an FMA with the group's scale. Packed,
 * one vector holds 16 output columns: each int32 lane accumulates its own column over the group's
 * 16 input pairs (vpdpwssd, int16 pairs x int16 pairs, exact), and only then is converted and
 * scaled, once per group for 16 columns. No horizontal sums; the activation pair is a broadcast.
 *
 * Layout (w8_pack_g32, one buffer, 64-byte aligned, what the caller passes as ``w`` with
 * G = W8_PACKED_G to w8_gemm):
 *   header   w8p_hdr (64 bytes): N, K, the row-major int8 weight and fp16 scales it was packed from
 *            (the GEMVs still read those at M < p_min_m)
 * A column slice starting at block b0 (columns 16 b0 ..) is G = W8_PACKED_G - b0 (quant_cpu.h).
 *   weights  int8 [NB][K/2][16][2], NB = ceil(N/16): wp[b][p][c][i] = w[16 b + c][2 p + i]
 *            (columns past N are zero)
 *   scales   fp32 [NB][K/32][16]: sp[b][g][c] = scales[16 b + c][g]
 *
 * Numerics: those of the row-major int16 kernels (each activation row rounded to int16 once per
 * call, sx = max|x[m]| / Q, Q = a16_q(K); exact int32 group sums, fp32 across groups; summation
 * order over groups: sequential per output), so the contract in docs/quantization.md holds as is.
 * AVX-512BW builds run 16 columns per zmm (vpdpwssd where the build has AVX512-VNNI, else
 * vpmaddwd + vpaddd); AVX2 builds run the same layout as two ymm halves (vpmaddwd + vpaddd).
 */
#include "quant_cpu.h"
#ifdef __AVX2__

#define P_X_BYTES (192 << 10)     /* int16 activation panel kept in L2 while weight blocks stream */

int64_t w8_packed_bytes(int64_t N, int64_t K) {
    int64_t nb = (N + 15) / 16;
    return (int64_t)sizeof(w8p_hdr) + nb * 16 * K + nb * (K / 32) * 16 * (int64_t)sizeof(float);
}

/* w int8 [N, K], scales fp16 [N, K/32] (K % 32 == 0) -> buf (w8_packed_bytes(N, K) bytes). */
void w8_pack_g32(const int8_t *w, const uint16_t *scales, int64_t N, int64_t K, uint8_t *buf) {
    w8p_hdr *h = (w8p_hdr *)buf;
    int64_t nb = (N + 15) / 16, ng = K / 32, kp = K / 2;
    h->N = N; h->K = K; h->w = w; h->scales = scales;
    int8_t *wp = w8p_weights(h);
    float *sp = w8p_scales(h);
    for (int64_t b = 0; b < nb; b++)
        for (int64_t p = 0; p < kp; p++)
            for (int64_t c = 0; c < 16; c++) {
                int64_t n = 16 * b + c;
                int8_t *d = wp + ((b * kp + p) * 16 + c) * 2;
                d[0] = n < N ? w[n * K + 2 * p] : 0;
                d[1] = n < N ? w[n * K + 2 * p + 1] : 0;
            }
    for (int64_t b = 0; b < nb; b++)
        for (int64_t g = 0; g < ng; g++)
            for (int64_t c = 0; c < 16; c++) {
                int64_t n = 16 * b + c;
                sp[(b * ng + g) * 16 + c] = n < N ? h2f(scales[n * ng + g]) : 0.f;
            }
}

static inline int32_t ld_pair(const int16_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define P_MR 6                    /* activation rows per tile */
#define P_NB 2                    /* 16-column blocks per tile: 12 int32 + 12 fp32 accumulators */
#define P_W 16                    /* columns per block vector */
#ifdef __AVX512VNNI__
#define P_DP(a, x, w) _mm512_dpwssd_epi32(a, x, w)
#else
#define P_DP(a, x, w) _mm512_add_epi32(a, _mm512_madd_epi16(x, w))
#endif

/* f[m * NB + b] (16 columns of block b, row m) = sum_g sp[b, g, :] * sum_{pairs of g} xq . wp. */
static inline __attribute__((always_inline)) void
p_tile(const int16_t *xq, int64_t ldq, const int8_t *wp, const float *sp, int64_t K, int MR, int NB, __m512 *f) {
    const int64_t ng = K / 32, bw = 16 * K;           /* bytes per block of weights */
    for (int i = 0; i < MR * NB; i++) f[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i acc[P_MR * P_NB];
        const int8_t *wg = wp + g * 16 * 32;
        #pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            __m512i wv[P_NB];
            for (int b = 0; b < NB; b++)
                wv[b] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wg + b * bw + 32 * j)));
            for (int m = 0; m < MR; m++) {
                __m512i xv = _mm512_set1_epi32(ld_pair(xq + m * ldq + 32 * g + 2 * j));
                for (int b = 0; b < NB; b++)
                    acc[m * NB + b] = j ? P_DP(acc[m * NB + b], xv, wv[b]) : _mm512_madd_epi16(xv, wv[b]);
            }
        }
        for (int b = 0; b < NB; b++) {
            __m512 sv = _mm512_loadu_ps(sp + (b * ng + g) * 16);
            for (int m = 0; m < MR; m++)
                f[m * NB + b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m * NB + b]), sv, f[m * NB + b]);
        }
    }
}

/* rows m0.. of y: f * sx[m] + bias for the block's columns that exist (n < N) */
static inline void p_store(const __m512 *f, int MR, int NB, const float *sx, const float *bias, int64_t n0,
                           int64_t N, float *y, int64_t ldy) {
    for (int b = 0; b < NB; b++) {
        int64_t c0 = n0 + 16 * b, nc = N - c0 < 16 ? N - c0 : 16;
        if (nc <= 0) continue;
        __mmask16 k = (__mmask16)((1u << nc) - 1);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + c0) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++)
            _mm512_mask_storeu_ps(y + m * ldy + c0, k, _mm512_fmadd_ps(f[m * NB + b], _mm512_set1_ps(sx[m]), bv));
    }
}

#define P_TILE(MR, NB) static void p_tile_##MR##_##NB(const int16_t *xq, int64_t ldq, const int8_t *wp, \
    const float *sp, int64_t K, const float *sx, const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) { \
    __m512 f[MR * NB]; p_tile(xq, ldq, wp, sp, K, MR, NB, f); p_store(f, MR, NB, sx, bias, n0, N, y, ldy); }
#else                                         /* AVX2: a block is two ymm halves of 8 columns */
#define P_MR 2
#define P_NB 1
#define P_W 16

static inline __attribute__((always_inline)) void
p_tile(const int16_t *xq, int64_t ldq, const int8_t *wp, const float *sp, int64_t K, int MR, int NB, __m256 *f) {
    const int64_t ng = K / 32, bw = 16 * K;
    for (int i = 0; i < 2 * MR * NB; i++) f[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256i acc[2 * P_MR * P_NB];
        for (int i = 0; i < 2 * MR * NB; i++) acc[i] = _mm256_setzero_si256();
        const int8_t *wg = wp + g * 16 * 32;
        #pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            __m256i wv[2 * P_NB];
            for (int b = 0; b < NB; b++) {
                wv[2 * b] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + b * bw + 32 * j)));
                wv[2 * b + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + b * bw + 32 * j + 16)));
            }
            for (int m = 0; m < MR; m++) {
                __m256i xv = _mm256_set1_epi32(ld_pair(xq + m * ldq + 32 * g + 2 * j));
                for (int h = 0; h < 2 * NB; h++)
                    acc[2 * m * NB + h] = _mm256_add_epi32(acc[2 * m * NB + h], _mm256_madd_epi16(xv, wv[h]));
            }
        }
        for (int h = 0; h < 2 * NB; h++) {
            __m256 sv = _mm256_loadu_ps(sp + ((h / 2) * ng + g) * 16 + 8 * (h % 2));
            for (int m = 0; m < MR; m++)
                f[2 * m * NB + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[2 * m * NB + h]), sv, f[2 * m * NB + h]);
        }
    }
}

static inline void p_store(const __m256 *f, int MR, int NB, const float *sx, const float *bias, int64_t n0,
                           int64_t N, float *y, int64_t ldy) {
    for (int h = 0; h < 2 * NB; h++) {
        int64_t c0 = n0 + 8 * h;
        float t[8];
        for (int m = 0; m < MR; m++) {
            _mm256_storeu_ps(t, f[2 * m * NB + h]);
            for (int64_t c = 0; c < 8 && c0 + c < N; c++)
                y[m * ldy + c0 + c] = t[c] * sx[m] + (bias ? bias[c0 + c] : 0.f);
        }
    }
}

#define P_TILE(MR, NB) static void p_tile_##MR##_##NB(const int16_t *xq, int64_t ldq, const int8_t *wp, \
    const float *sp, int64_t K, const float *sx, const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) { \
    __m256 f[2 * MR * NB]; p_tile(xq, ldq, wp, sp, K, MR, NB, f); p_store(f, MR, NB, sx, bias, n0, N, y, ldy); }
#endif

typedef void (*p_tile_fn)(const int16_t *, int64_t, const int8_t *, const float *, int64_t, const float *,
                          const float *, int64_t, int64_t, float *, int64_t);
#if P_MR == 6
P_TILE(1, 1) P_TILE(2, 1) P_TILE(3, 1) P_TILE(4, 1) P_TILE(5, 1) P_TILE(6, 1)
P_TILE(1, 2) P_TILE(2, 2) P_TILE(3, 2) P_TILE(4, 2) P_TILE(5, 2) P_TILE(6, 2)
static const p_tile_fn P_FN[P_MR][P_NB] = {{p_tile_1_1, p_tile_1_2}, {p_tile_2_1, p_tile_2_2},
    {p_tile_3_1, p_tile_3_2}, {p_tile_4_1, p_tile_4_2}, {p_tile_5_1, p_tile_5_2}, {p_tile_6_1, p_tile_6_2}};
#else
P_TILE(1, 1) P_TILE(2, 1)
static const p_tile_fn P_FN[P_MR][P_NB] = {{p_tile_1_1}, {p_tile_2_1}};
#endif

/* Blocks [b_lo, b_hi) (relative to the slice's first block, wp / sp already there) of y [M, N] from
 * xq (int16 rows, scales sx), on the calling thread. */
static void p_blocks(const int16_t *xq, int64_t ldq, const float *sx, int64_t M, int64_t K, const int8_t *wp,
                     const float *sp, const float *bias, int64_t N, float *y, int64_t ldy, int64_t b_lo, int64_t b_hi) {
    int64_t ng = K / 32, mb = (P_X_BYTES / (2 * ldq)) / P_MR * P_MR;   /* activation rows per L2 panel */
    if (mb < P_MR) mb = P_MR;
    for (int64_t m_lo = 0; m_lo < M; m_lo += mb) {
        int64_t m_hi = m_lo + mb < M ? m_lo + mb : M;
        for (int64_t b0 = b_lo; b0 < b_hi; b0 += P_NB) {             /* P_NB blocks stay in L1/L2 ... */
            int nbk = b_hi - b0 < P_NB ? (int)(b_hi - b0) : P_NB;
            for (int64_t m0 = m_lo; m0 < m_hi; m0 += P_MR) {           /* ... for every activation tile */
                int mr = m_hi - m0 < P_MR ? (int)(m_hi - m0) : P_MR;
                P_FN[mr - 1][nbk - 1](xq + m0 * ldq, ldq, wp + b0 * 16 * K, sp + b0 * ng * 16, K, sx + m0, bias,
                                      16 * b0, N, y + m0 * ldy, ldy);
            }
        }
    }
}

/* y [M, N] = x [M, K] . W^T (+ bias) for the packed weight's columns [16 b0, 16 b0 + N) (a slice:
 * y and bias index its own columns from 0), on nthreads OpenMP threads (1: none); any M >= 1. Each
 * output's arithmetic does not depend on the slice or the threads. */
void w8_gemm_packed(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *buf, int64_t b0,
                    const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    const w8p_hdr *h = (const w8p_hdr *)buf;
    int64_t ldq = K, nb = (N + 15) / 16;
    if (nb <= 0) return;
    const int8_t *wp = w8p_weights(h) + b0 * 16 * K;
    const float *sp = w8p_scales(h) + b0 * (K / 32) * 16;
    int16_t *xq = aligned_alloc(64, (size_t)((M * ldq * 2 + 63) & ~(int64_t)63));
    float *sx = malloc((size_t)M * sizeof(float));
    a16_quantize(x, ldx, M, K, a16_q(K), xq, ldq, sx, nthreads);
    int64_t bpt = ((nb + nthreads - 1) / nthreads + P_NB - 1) / P_NB * P_NB;   /* blocks per thread */
    int64_t nchunks = (nb + bpt - 1) / bpt;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nchunks > 1)
    for (int64_t t = 0; t < nchunks; t++) {
        int64_t b_lo = t * bpt, b_hi = b_lo + bpt < nb ? b_lo + bpt : nb;
        p_blocks(xq, ldq, sx, M, K, wp, sp, bias, N, y, ldy, b_lo, b_hi);
    }
    free(xq);
    free(sx);
}
#endif
