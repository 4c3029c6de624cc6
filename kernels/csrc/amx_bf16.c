/* bf16 linears of the fused step on AMX (TDPBF16PS), called by linear_bf16.c from AMX_MIN_M rows.
 * y^T = W x^T in 16 x 16 tiles: C [16 weight rows x mb <= 16 tokens] fp32 += A [16 weight rows x 32
 * k, read in place from W with a row stride of K] . B [16 k-pairs x mb token pairs], B being the
 * step's bf16 inputs re-laid once per linear as VNNI pairs (xv below). Four C tiles (64 weight rows)
 * share each B tile. Needs K % 32 == 0; the N % 16 rows left take the VDPBF16PS tiles. The kernel
 * asks Linux for the AMX tile state once per process (arch_prctl ARCH_REQ_XCOMP_PERM). */
#include "decode_cpu.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Below 6 tokens the VDPBF16PS tiles make the faster step where the weights stream from DRAM: one
 * sequential stream per row instead of a tile's 16 strided rows (a 49152 x 768 matrix alone at M = 1:
 * 2.7 against 6.1 ms; whole decode steps of bench-110m / SmolLM2 at M = 4: 13.5 / 20.3 ms against
 * 17.0 / 24.9, at M = 6 even, at 8 AMX ahead, 20.7 / 27.3 against 23.1 / 32.6). bench-15m, whose
 * weights stay in cache, would gain from AMX at 4 already (0.95 against 1.08 ms). Smaller group
 * sizes and software prefetch of the next tile rows did not move AMX at M = 4. Sweep:
 * python -m bench.ab_dtype_step MODEL --amx-sweep. */
#define AMX_MIN_M 6

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileCfg;

/* Loaded by each amx_rows call and released at its end: other AMX users in the process (oneDNN
 * under torch's bf16 matmuls) release the tiles after their own work, so a config kept across
 * calls may be gone (the next tile instruction then faults: SIGILL). */
static void tile_config(int mb) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = 16; c.colsb[t] = (uint16_t)(mb * 4); }   /* C0..C3 */
    c.rows[4] = 16; c.colsb[4] = (uint16_t)(mb * 4);                                   /* B */
    c.rows[5] = c.rows[6] = 16; c.colsb[5] = c.colsb[6] = 64;                          /* A */
    _tile_loadconfig(&c);
}

/* xv: bf16 rows xb [M, K] -> [ceil(M/16)][K/32][16 k-pairs][16 tokens] of 32-bit pairs. */
static void to_vnni(const uint16_t *xb, int64_t M, int64_t K, uint32_t *xv) {
    const int64_t KB = K / 32, K2 = K / 2;
    for (int64_t m = 0; m < M; m++) {
        const uint32_t *src = (const uint32_t *)(xb + m * K);
        uint32_t *dst = xv + (m / 16) * KB * 256 + (m % 16);
        for (int64_t k2 = 0; k2 < K2; k2++) dst[(k2 / 16) * 256 + (k2 % 16) * 16] = src[k2];
    }
}

