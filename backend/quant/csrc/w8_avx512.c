/* int8 in groups of 32 (llama.cpp Q8_0's layout, the quantization=int8 default) x int16
 * activations on AVX-512BW: the same numerics as w8_a16.c (each activation row rounded to int16
 * once per call, sx = max|x[m]| / Q, exact int32 products), 512-bit wide.
 *
 * One group of 32 inputs is exactly one zmm of int16: vpmaddwd (x, widened w) gives 16 int32 lanes
 * that all belong to group g, so no horizontal fold is needed (the AVX2 tile folds 4 groups with
 * vphaddd): vcvtdq2ps + one FMA with the group's scale (broadcast from an fp32 copy of the NR rows'
 * scales, converted once per row block) accumulates into fp32 lanes, reduced once per output.
 * Tile: Z_MR activation rows x Z_NR weight rows (16 fp32 accumulators, 4 widened weight vectors:
 * no spills in 32 zmm registers); weight rows stay in L1 while every activation tile of an L2 panel
 * passes over them, as in w8_a16.c. One row (decode at 1 stream): 4 weight rows per pass taken from
 * the 4 quarters of the row range (4 DRAM streams side by side, each int16 x vector loaded once
 * for the 4), as the AVX2 GEMV does per channel. Chosen by w8_gemm.c where the build has
 * __AVX512BW__ (-march=native: the host's own features). Measurements: docs/quantization.md.
 */
#include "quant_cpu.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Z_MR 4
#define Z_NR 4
#define Z_X_BYTES (192 << 10)     /* int16 activation panel kept in L2 while weight rows stream */
#define Z_NG_STACK 512            /* groups per row with scales converted on the stack (K <= 16384) */

int w8_has_avx512(void) { return 1; }

static inline __m512i zld_w16(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }

/* fp16 scales of nr rows (row stride ng) -> fp32 ws [nr][ng] */
static void z_scales(const uint16_t *sc, int64_t ng, int nr, float *ws) {
    for (int n = 0; n < nr; n++) {
        int64_t g = 0;
        for (; g + 16 <= ng; g += 16)
            _mm512_storeu_ps(ws + n * ng + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + n * ng + g))));
        for (; g < ng; g++) ws[n * ng + g] = h2f(sc[n * ng + g]);
    }
}

/* out[m * NR + n] = sum_g ws[n, g] * sum_{k in g} xq[m, k] w[n, k] (fp32 over groups). */
static inline __attribute__((always_inline)) void
z_tile(const int16_t *xq, int64_t ldq, const int8_t *w, int64_t K, const float *ws, int MR, int NR, float *out) {
    int64_t ng = K / 32;
    __m512 f[Z_MR * Z_NR];
    for (int i = 0; i < MR * NR; i++) f[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i wv[Z_NR];
        for (int n = 0; n < NR; n++) wv[n] = zld_w16(w + n * K + 32 * g);
        for (int m = 0; m < MR; m++) {
            __m512i xv = _mm512_loadu_si512((const void *)(xq + m * ldq + 32 * g));
            for (int n = 0; n < NR; n++)
                f[m * NR + n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(xv, wv[n])),
                                                _mm512_set1_ps(ws[n * ng + g]), f[m * NR + n]);
        }
    }
    for (int i = 0; i < MR * NR; i++) out[i] = _mm512_reduce_add_ps(f[i]);
}
#define Z_TILE(MR, NR) static void z_tile_##MR##_##NR(const int16_t *xq, int64_t ldq, const int8_t *w, \
    int64_t K, const float *ws, float *out) { z_tile(xq, ldq, w, K, ws, MR, NR, out); }
Z_TILE(1, 1) Z_TILE(1, 2) Z_TILE(1, 3) Z_TILE(1, 4) Z_TILE(2, 1) Z_TILE(2, 2) Z_TILE(2, 3) Z_TILE(2, 4)
Z_TILE(3, 1) Z_TILE(3, 2) Z_TILE(3, 3) Z_TILE(3, 4) Z_TILE(4, 1) Z_TILE(4, 2) Z_TILE(4, 3) Z_TILE(4, 4)
typedef void (*z_tile_fn)(const int16_t *, int64_t, const int8_t *, int64_t, const float *, float *);
static const z_tile_fn Z_FN[4][4] = {{z_tile_1_1, z_tile_1_2, z_tile_1_3, z_tile_1_4},
                                     {z_tile_2_1, z_tile_2_2, z_tile_2_3, z_tile_2_4},
                                     {z_tile_3_1, z_tile_3_2, z_tile_3_3, z_tile_3_4},
                                     {z_tile_4_1, z_tile_4_2, z_tile_4_3, z_tile_4_4}};

