/* fp32 linears of the fused step (decode_cpu.c): y [M, N] (+)= x [M, K] W^T + bias with W [N, K]
 * as torch stores it. Small M: register tiles of R weight rows x T tokens (8-float accumulators
 * along K, one horizontal sum per output), each weight tile read from memory once and reused from
 * L1 for every group of T tokens; a tile's rows come from the STREAMS parts of the row range, so
 * the weights stream from DRAM as parallel sequential streams (~1.6x the bytes per second of one
 * stream at M = 1, issue 15). M >= gemm_min_m (when the caller passes MKL's sgemm_): BLAS, which
 * wins once the step is compute-bound. Row chunks run on the step's pool (step_pool.c). */
#include "decode_cpu.h"

/* y[t, r g] (+)= x[t] . w[r g] + bias[r g] for R rows g rows apart, T tokens; pf: the R rows to
 * prefetch meanwhile (the next tile's, on the first token group only: later groups find this tile
 * in L1). */
#define DEFINE_TILE(R, T)                                                                          \
static void tile_##R##_##T(const float *x, int64_t K, const float *w, int64_t g, const float *bias, \
                           float *y, int64_t ldy, int acc, const float *pf) {                      \
    v8 a[R][T];                                                                                    \
    for (int r = 0; r < R; r++) for (int t = 0; t < T; t++) a[r][t] = (v8){0};                     \
    const int64_t rs = g * K;                                                                      \
    int64_t k = 0;                                                                                 \
    for (; k + 8 <= K; k += 8) {                                                                   \
        if (pf && (k & 15) == 0)                                                                   \
            for (int r = 0; r < R; r++) __builtin_prefetch(pf + r * rs + k);                       \
        v8 wv[R];                                                                                  \
        for (int r = 0; r < R; r++) { wv[r] = ld(w + r * rs + k); IN_REG(wv[r]); }                \
        for (int t = 0; t < T; t++) {                                                              \
            v8 xv = ld(x + t * K + k);                                                             \
            IN_REG(xv);                                                                            \
            for (int r = 0; r < R; r++) a[r][t] = FMA8(a[r][t], wv[r], xv);                         \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++)                                                                    \
        for (int t = 0; t < T; t++) {                                                              \
            float s = hsum(a[r][t]);                                                               \
            for (int64_t i = k; i < K; i++) s = FMA1(s, w[r * rs + i], x[t * K + i]);              \
            if (bias) s += bias[r * g];                                                            \
            float *o = y + t * ldy + r * g;                                                        \
            *o = acc ? *o + s : s;                                                                 \
        }                                                                                          \
}

/* M = 1: R rows g apart, one token; the weight vectors are used once, so no register pinning. */
#define DEFINE_GEMV(R)                                                                             \
static void gemv_##R(const float *x, int64_t K, const float *w, int64_t g, const float *bias,     \
                     float *y, int acc) {                                                          \
    v8 a[R];                                                                                       \
    for (int r = 0; r < R; r++) a[r] = (v8){0};                                                    \
    const int64_t rs = g * K;                                                                      \
    int64_t k = 0;                                                                                 \
    for (; k + 8 <= K; k += 8) {                                                                   \
        const v8 xv = ld(x + k);                                                                   \
        for (int r = 0; r < R; r++) a[r] = FMA8(a[r], ld(w + r * rs + k), xv);                     \
    }                                                                                              \
    for (int r = 0; r < R; r++) {                                                                  \
        float s = hsum(a[r]);                                                                      \
        for (int64_t i = k; i < K; i++) s = FMA1(s, w[r * rs + i], x[i]);                          \
        if (bias) s += bias[r * g];                                                                \
        y[r * g] = acc ? y[r * g] + s : s;                                                         \
    }                                                                                              \
}

DEFINE_TILE(4, 1) DEFINE_TILE(4, 2) DEFINE_TILE(3, 3) DEFINE_TILE(2, 4)
DEFINE_TILE(1, 1) DEFINE_TILE(1, 2) DEFINE_TILE(1, 3) DEFINE_TILE(1, 4)
DEFINE_GEMV(4) DEFINE_GEMV(1)