/* Row blocks [nb0, nb1) (16 weight rows each) of y [M, N] (+)= x W^T + bias. */
static void amx_rows(const uint32_t *xv, int64_t M, int64_t K, const uint16_t *W, const float *bias,
                     int64_t N, float *y, int acc, int64_t nb0, int64_t nb1) {
    const int64_t KB = K / 32, ws = K * 2;
    float buf[16 * 16] __attribute__((aligned(64)));
    int cfg = 0;
    /* Weight rows outside, tokens inside: a group's 64 rows (64 K bf16: 96 KB at K = 768) are read
     * from memory once and from L2 for every further 16 tokens (tokens outside read all of W once
     * per 16 tokens: bench-110m's 136-token prefill 25 % slower than oneDNN that way). */
    for (int64_t nb = nb0; nb < nb1; nb += 4) {
        const int nn = nb1 - nb >= 4 ? 4 : (int)(nb1 - nb);
        const uint16_t *w = W + nb * 16 * K;
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int mb = M - m0 >= 16 ? 16 : (int)(M - m0);
            if (mb != cfg) { tile_config(mb); cfg = mb; }
            const uint32_t *xt = xv + (m0 / 16) * KB * 256;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t kb = 0; kb < KB; kb++) {
                _tile_loadd(4, xt + kb * 256, 64);
                _tile_loadd(5, w + kb * 32, ws);
                _tile_dpbf16ps(0, 5, 4);
                if (nn > 1) { _tile_loadd(6, w + 16 * K + kb * 32, ws); _tile_dpbf16ps(1, 6, 4); }
                if (nn > 2) { _tile_loadd(5, w + 32 * K + kb * 32, ws); _tile_dpbf16ps(2, 5, 4); }
                if (nn > 3) { _tile_loadd(6, w + 48 * K + kb * 32, ws); _tile_dpbf16ps(3, 6, 4); }
            }
            for (int i = 0; i < nn; i++) {
                switch (i) {
                case 0: _tile_stored(0, buf, 64); break;
                case 1: _tile_stored(1, buf, 64); break;
                case 2: _tile_stored(2, buf, 64); break;
                default: _tile_stored(3, buf, 64);
                }
                const int64_t n0 = (nb + i) * 16;
                for (int t = 0; t < mb; t++) {
                    float *o = y + (m0 + t) * N + n0;
                    for (int r = 0; r < 16; r++) {
                        float v = buf[r * 16 + t] + (bias ? bias[n0 + r] : 0.f);
                        o[r] = acc ? o[r] + v : v;
                    }
                }
            }
        }
    }
    if (cfg) _tile_release();
}

typedef struct {
    const uint32_t *xv; int64_t M, K; const uint16_t *W; const float *bias; int64_t N; float *y; int acc;
    int64_t NB, C;
} AmxJob;

static void amx_chunk(void *p, int64_t c) {
    const AmxJob *j = p;
    amx_rows(j->xv, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->NB * c / j->C, j->NB * (c + 1) / j->C);
}
#endif

static int amx_state = -1;               /* -1: not asked yet; amx_set(0) turns it off */

int amx_supported(void) {
#ifdef HAVE_AMX
    if (amx_state < 0) {
        amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return amx_state;
#else
    return 0;
#endif
}

void amx_set(int on) { amx_state = on ? -1 : 0; }

/* y [M, N] (+)= xb [M, K] W^T + bias on AMX tiles, xb the bf16 inputs in bf16_input_elems' layout
 * (their VNNI re-layout goes after them); T threads. 0: done; -1: not taken (no AMX, fewer than
 * AMX_MIN_M rows, K % 32, N < 16), the caller's tiles run instead. */
int linear_amx(uint16_t *xb, int64_t M, int64_t K, const uint16_t *W, const float *bias, int64_t N, float *y,
               int acc, int T) {
#ifdef HAVE_AMX
    if (M >= AMX_MIN_M && K % 32 == 0 && N >= 16 && amx_supported()) {
        uint32_t *xv = (uint32_t *)(xb + ((M * K + 31) & ~(int64_t)31));   /* bf16_input_elems' layout */
        to_vnni(xb, M, K, xv);
        const int64_t NB = N / 16, C = linear_chunks(T, N);                  /* chunks of 16-row blocks */
        AmxJob aj = {xv, M, K, W, bias, N, y, acc, NB, C < NB ? C : NB};
        par_for(T, aj.C, amx_chunk, &aj, 0);
        if (NB * 16 < N) {                                /* the last N % 16 rows */
            linear_rows_bf16(xb, M, K, W, bias, N, y, acc, NB * 16, N);
        }
        return 0;
    }
#endif
    (void)xb; (void)M; (void)K; (void)W; (void)bias; (void)N; (void)y; (void)acc; (void)T;
    return -1;
}
