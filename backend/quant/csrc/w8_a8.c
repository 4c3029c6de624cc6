/* EXPERIMENT (issue 28, rejected: docs/kernels.md "Tried and rejected"): int8 weights x int8
 * activations in groups of 32 (W8A8, llama.cpp Q8_0 x Q8_0's numerics), on a layout packed at load,
 * where the build has AVX512-VNNI. 1.55-1.6x the int16-activation packed tiles per GEMM, but greedy
 * agreement with fp32 0.31 on SmolLM2 (goal 0.65).
 *
 * Numerics: activations per row m and group g of 32 inputs, amax = max |x|, id = 127 / amax
 * (0 for amax 0), q = round-half-even(x * id), sa[m, g] = amax / 127; y[m, n] = sum over g in order
 * of fma(float(isum), sw[n, g] * sa[m, g], acc), isum the exact int32 dot of the group; + bias.
 * vpdpbusd takes one unsigned operand: weights stored as w + 128, corrected by -128 * sum q.
 *
 * Layout: w8p_hdr (kind W8P_KIND_A8), weights u8 [NB][K/4][16][4] = w + 128, scales fp16 [NB][K/32][16].
 */
#include "quant_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define A8_MR 6
#define A8_NB 2
#define A8_X_BYTES (128 << 10)

int w8a8_available(void) { return 1; }

int64_t w8a8_packed_bytes(int64_t N, int64_t K) {
    if (K % 32) return 0;
    int64_t nb = (N + 15) / 16;
    return (int64_t)sizeof(w8p_hdr) + nb * 16 * K + nb * (K / 32) * 16 * (int64_t)sizeof(uint16_t);
}

void w8a8_pack(const int8_t *w, const uint16_t *scales, int64_t N, int64_t K, uint8_t *buf) {
    w8p_hdr *h = (w8p_hdr *)buf;
    memset(h, 0, sizeof *h);
    h->N = N; h->K = K; h->w = w; h->scales = scales; h->kind = W8P_KIND_A8;
    const int64_t nb = (N + 15) / 16, ng = K / 32, kp = K / 4;
    uint8_t *wp = (uint8_t *)w8p_weights(h);
    uint16_t *sp = (uint16_t *)(wp + nb * 16 * K);
    for (int64_t b = 0; b < nb; b++)
        for (int64_t p = 0; p < kp; p++)
            for (int64_t c = 0; c < 16; c++) {
                const int64_t n = 16 * b + c;
                uint8_t *d = wp + ((b * kp + p) * 16 + c) * 4;
                for (int i = 0; i < 4; i++) d[i] = (uint8_t)((n < N ? w[n * K + 4 * p + i] : 0) + 128);
            }
    for (int64_t b = 0; b < nb; b++)
        for (int64_t g = 0; g < ng; g++)
            for (int64_t c = 0; c < 16; c++) {
                const int64_t n = 16 * b + c;
                sp[(b * ng + g) * 16 + c] = n < N ? scales[n * ng + g] : 0;
            }
}

static void a8_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *sa, int32_t *corr,
                        int nthreads) {
    const int64_t ng = K / 32;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            const float *r = x + m * ldx + 32 * g;
            const __m512 a = _mm512_loadu_ps(r), b = _mm512_loadu_ps(r + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
            const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
            _mm_storeu_si128((__m128i *)(xq + m * K + 32 * g), _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(xq + m * K + 32 * g + 16), _mm512_cvtepi32_epi8(qb));
            sa[m * ng + g] = amax / 127.f;
            corr[m * ng + g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        }
}

static inline int32_t ld4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

static inline __attribute__((always_inline)) void
a8_tile(const int8_t *xq, const float *sa, const int32_t *corr, const uint8_t *wp, const uint16_t *sp, int64_t K,
        int MR, int NB, __m512 *f) {
    const int64_t ng = K / 32, bw = 16 * K;
    for (int i = 0; i < MR * NB; i++) f[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i acc[A8_MR * A8_NB];
        for (int m = 0; m < MR; m++) {
            const __m512i c = _mm512_set1_epi32(corr[m * ng + g]);
            for (int b = 0; b < NB; b++) acc[m * NB + b] = c;
        }
        const uint8_t *wg = wp + g * 16 * 32;
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512i wv[A8_NB];
            for (int b = 0; b < NB; b++) wv[b] = _mm512_loadu_si512(wg + b * bw + 64 * j);
            for (int m = 0; m < MR; m++) {
                const __m512i xv = _mm512_set1_epi32(ld4(xq + m * K + 32 * g + 4 * j));
                for (int b = 0; b < NB; b++) acc[m * NB + b] = _mm512_dpbusd_epi32(acc[m * NB + b], wv[b], xv);
            }
        }
        for (int b = 0; b < NB; b++) {
            const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + (b * ng + g) * 16)));
            for (int m = 0; m < MR; m++)
                f[m * NB + b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m * NB + b]),
                                                _mm512_mul_ps(sv, _mm512_set1_ps(sa[m * ng + g])), f[m * NB + b]);
        }
    }
}