/* y [M, N] = x [M, K] . W^T (+ bias); G = 32, K % 32 == 0, any M >= 1. */
void w8_gemm_g32_z(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                   const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    int64_t ng = K / 32, ldq = K;                                   /* K % 32 == 0: rows stay 64-byte multiples */
    int16_t *xq = aligned_alloc(64, (size_t)((M * ldq * 2 + 63) & ~(int64_t)63));
    float *sx = malloc((size_t)M * sizeof(float));
    a16_quantize(x, ldx, M, K, a16_q(K), xq, ldq, sx, nthreads);
    int64_t nb = ((N + nthreads - 1) / nthreads + Z_NR - 1) / Z_NR * Z_NR;   /* weight rows per thread */
    int64_t nblocks = (N + nb - 1) / nb;
    int64_t mb = (Z_X_BYTES / (2 * ldq)) / Z_MR * Z_MR;            /* activation rows per L2 panel */
    if (mb < Z_MR) mb = Z_MR;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t n_lo = b * nb, n_hi = n_lo + nb < N ? n_lo + nb : N;
        float stack[Z_NR * Z_NG_STACK], *ws = ng <= Z_NG_STACK ? stack : malloc((size_t)(Z_NR * ng) * sizeof(float));
        float acc[Z_MR * Z_NR];
        for (int64_t m_lo = 0; m_lo < M; m_lo += mb) {
            int64_t m_hi = m_lo + mb < M ? m_lo + mb : M;
            for (int64_t n0 = n_lo; n0 < n_hi; n0 += Z_NR) {       /* Z_NR weight rows stay in L1 ... */
                int nr = n_hi - n0 < Z_NR ? (int)(n_hi - n0) : Z_NR;
                z_scales(scales + n0 * ng, ng, nr, ws);
                for (int64_t m0 = m_lo; m0 < m_hi; m0 += Z_MR) {     /* ... for every activation tile */
                    int mr = m_hi - m0 < Z_MR ? (int)(m_hi - m0) : Z_MR;
                    Z_FN[mr - 1][nr - 1](xq + m0 * ldq, ldq, w + n0 * K, K, ws, acc);
                    for (int i = 0; i < mr; i++)
                        for (int j = 0; j < nr; j++)
                            y[(m0 + i) * ldy + n0 + j] = acc[i * nr + j] * sx[m0 + i] + (bias ? bias[n0 + j] : 0.f);
                }
            }
        }
        if (ws != stack) free(ws);
    }
    free(xq);
    free(sx);
}

/* nr weight rows (row pointers wr) x one int16 row: fp32 sums over groups into out[nr]. */
static inline __attribute__((always_inline)) void
z_rows(const int16_t *xq, const int8_t *const *wr, const float *ws, int64_t ng, int nr, float *out) {
    __m512 f[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < ng; g++) {
        __m512i xv = _mm512_loadu_si512((const void *)(xq + 32 * g));
        for (int j = 0; j < nr; j++)
            f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(xv, zld_w16(wr[j] + 32 * g))),
                                   _mm512_set1_ps(ws[j * ng + g]), f[j]);
    }
    for (int j = 0; j < nr; j++) out[j] = _mm512_reduce_add_ps(f[j]);
}

/* One row: 4 weight rows per pass from the 4 quarters of N (4 DRAM streams), x loaded once for 4. */
void w8_gemv_g32_z(const float *x, int64_t K, const int8_t *w, const uint16_t *scales, const float *bias,
                   int64_t N, float *y, int nthreads) {
    int64_t ng = K / 32, qn = N / 4;
    int16_t stack[4096], *xq = K <= 4096 ? stack : malloc((size_t)K * sizeof(int16_t));
    float sx;
    a16_quantize(x, K, 1, K, a16_q(K), xq, K, &sx, 1);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < qn + (N - 4 * qn); i++) {
        float wst[4 * Z_NG_STACK], *ws = ng <= Z_NG_STACK ? wst : malloc((size_t)(4 * ng) * sizeof(float));
        int64_t rows[4] = {i, qn + i, 2 * qn + i, 3 * qn + i};
        int nr = 4;
        if (i >= qn) { rows[0] = 4 * qn + (i - qn); nr = 1; }      /* the N % 4 rest, one row each */
        const int8_t *wr[4];
        float out[4];
        for (int j = 0; j < nr; j++) {
            wr[j] = w + rows[j] * K;
            z_scales(scales + rows[j] * ng, ng, 1, ws + j * ng);
        }
        if (nr == 4) z_rows(xq, wr, ws, ng, 4, out);
        else z_rows(xq, wr, ws, ng, 1, out);
        for (int j = 0; j < nr; j++) y[rows[j]] = out[j] * sx + (bias ? bias[rows[j]] : 0.f);
        if (ws != wst) free(ws);
    }
    if (xq != stack) free(xq);
}
#else
int w8_has_avx512(void) { return 0; }
#endif