/* Rows [n0, n1) of y [M, N] (+)= x [M, K] W^T + bias. */
static void linear_rows(const float *x, int64_t M, int64_t K, const float *W, const float *bias,
                        int64_t N, float *y, int acc, int64_t n0, int64_t n1) {
    const int64_t g = (n1 - n0) / STREAMS;             /* rows per part; tile rows are g apart */
    for (int64_t i = 0; i < g; i++) {
        const int64_t n = n0 + i;
        const float *w = W + n * K, *b = bias ? bias + n : NULL;
        if (M == 1) { gemv_4(x, K, w, g, b, y + n, acc); continue; }
        const float *pf = i + 1 < g ? w + K : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4, pf = NULL) {
            const float *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {     /* 4 rows: 4x1, 4x2, 3x3 + 1x3, 2x4 + 2x4 */
            case 1: tile_4_1(xt, K, w, g, b, yt, N, acc, pf); break;
            case 2: tile_4_2(xt, K, w, g, b, yt, N, acc, pf); break;
            case 3: tile_3_3(xt, K, w, g, b, yt, N, acc, pf);
                    tile_1_3(xt, K, w + 3 * g * K, g, b ? b + 3 * g : NULL, yt + 3 * g, N, acc,
                             pf ? pf + 3 * g * K : NULL);
                    break;
            default: tile_2_4(xt, K, w, g, b, yt, N, acc, pf);
                     tile_2_4(xt, K, w + 2 * g * K, g, b ? b + 2 * g : NULL, yt + 2 * g, N, acc,
                              pf ? pf + 2 * g * K : NULL);
            }
        }
    }
    for (int64_t n = n0 + STREAMS * g; n < n1; n++) {  /* the < STREAMS rows left */
        const float *w = W + n * K, *b = bias ? bias + n : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const float *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: if (M == 1) gemv_1(xt, K, w, 1, b, yt, acc); else tile_1_1(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 2: tile_1_2(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 3: tile_1_3(xt, K, w, 1, b, yt, N, acc, NULL); break;
            default: tile_1_4(xt, K, w, 1, b, yt, N, acc, NULL);
            }
        }
    }
}

#define LINEAR_CHUNKS 4

typedef struct {
    const float *x; int64_t M, K; const float *W, *bias; int64_t N; float *y; int acc; int64_t C;
} LinearJob;

static void linear_chunk(void *p, int64_t c) {
    const LinearJob *j = p;
    linear_rows(j->x, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->N * c / j->C, j->N * (c + 1) / j->C);
}

/* Threads for a linear: several only from PAR_MIN_MACS multiply-adds. */
int linear_threads(int nt, int64_t M, int64_t N, int64_t K) {
    return nt > 1 && M * N * K >= PAR_MIN_MACS ? nt : 1;
}

/* Row chunks of a linear on T threads. OpenMP: one contiguous row range per thread; the pool:
 * LINEAR_CHUNKS ranges per thread (a late worker leaves the caller at most one chunk's imbalance),
 * at least 16 rows each. */
int64_t linear_chunks(int T, int64_t N) {
    int64_t C = T;
    if (T > 1 && pool_enabled()) {
        C = (int64_t)T * LINEAR_CHUNKS;
        if (C > N / 16) C = N / 16 > T ? N / 16 : T;
    }
    return C;
}

/* y [M, N] (+)= x [M, K] W^T + bias;  x, y contiguous; acc: add into y (the residual). */
void linear(const Model *m, const float *x, int64_t M, int64_t K, const float *W,
                   const float *bias, int64_t N, float *y, int acc, int nt) {
    if (m->sgemm && M >= m->gemm_min_m && M < (1 << 30)) {
        /* Column-major view: y^T [N, M] = W [K, N]^T x^T [K, M]. */
        const int n_ = (int)N, m_ = (int)M, k_ = (int)K;
        const float one = 1.f, beta = acc ? 1.f : 0.f;
        m->sgemm("T", "N", &n_, &m_, &k_, &one, W, &k_, x, &k_, &beta, y, &n_);
        if (bias)
            for (int64_t t = 0; t < M; t++)
                for (int64_t n = 0; n < N; n++) y[t * N + n] += bias[n];
        return;
    }
    const int T = linear_threads(nt, M, N, K);
    LinearJob j = {x, M, K, W, bias, N, y, acc, linear_chunks(T, N)};
    par_for(T, j.C, linear_chunk, &j, 0);
}

/* The fp32 linear alone (own kernels, no sgemm), for tests and tools: y [M, N] (+)= x W^T + bias. */
void linear_f32(const float *x, int64_t M, int64_t K, const float *W, const float *bias, int64_t N,
                float *y, int acc, int nt) {
    const Model m = {0};
    linear(&m, x, M, K, W, bias, N, y, acc, nt);
}