static inline void a8_store(const __m512 *f, int MR, int NB, const float *bias, int64_t n0, int64_t N, float *y,
                            int64_t ldy) {
    for (int b = 0; b < NB; b++) {
        const int64_t c0 = n0 + 16 * b, nc = N - c0 < 16 ? N - c0 : 16;
        if (nc <= 0) continue;
        const __mmask16 k = (__mmask16)((1u << nc) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + c0) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) _mm512_mask_storeu_ps(y + m * ldy + c0, k, _mm512_add_ps(f[m * NB + b], bv));
    }
}

typedef void (*a8_fn)(const int8_t *, const float *, const int32_t *, const uint8_t *, const uint16_t *, int64_t,
                      const float *, int64_t, int64_t, float *, int64_t);
#define A8_TILE(MR, NB) static void a8_tile_##MR##_##NB(const int8_t *xq, const float *sa, const int32_t *corr, \
    const uint8_t *wp, const uint16_t *sp, int64_t K, const float *bias, int64_t n0, int64_t N, float *y, int64_t ldy) { \
    __m512 f[MR * NB]; a8_tile(xq, sa, corr, wp, sp, K, MR, NB, f); a8_store(f, MR, NB, bias, n0, N, y, ldy); }
A8_TILE(1, 1) A8_TILE(2, 1) A8_TILE(3, 1) A8_TILE(4, 1) A8_TILE(5, 1) A8_TILE(6, 1)
A8_TILE(1, 2) A8_TILE(2, 2) A8_TILE(3, 2) A8_TILE(4, 2) A8_TILE(5, 2) A8_TILE(6, 2)
static const a8_fn A8_FN[A8_MR][A8_NB] = {{a8_tile_1_1, a8_tile_1_2}, {a8_tile_2_1, a8_tile_2_2},
    {a8_tile_3_1, a8_tile_3_2}, {a8_tile_4_1, a8_tile_4_2}, {a8_tile_5_1, a8_tile_5_2}, {a8_tile_6_1, a8_tile_6_2}};

static void a8_blocks(const int8_t *xq, const float *sa, const int32_t *corr, int64_t M, int64_t K, const uint8_t *wp,
                      const uint16_t *sp, const float *bias, int64_t N, float *y, int64_t ldy, int64_t b_lo,
                      int64_t b_hi) {
    const int64_t ng = K / 32;
    int64_t mb = (A8_X_BYTES / K) / A8_MR * A8_MR;
    if (mb < A8_MR) mb = A8_MR;
    for (int64_t m_lo = 0; m_lo < M; m_lo += mb) {
        const int64_t m_hi = m_lo + mb < M ? m_lo + mb : M;
        for (int64_t b0 = b_lo; b0 < b_hi; b0 += A8_NB) {
            const int nbk = b_hi - b0 < A8_NB ? (int)(b_hi - b0) : A8_NB;
            for (int64_t m0 = m_lo; m0 < m_hi; m0 += A8_MR) {
                const int mr = m_hi - m0 < A8_MR ? (int)(m_hi - m0) : A8_MR;
                A8_FN[mr - 1][nbk - 1](xq + m0 * K, sa + m0 * ng, corr + m0 * ng, wp + b0 * 16 * K,
                                       sp + b0 * ng * 16, K, bias, 16 * b0, N, y + m0 * ldy, ldy);
            }
        }
    }
}

void w8a8_gemm_packed(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *buf, int64_t b0,
                      const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    const w8p_hdr *h = (const w8p_hdr *)buf;
    const int64_t nb = (N + 15) / 16, ng = K / 32, nb_all = (h->N + 15) / 16;
    if (nb <= 0 || M <= 0) return;
    const uint8_t *wp = (const uint8_t *)w8p_weights(h) + b0 * 16 * K;
    const uint16_t *sp = (const uint16_t *)((const uint8_t *)w8p_weights(h) + nb_all * 16 * K) + b0 * ng * 16;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) & ~(int64_t)63));
    float *sa = malloc((size_t)(M * ng) * sizeof(float));
    int32_t *corr = malloc((size_t)(M * ng) * sizeof(int32_t));
    a8_quantize(x, ldx, M, K, xq, sa, corr, nthreads);
    const int64_t bpt = ((nb + nthreads - 1) / nthreads + A8_NB - 1) / A8_NB * A8_NB;
    const int64_t nchunks = (nb + bpt - 1) / bpt;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nchunks > 1)
    for (int64_t t = 0; t < nchunks; t++) {
        const int64_t b_lo = t * bpt, b_hi = b_lo + bpt < nb ? b_lo + bpt : nb;
        a8_blocks(xq, sa, corr, M, K, wp, sp, bias, N, y, ldy, b_lo, b_hi);
    }
    free(xq);
    free(sa);
    free(corr);
}
#else
int w8a8_available(void) { return 0; }
int64_t w8a8_packed_bytes(int64_t N, int64_t K) { (void)N; (void)K; return 0; }
void w8a8_pack(const int8_t *w, const uint16_t *scales, int64_t N, int64_t K, uint8_t *buf) {
    (void)w; (void)scales; (void)N; (void)K; (void)buf;
}
void w8a8_gemm_packed(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *buf, int64_t b0,
                      const float *bias, int64_t N, float *y, int64_t ldy, int nthreads) {
    (void)x; (void)M; (void)K; (void)ldx; (void)buf; (void)b0; (void)bias; (void)N; (void)y; (void)ldy;
    (void)nthreads;
}
#endif
