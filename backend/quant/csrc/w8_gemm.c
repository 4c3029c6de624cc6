/* The int8 entry point (QuantLinear's CPU path and the fused decode step): which kernel runs. */
#include "quant_cpu.h"

#ifdef __AVX2__
static int64_t a16_min_m = 5;        /* backend/quant/cpu.py sets it at load */
void w8_set_a16_min_m(int64_t m) { a16_min_m = m; }   /* 0: never (weight-only loops for every M) */
int64_t w8_a16_min_m(void) { return a16_min_m; }
static int64_t packed_min_m = 2;     /* packed layout from this many rows (backend/quant/cpu.py sets it) */
void w8_set_packed_min_m(int64_t m) { packed_min_m = m; }
int64_t w8_packed_min_m(void) { return packed_min_m; }
#else
void w8_set_packed_min_m(int64_t m) { (void)m; }
int64_t w8_packed_min_m(void) { return 0; }
int64_t w8_packed_bytes(int64_t N, int64_t K) { (void)N; (void)K; return 0; }   /* no packed layout */
void w8_pack_g32(const int8_t *w, const uint16_t *scales, int64_t N, int64_t K, uint8_t *buf) {
    (void)w; (void)scales; (void)N; (void)K; (void)buf;
}
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
    if (G <= W8_PACKED_G) {        /* w8_pack_g32's buffer, or its slice from block b0 (quant_cpu.h) */
        const w8p_hdr *h = (const w8p_hdr *)w;
        const int64_t b0 = W8_PACKED_G - G;
#ifdef __AVX2__
        if (a16_min_m > 0 && packed_min_m > 0 && M >= packed_min_m) {
            w8_gemm_packed(x, M, K, ldx, (const uint8_t *)w, b0, bias, N, y, ldy, nthreads);
            return;
        }
#endif
        /* the row-major copy (GEMVs, weight-only loops): the slice's rows */
        w = h->w + 16 * b0 * K, scales = h->scales + 16 * b0 * (K / 32), G = 32;
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (a16_min_m > 0 && G == 32 && K % 32 == 0 && M >= 1) {
        /* groups of 32 on AVX-512BW: the 512-bit int16-activation kernels at every row count */
        if (M == 1) w8_gemv_g32_z(x, K, w, scales, bias, N, y, nthreads);
        else w8_gemm_g32_z(x, M, K, ldx, w, scales, bias, N, y, ldy, nthreads);
        return;
    }
#endif
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

/* Columns [n0, n1) of w8_gemm's y, on the calling thread (no OpenMP region), through w8_gemm's
 * slice convention (quant_cpu.h; n0 a multiple of 16 for a packed w). Each output gets the bits
 * w8_gemm gives it: every kernel computes an output independently of its neighbours, and
 * activation rows are rounded to int16 the same way whatever the slice. */
void w8_gemm_cols(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                  int64_t G, const float *bias, int64_t N, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    if (n1 > N) n1 = N;
    if (n0 >= n1) return;
    if (G <= W8_PACKED_G) G = W8_PACKED_G - (W8_PACKED_G - G) - n0 / 16;
    else w += n0 * K, scales += n0 * ((K + G - 1) / G);
    w8_gemm(x, M, K, ldx, w, scales, G, bias ? bias + n0 : NULL, n1 - n0, y + n0, ldy, 1);
}
