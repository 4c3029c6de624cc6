/* bf16 linears of the fused step (decode_cpu.c): y [M, N] (+)= bf16(x) [M, K] W^T + bias with the
 * model's own bf16 weight W [N, K], read in place. Inputs rounded to bf16 (RNE), products summed
 * in fp32. Where the CPU has AVX512-BF16: AMX tiles from AMX_MIN_M rows (amx_bf16.c), VDPBF16PS
 * tiles below: on the weight's packed copy where the step has one (bf16_packed.c, ~3x these at
 * M >= 4), else the row-major register tiles here; else, on the packed copy too where there is one, (or with the Model's bf16_avx2 flag) the AVX2 kernels of
 * bf16_avx2.c, with MKL sgemm on widened weights from gemm_min_m rows. From bgemm_min_m rows
 * (Model.bgemm set: MKL's cblas_gemm_bf16bf16f32, AMX where the CPU has it) MKL multiplies the
 * same bf16-rounded inputs by W in place; the crossover is measured per host by
 * backend/model/bf16_gemm.py. */
#include "decode_cpu.h"

#define PACKED_AVX2_MIN_M 4

/* VDPBF16PS tiles (AVX512-BF16) */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16_DOT 1

/* GCC 12 spells a bf16 vector as shorts, later ones as __bf16: a same-size vector cast either way. */
#define BH(v) ((__m512bh)(v))

/* y[t, r g] (+)= x[t] . w[r g] + bias[r g] for R bf16 weight rows g rows apart and T bf16 input
 * rows: R x T fp32 accumulators of 16 lanes, 32 products per instruction along K (the last < 32
 * through a zeroing mask: zeros add nothing), one horizontal sum per output at the end. */
#define DEFINE_BTILE(R, T)                                                                          \
static void btile_##R##_##T(const uint16_t *x, int64_t K, const uint16_t *w, int64_t g,            \
                            const float *bias, float *y, int64_t ldy, int acc, const uint16_t *pf) { \
    __m512 a[R][T];                                                                                \
    for (int r = 0; r < R; r++) for (int t = 0; t < T; t++) a[r][t] = _mm512_setzero_ps();         \
    const int64_t rs = g * K;                                                                      \
    for (int64_t k = 0; k < K; k += 32) {                                                          \
        const __mmask32 mk = K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (K - k)) - 1);       \
        if (pf)                                                                                    \
            for (int r = 0; r < R; r++) __builtin_prefetch(pf + r * rs + k);                       \
        __m512i wv[R];                                                                             \
        for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_epi16(mk, w + r * rs + k);          \
        for (int t = 0; t < T; t++) {                                                              \
            const __m512i xv = _mm512_maskz_loadu_epi16(mk, x + t * K + k);                        \
            for (int r = 0; r < R; r++) a[r][t] = _mm512_dpbf16_ps(a[r][t], BH(wv[r]), BH(xv));    \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++)                                                                    \
        for (int t = 0; t < T; t++) {                                                              \
            float s = _mm512_reduce_add_ps(a[r][t]);                                               \
            if (bias) s += bias[r * g];                                                            \
            float *o = y + t * ldy + r * g;                                                        \
            *o = acc ? *o + s : s;                                                                 \
        }                                                                                          \
}
DEFINE_BTILE(4, 1) DEFINE_BTILE(4, 2) DEFINE_BTILE(4, 3) DEFINE_BTILE(4, 4)
DEFINE_BTILE(1, 1) DEFINE_BTILE(1, 2) DEFINE_BTILE(1, 3) DEFINE_BTILE(1, 4)

/* Rows [n0, n1) of y [M, N] (+)= xb [M, K] W^T + bias, bf16 xb and W: 4-row tiles whose rows come
 * from the STREAMS parts of the range (as linear_rows), up to 4 input rows per tile. */
void linear_rows_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, const float *bias,
                             int64_t N, float *y, int acc, int64_t n0, int64_t n1) {
    const int64_t g = (n1 - n0) / STREAMS;
    for (int64_t i = 0; i < g; i++) {
        const int64_t n = n0 + i;
        const uint16_t *w = W + n * K;
        const float *b = bias ? bias + n : NULL;
        const uint16_t *pf = i + 1 < g ? w + K : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4, pf = NULL) {
            const uint16_t *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: btile_4_1(xt, K, w, g, b, yt, N, acc, pf); break;
            case 2: btile_4_2(xt, K, w, g, b, yt, N, acc, pf); break;
            case 3: btile_4_3(xt, K, w, g, b, yt, N, acc, pf); break;
            default: btile_4_4(xt, K, w, g, b, yt, N, acc, pf);
            }
        }
    }
    for (int64_t n = n0 + STREAMS * g; n < n1; n++) {
        const uint16_t *w = W + n * K;
        const float *b = bias ? bias + n : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const uint16_t *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: btile_1_1(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 2: btile_1_2(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 3: btile_1_3(xt, K, w, 1, b, yt, N, acc, NULL); break;
            default: btile_1_4(xt, K, w, 1, b, yt, N, acc, NULL);
            }
        }
    }
}

