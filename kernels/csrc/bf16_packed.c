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
/* Prefetch distance along a block's stream, in K-pairs (64 bytes each): a few lines ahead of the
 * loads, so that a single decode row (M = 1, bound by the read rate) keeps J streams in flight. */
#define PF_AHEAD 4

/* y[t, 16 j + l] (+)= x[t] . W[16 j + l] + bias for J column blocks (the last one `last` columns
 * wide, <= 16) and T input rows. */
#define DEFINE_PTILE(J, T)                                                                          \
static void ptile_##J##_##T(const uint16_t *x, int64_t K, const uint16_t *wp, int64_t bstride,     \
                            const float *bias, float *y, int64_t ldy, int acc, int last) {         \
    __m512 a[J][T];                                                                                \
    for (int j = 0; j < J; j++) for (int t = 0; t < T; t++) a[j][t] = _mm512_setzero_ps();         \
    const int64_t K2 = K / 2;                                                                      \
    for (int64_t kp = 0; kp < K2; kp++) {                                                          \
        __m512i w[J];                                                                              \
        for (int j = 0; j < J; j++) {                                                              \
            const uint16_t *p = wp + j * bstride + kp * 32;                                        \
            __builtin_prefetch(p + PF_AHEAD * 32);                                                 \
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

/* Column blocks [b0, b1) of y [M, N] (+)= xb [M, K] W^T + bias, W packed (bf16_pack). */
static void packed_blocks(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                          int64_t N, float *y, int acc, int64_t b0, int64_t b1) {
    const int64_t bstride = K * 16;
    for (int64_t b = b0; b < b1; b += PJ) {
        const int J = (int)(b1 - b < PJ ? b1 - b : PJ);
        const int64_t n = b * 16, cols = N - n;
        const int last = (int)(cols - 16 * (J - 1) < 16 ? cols - 16 * (J - 1) : 16);
        for (int64_t t0 = 0; t0 < M; t0 += PT) {
            const int T = (int)(M - t0 < PT ? M - t0 : PT);
            PTILE[J - 1][T - 1](xb + t0 * K, K, Wp + b * bstride, bstride, bias ? bias + n : NULL,
                                y + t0 * N + n, N, acc, last);
        }
    }
}

typedef struct {
    const uint16_t *xb; int64_t M, K; const uint16_t *Wp; const float *bias; int64_t N; float *y; int acc;
    int64_t NB, C;
} PackedJob;

static void packed_chunk(void *p, int64_t c) {
    const PackedJob *j = p;
    packed_blocks(j->xb, j->M, j->K, j->Wp, j->bias, j->N, j->y, j->acc, j->NB * c / j->C, j->NB * (c + 1) / j->C);
}

int linear_packed_bf16(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                       int64_t N, float *y, int acc, int T) {
    if (K & 1) return -1;
    const int64_t NB = (N + 15) / 16;
    int64_t C = linear_chunks(T, N);
    if (C > NB) C = NB;
    PackedJob j = {xb, M, K, Wp, bias, N, y, acc, NB, C < 1 ? 1 : C};
    par_for(T, j.C, packed_chunk, &j, 0);
    return 0;
}
#else
int linear_packed_bf16(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                       int64_t N, float *y, int acc, int T) {
    (void)xb; (void)M; (void)K; (void)Wp; (void)bias; (void)N; (void)y; (void)acc; (void)T;
    return -1;
}
#endif
