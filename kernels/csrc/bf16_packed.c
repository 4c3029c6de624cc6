/* bf16 linears on weights packed once at load (AVX512-BF16): y [M, N] (+)= bf16(x) [M, K] W^T + bias.
 *
 * Why: the row-major tiles of linear_bf16.c multiply 4 weight rows by up to 4 input rows and end
 * every output in a horizontal sum; on a Zen 4 core they run at ~60 GFLOP/s at any M, a third of
 * what VDPBF16PS can do (oneDNN's bf16 GEMM reaches ~165 there from M = 32). Packed as
 * [ceil(N/16)][K/2][16][2], one 64-byte vector holds two K-steps of 16 output columns: an input's
 * pair of values broadcast to every lane multiplies it, each lane accumulates one output, and a
 * tile of J column blocks by T input rows keeps J x T accumulators with J + T loads per K-pair.
 *
 * Contract: the same as linear_bf16.c's (inputs rounded to bf16, products summed in fp32); every
 * output is one lane's sum in K order whatever the tile, chunk or thread count that computed it, so
 * the bits depend on neither M nor the threads. K must be even (the input pairs are read as one
 * 32-bit word); the caller falls back to the row-major tiles otherwise. */
#include "decode_cpu.h"

/* Prefetch distance along a block's stream, in K-pairs (64 bytes each): a few lines ahead of the
 * loads, into L1 (the tiles of several input rows). */
#define PF_AHEAD 4
/* A single decode row (M = 1) is bound by one core's read rate: its J streams prefetch 16 lines
 * (1 KiB) ahead, into L2 (PREFETCHT1), which keeps more misses in flight than the L1 prefetch a few
 * lines ahead. SmolLM2 bf16 decode step on a 2-vCPU Zen 4 (bench/csrc/ab_bf16_bw.c, best of 150
 * alternating): 10.99 -> 9.78 ms on one thread, 8.31 -> 7.98 ms on two (4 / 8 / 32 lines, T0 or
 * NTA: no better or worse). */
#define PF_GEMV 16
#define PF_GEMV_LOC 2

/* bf16 elements of W [N, K] packed: N rounded up to 16 columns (zero rows), K to an even count. */
int64_t bf16_packed_elems(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * ((K + 1) & ~(int64_t)1); }

/* out [ceil(N/16)][ceil(K/2)][16][2] <- W [N, K] (zeros in the padding). */
void bf16_pack(const uint16_t *W, int64_t N, int64_t K, uint16_t *out) {
    const int64_t K2 = (K + 1) / 2, NB = (N + 15) / 16;
    memset(out, 0, (size_t)bf16_packed_elems(N, K) * sizeof(uint16_t));
    for (int64_t b = 0; b < NB; b++)
        for (int64_t l = 0; l < 16 && b * 16 + l < N; l++) {
            const uint16_t *w = W + (b * 16 + l) * K;
            uint16_t *o = out + b * K2 * 32 + l * 2;
            for (int64_t k = 0; k < K; k++) o[(k >> 1) * 32 + (k & 1)] = w[k];
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BH(v) ((__m512bh)(v))

/* y[t, 16 j + l] (+)= x[t] . W[16 j + l] + bias for J column blocks (the last one `last` columns
 * wide, <= 16) and T input rows. */
#define DEFINE_PTILE(J, T) DEFINE_PTILE_PF(ptile_##J##_##T, J, T, PF_AHEAD, 3)
#define DEFINE_PTILE_PF(NAME, J, T, PF, LOC)                                                        \
static void NAME(const uint16_t *x, int64_t K, const uint16_t *wp, int64_t bstride,                 \
                 const float *bias, float *y, int64_t ldy, int acc, int last) {                    \
    __m512 a[J][T];                                                                                \
    for (int j = 0; j < J; j++) for (int t = 0; t < T; t++) a[j][t] = _mm512_setzero_ps();         \
    const int64_t K2 = K / 2;                                                                      \
    for (int64_t kp = 0; kp < K2; kp++) {                                                          \
        __m512i w[J];                                                                              \
        for (int j = 0; j < J; j++) {                                                              \
            const uint16_t *p = wp + j * bstride + kp * 32;                                        \
            __builtin_prefetch(p + (PF) * 32, 0, LOC);                                             \
            w[j] = _mm512_loadu_si512(p);                                                          \
        }                                                                                          \
        for (int t = 0; t < T; t++) {                                                              \
            int32_t pair;                                                                          \
            memcpy(&pair, x + t * K + 2 * kp, sizeof pair);                                        \
            const __m512i xv = _mm512_set1_epi32(pair);                                            \
            for (int j = 0; j < J; j++) a[j][t] = _mm512_dpbf16_ps(a[j][t], BH(w[j]), BH(xv));     \
        }                                                                                          \
    }                                                                                              \
    for (int j = 0; j < J; j++) {                                                                  \
        const __mmask16 mk = j == J - 1 && last < 16 ? (__mmask16)((1u << last) - 1) : (__mmask16)0xffff; \
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias + 16 * j) : _mm512_setzero_ps();   \
        for (int t = 0; t < T; t++) {                                                              \
            float *o = y + t * ldy + 16 * j;                                                       \
            __m512 s = _mm512_add_ps(a[j][t], b);                                                  \
            if (acc) s = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, o), s);                           \
            _mm512_mask_storeu_ps(o, mk, s);                                                       \
        }                                                                                          \
    }                                                                                              \
}
#define PTILES(J) DEFINE_PTILE(J, 1) DEFINE_PTILE(J, 2) DEFINE_PTILE(J, 3) DEFINE_PTILE(J, 4) \
                  DEFINE_PTILE(J, 5) DEFINE_PTILE(J, 6)