typedef struct {
    const uint16_t *x; int64_t M, K; const uint16_t *W; const float *bias; int64_t N; float *y; int acc; int64_t C;
} BLinearJob;

static void blinear_chunk(void *p, int64_t c) {
    const BLinearJob *j = p;
    linear_rows_bf16(j->x, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->N * c / j->C, j->N * (c + 1) / j->C);
}
#endif

/* bf16 elements a bf16 linear's input scratch needs for M rows of K: the rows rounded to bf16,
 * then (from a 64-byte boundary) their AMX re-layout with the tokens padded to 16. */
int64_t bf16_input_elems(int64_t M, int64_t K) {
    return ((M * K + 31) & ~(int64_t)31) + (M + 15) / 16 * 16 * K;
}

int bf16_dot_supported(void) {
#ifdef HAVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}
typedef struct {
    const float *x; int64_t M, K; const uint16_t *W; const float *bias; int64_t N; float *y; int acc; int64_t C;
} ALinearJob;

static void alinear_chunk(void *p, int64_t c) {
    const ALinearJob *j = p;
    bf16_avx2_rows(j->x, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->N * c / j->C, j->N * (c + 1) / j->C);
}

/* Rows of W widened per BLAS call on the AVX2 path (256 x K floats: 576 KB at K = 576). */
#define WIDEN_ROWS 256

/* The AVX2 path from m->gemm_min_m rows, where BLAS beats register tiles (compute-bound): bf16(x)
 * (unpermuted) times W widened to fp32 WIDEN_ROWS rows at a time, through m->sgemm. -1: no memory. */
static int linear_bf16_blas(const Model *m, const float *xr, int64_t M, int64_t K, const uint16_t *W,
                            const float *bias, int64_t N, float *y, int acc) {
    float *wf = malloc(sizeof(float) * (size_t)(WIDEN_ROWS * K));
    if (!wf) return -1;
    const int m_ = (int)M, k_ = (int)K, ldc = (int)N;
    const float one = 1.f, beta = acc ? 1.f : 0.f;
    for (int64_t n0 = 0; n0 < N; n0 += WIDEN_ROWS) {
        const int nb = (int)(N - n0 < WIDEN_ROWS ? N - n0 : WIDEN_ROWS);
        bf16_avx2_widen(W + n0 * K, nb * K, wf);
        m->sgemm("T", "N", &nb, &m_, &k_, &one, wf, &k_, xr, &k_, &beta, y + n0, &ldc);   /* as linear() */
    }
    free(wf);
    if (bias)
        for (int64_t t = 0; t < M; t++)
            for (int64_t n = 0; n < N; n++) y[t * N + n] += bias[n];
    return 0;
}

#define BGEMM_ROWS 256             /* weight rows per MKL call */

typedef struct {
    const Model *m; const uint16_t *xb; int64_t M, K; const uint16_t *W; const float *bias; int64_t N;
    float *y; int acc; int64_t C;
} BGemmJob;

/* MKL's bf16 GEMM on weight rows [n0, n1), on this thread alone: the step's pool runs the slices
 * (MKL's own OpenMP team would end each call in a barrier waiting for a core that the serving
 * processes hold, the problem the pool solves, step_pool.c). */
static void bgemm_chunk(void *p, int64_t c) {
    const BGemmJob *j = p;
    const int64_t M = j->M, N = j->N, n0 = c * BGEMM_ROWS, n1 = n0 + BGEMM_ROWS < N ? n0 + BGEMM_ROWS : N;
    const int prev = j->m->mkl_threads_local ? j->m->mkl_threads_local(1) : 0;
    j->m->bgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS, (int)M, (int)(n1 - n0), (int)j->K, 1.f, j->xb,
                (int)j->K, j->W + n0 * j->K, (int)j->K, j->acc ? 1.f : 0.f, j->y + n0, (int)N);
    if (j->m->mkl_threads_local) j->m->mkl_threads_local(prev);
    if (j->bias)
        for (int64_t t = 0; t < M; t++)
            for (int64_t n = n0; n < n1; n++) j->y[t * N + n] += j->bias[n];
}

/* y [M, N] (+)= bf16(x) [M, K] W^T + bias with W bf16 [N, K]; xb: bf16_input_elems(M, K) (>= 2 M K:
 * room for the AVX2 kernels' M K rounded fp32 inputs too). AVX512-BF16 (AMX from AMX_MIN_M rows)
 * unless avx2 is set or the CPU lacks it; then the AVX2 kernels (bf16_avx2.c), same contract: BLAS
 * on widened weights from m->gemm_min_m rows (m->sgemm set), register tiles below. From
 * m->bgemm_min_m rows (m->bgemm set) MKL's bf16 GEMM instead, whatever the kernel set. */
void linear_bf16(const Model *m, const float *x, int64_t M, int64_t K, const uint16_t *W, const uint16_t *Wp,
                 const float *bias, int64_t N, float *y, int acc, uint16_t *xb, int nt, int avx2) {
    const int T = linear_threads(nt, M, N, K);
    if (m->bgemm && M >= m->bgemm_min_m && M < (1 << 30) && N < (1 << 30) && K < (1 << 30)) {
        f32_to_half(x, xb, M * K, KV_BF16);             /* RNE, as torch's .to(bfloat16) */
        /* Slices of BGEMM_ROWS weight rows whatever the thread count: each output is computed by
         * the same MKL call on any number of threads, so the bits do not depend on it. */
        BGemmJob j = {m, xb, M, K, W, bias, N, y, acc, (N + BGEMM_ROWS - 1) / BGEMM_ROWS};
        par_for(T, j.C, bgemm_chunk, &j, 0);
        return;
    }
#ifdef HAVE_BF16_DOT
    if (!avx2) {
        f32_to_half(x, xb, M * K, KV_BF16);             /* RNE, as torch's .to(bfloat16) */
        if (linear_amx(xb, M, K, W, bias, N, y, acc, T) == 0) return;
        if (Wp && linear_packed_bf16(xb, M, K, Wp, bias, N, y, acc, T) == 0) return;
        BLinearJob j = {xb, M, K, W, bias, N, y, acc, linear_chunks(T, N)};
        par_for(T, j.C, blinear_chunk, &j, 0);
        return;
    }
#endif
    (void)avx2;
    float *xr = (float *)xb;                             /* 64-byte aligned by the callers */
    const int blas = m->sgemm && M >= m->gemm_min_m && M < (1 << 30) && N < (1 << 30);
    /* The packed copy's kernel (bf16_packed.c) from PACKED_AVX2_MIN_M rows: below, its one chain of
     * FMAs per lane waits on their latency, and the row-major tiles are faster (Zen 4, one thread:
     * 0.64-0.75x at M = 1 in cache, 1.2-1.4x from M = 4). */
    const int packed = Wp && !blas && !(K & 1) && M >= PACKED_AVX2_MIN_M;
    bf16_avx2_inputs(x, M, K, xr, !blas && !packed);
    if (packed && linear_packed_avx2(xr, M, K, Wp, bias, N, y, acc, T) == 0) return;
    if (blas && linear_bf16_blas(m, xr, M, K, W, bias, N, y, acc) == 0) return;
    if (blas) bf16_avx2_inputs(x, M, K, xr, 1);         /* no memory for a weight block: the tiles */
    ALinearJob j = {xr, M, K, W, bias, N, y, acc, linear_chunks(T, N)};
    par_for(T, j.C, alinear_chunk, &j, 0);
}

/* 1: a bf16 model can take the fused step on this CPU (VDPBF16PS or AVX2 + FMA). */
int bf16_supported(void) { return bf16_dot_supported() || bf16_avx2_supported(); }

/* bf16 linear alone, for tests and the crossover calibration: y [M, N] (+)= bf16(x) W^T + bias;
 * avx2: the AVX2 kernels even where VDPBF16PS runs; cfg: a Model whose BLAS fields (sgemm,
 * gemm_min_m, bgemm, bgemm_min_m, mkl_threads_local) are used, or NULL: this library's kernels
 * only. -1 where the CPU has neither kernel set (or avx2 is asked without AVX2) or no memory. */
int linear_bf16_with(const Model *cfg, const float *x, int64_t M, int64_t K, const uint16_t *W, const uint16_t *Wp,
                     const float *bias, int64_t N, float *y, int acc, int nt, int avx2) {
    if (avx2 ? !bf16_avx2_supported() : !bf16_supported()) return -1;
    uint16_t *xb = aligned_alloc(64, (sizeof(uint16_t) * (size_t)bf16_input_elems(M, K) + 63) & ~(size_t)63);
    if (!xb) return -1;
    const Model none = {0};
    linear_bf16(cfg ? cfg : &none, x, M, K, W, Wp, bias, N, y, acc, xb, nt, avx2 || !bf16_dot_supported());
    free(xb);
    return 0;
}

/* packed: W packed here first (bf16_packed.c's kernels, where VDPBF16PS runs and avx2 is not set). */
int linear_bf16_test(const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias, int64_t N,
                     float *y, int acc, int nt, int avx2, int packed) {
    uint16_t *Wp = packed ? malloc(sizeof(uint16_t) * (size_t)bf16_packed_elems(N, K)) : NULL;
    if (packed && !Wp) return -1;
    if (Wp) bf16_pack(W, N, K, Wp);
    const int r = linear_bf16_with(NULL, x, M, K, W, Wp, bias, N, y, acc, nt, avx2);
    free(Wp);
    return r;
}