PTILES(1) PTILES(2) PTILES(3) PTILES(4)
#define PT 6                        /* input rows per tile */
#define PJ 4                        /* column blocks per tile */
typedef void (*ptile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, const float *, float *,
                         int64_t, int, int);
#define PROW(J) {ptile_##J##_1, ptile_##J##_2, ptile_##J##_3, ptile_##J##_4, ptile_##J##_5, ptile_##J##_6}
static const ptile_fn PTILE[PJ][PT] = {PROW(1), PROW(2), PROW(3), PROW(4)};
/* M = 1: the same J x 1 tiles (the same bits) with the decode row's prefetch (PF_GEMV). */
DEFINE_PTILE_PF(pgemv_1, 1, 1, PF_GEMV, PF_GEMV_LOC) DEFINE_PTILE_PF(pgemv_2, 2, 1, PF_GEMV, PF_GEMV_LOC)
DEFINE_PTILE_PF(pgemv_3, 3, 1, PF_GEMV, PF_GEMV_LOC) DEFINE_PTILE_PF(pgemv_4, 4, 1, PF_GEMV, PF_GEMV_LOC)
static const ptile_fn PGEMV[PJ] = {pgemv_1, pgemv_2, pgemv_3, pgemv_4};

/* Column blocks [b0, b1) of y [M, N] (+)= xb [M, K] W^T + bias, W packed (bf16_pack). */
static void packed_blocks(const void *x, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                          int64_t N, float *y, int acc, int64_t b0, int64_t b1) {
    const uint16_t *xb = x;
    const int64_t bstride = K * 16;
    for (int64_t b = b0; b < b1; b += PJ) {
        const int J = (int)(b1 - b < PJ ? b1 - b : PJ);
        const int64_t n = b * 16, cols = N - n;
        const int last = (int)(cols - 16 * (J - 1) < 16 ? cols - 16 * (J - 1) : 16);
        for (int64_t t0 = 0; t0 < M; t0 += PT) {
            const int T = (int)(M - t0 < PT ? M - t0 : PT);
            (M == 1 ? PGEMV[J - 1] : PTILE[J - 1][T - 1])(xb + t0 * K, K, Wp + b * bstride, bstride, bias ? bias + n : NULL,
                                y + t0 * N + n, N, acc, last);
        }
    }
}

#define DOT_BLOCKS packed_blocks
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA on the same packed layout: a 32-bit lane of a K-pair's 256-bit half holds one
 * column's (k, k + 1) weights, widened to fp32 exactly by a shift (k) and a mask (k + 1); inputs
 * are fp32 rows already rounded to bf16 (bf16_avx2_inputs), broadcast per K-step. Each output is one
 * lane's chain of FMAs in K order, whatever the tile or thread (the VDPBF16PS kernel above sums a
 * pair inside one instruction: the two kernel sets differ in the last bits, as before). */
#define DEFINE_ATILE(T)                                                                             \
static void aptile_##T(const float *x, int64_t K, const uint16_t *wp, const float *bias, float *y,   \
                       int64_t ldy, int acc, int last) {                                                     \
    __m256 a[2][T];                                                                                 \
    for (int h = 0; h < 2; h++) for (int t = 0; t < T; t++) a[h][t] = _mm256_setzero_ps();          \
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);                                         \
    for (int64_t kp = 0; kp < K / 2; kp++) {                                                        \
        const uint16_t *p = wp + kp * 32;                                                           \
        __builtin_prefetch(p + PF_AHEAD * 32);                                                      \
        const __m256i u0 = _mm256_loadu_si256((const __m256i *)p), u1 = _mm256_loadu_si256((const __m256i *)(p + 16)); \
        const __m256 w00 = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));                          \
        const __m256 w01 = _mm256_castsi256_ps(_mm256_and_si256(u0, hi));                           \
        const __m256 w10 = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));                          \
        const __m256 w11 = _mm256_castsi256_ps(_mm256_and_si256(u1, hi));                           \
        for (int t = 0; t < T; t++) {                                                               \
            const __m256 x0 = _mm256_broadcast_ss(x + t * K + 2 * kp);                              \
            const __m256 x1 = _mm256_broadcast_ss(x + t * K + 2 * kp + 1);                          \
            a[0][t] = _mm256_fmadd_ps(w01, x1, _mm256_fmadd_ps(w00, x0, a[0][t]));                  \
            a[1][t] = _mm256_fmadd_ps(w11, x1, _mm256_fmadd_ps(w10, x0, a[1][t]));                  \
        }                                                                                           \
    }                                                                                               \
    for (int t = 0; t < T; t++)                                                                     \
        for (int h = 0; h < 2; h++) {                                                               \
            float out[8];                                                                           \
            _mm256_storeu_ps(out, a[h][t]);                                                         \
            for (int l = 0; l < 8 && 8 * h + l < last; l++) {                                       \
                const float s = out[l] + (bias ? bias[8 * h + l] : 0.0f);                           \
                float *o = y + t * ldy + 8 * h + l;                                                 \
                *o = acc ? *o + s : s;                                                              \
            }                                                                                       \
        }                                                                                           \
}
DEFINE_ATILE(1) DEFINE_ATILE(2) DEFINE_ATILE(3) DEFINE_ATILE(4)
typedef void (*aptile_fn)(const float *, int64_t, const uint16_t *, const float *, float *, int64_t, int, int);
static const aptile_fn APTILE[4] = {aptile_1, aptile_2, aptile_3, aptile_4};

/* Column blocks [b0, b1) of y [M, N] (+)= xr [M, K] W^T + bias, W packed, xr fp32 rounded to bf16. */
static void avx2_blocks(const void *x, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                        int64_t N, float *y, int acc, int64_t b0, int64_t b1) {
    const float *xr = x;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t n = b * 16;
        const int last = (int)(N - n < 16 ? N - n : 16);
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const int T = (int)(M - t0 < 4 ? M - t0 : 4);
            APTILE[T - 1](xr + t0 * K, K, Wp + b * K * 16, bias ? bias + n : NULL, y + t0 * N + n, N, acc, last);
        }
    }
}
#define AVX2_BLOCKS avx2_blocks
#endif

/* One parallel loop over column blocks with either kernel set: chunks of whole blocks. */
typedef void (*blocks_fn)(const void *x, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                          int64_t N, float *y, int acc, int64_t b0, int64_t b1);
typedef struct {
    blocks_fn fn; const void *x; int64_t M, K; const uint16_t *Wp; const float *bias; int64_t N; float *y;
    int acc; int64_t NB, C;
} PackedJob;

static void packed_chunk(void *p, int64_t c) {
    const PackedJob *j = p;
    j->fn(j->x, j->M, j->K, j->Wp, j->bias, j->N, j->y, j->acc, j->NB * c / j->C, j->NB * (c + 1) / j->C);
}

static int packed_run(blocks_fn fn, const void *x, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                      int64_t N, float *y, int acc, int T) {
    if (!fn || (K & 1)) return -1;
    const int64_t NB = (N + 15) / 16;
    int64_t C = linear_chunks(T, N);
    if (C > NB) C = NB;
    PackedJob j = {fn, x, M, K, Wp, bias, N, y, acc, NB, C < 1 ? 1 : C};
    par_for(T, j.C, packed_chunk, &j, 0);
    return 0;
}

#ifndef DOT_BLOCKS
#define DOT_BLOCKS NULL
#endif
#ifndef AVX2_BLOCKS
#define AVX2_BLOCKS NULL
#endif

int linear_packed_bf16(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                       int64_t N, float *y, int acc, int T) {
    return packed_run(DOT_BLOCKS, xb, M, K, Wp, bias, N, y, acc, T);
}

/* y (+)= xr Wp^T + bias, xr fp32 rows rounded to bf16; 0 done, -1 not taken (no AVX2, K odd). */
int linear_packed_avx2(const float *xr, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                       int64_t N, float *y, int acc, int T) {
    return packed_run(AVX2_BLOCKS, xr, M, K, Wp, bias, N, y, acc, T);
}
