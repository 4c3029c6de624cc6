/* What one core of this CPU can do, for reading the CPU kernels' numbers (docs/kernels.md "bf16
 * models", docs/benchmarks.md run 6):
 *
 *   gcc -O2 -march=native bench/csrc/cpu_rates.c -o build/cpu_rates && build/cpu_rates [MB]
 *
 * 1. Instruction rates, 16 independent accumulator chains each: VDPBF16PS zmm (32 bf16 products),
 *    FMA zmm (16) and FMA ymm (8), in G instructions and G multiply-adds per second (AVX512-BF16
 *    hosts only for the first).
 * 2. Read rate of a MB-sized buffer (default 256, beyond the caches; 16 reads a cache-resident
 *    one): 64-byte loads over 1-16 interleaved streams, then 4 streams with a software prefetch
 *    256-2048 bytes ahead (T0 / T1 hints). A decode step that reads every weight once per token
 *    cannot beat the best of these per core.
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS 16
#define ROUNDS (100000000 / CHAINS)

/* CHAINS independent accumulators a[i] = OP(a[i]) of vector type VT, REDUCE(a[i]) summed so the
 * work stays; MACS multiply-adds per instruction. */
#define RATE(NAME, VT, INIT, OP, REDUCE, MACS)                                                      \
    do {                                                                                           \
        VT a[CHAINS];                                                                              \
        for (int i = 0; i < CHAINS; i++) a[i] = INIT;                                              \
        const double t0 = now();                                                                   \
        for (long n = 0; n < ROUNDS; n++)                                                          \
            _Pragma("GCC unroll 16")       /* the chains in registers, not memory */               \
            for (int i = 0; i < CHAINS; i++) {                                                     \
                a[i] = OP;                                                                         \
                __asm__("" : : "v"(a[i]));                                                         \
            }                                                                                      \
        const double t = now() - t0, ins = (double)ROUNDS * CHAINS;                                \
        float s = 0;                                                                               \
        for (int i = 0; i < CHAINS; i++) s += REDUCE;                                              \
        printf("%-14s %.2f G instr/s, %.1f GMAC/s (%g)\n", NAME, ins / t / 1e9, ins * MACS / t / 1e9, s); \
    } while (0)

static float first_lane(__m256 v) { return _mm256_cvtss_f32(v); }

static void instruction_rates(void) {
#if defined(__AVX512BF16__)
    const __m512i bx = _mm512_set1_epi16(0x3f80), by = _mm512_set1_epi16(0x3f81);
    RATE("VDPBF16PS zmm:", __m512, _mm512_set1_ps((float)i), _mm512_dpbf16_ps(a[i], (__m512bh)bx, (__m512bh)by),
         _mm512_reduce_add_ps(a[i]), 32);
#endif
#if defined(__AVX512F__)
    const __m512 zx = _mm512_set1_ps(1.0001f), zy = _mm512_set1_ps(0.9999f);
    RATE("FMA zmm:", __m512, _mm512_set1_ps((float)i), _mm512_fmadd_ps(zx, zy, a[i]), _mm512_reduce_add_ps(a[i]), 16);
#endif
    const __m256 yx = _mm256_set1_ps(1.0001f), yy = _mm256_set1_ps(0.9999f);
    RATE("FMA ymm:", __m256, _mm256_set1_ps((float)i), _mm256_fmadd_ps(yx, yy, a[i]), first_lane(a[i]), 8);
}

/* Best-of-4 GB/s reading n bytes as S interleaved streams, prefetching pf bytes ahead (0: none). */
static double read_rate(const char *a, size_t n, int S, int pf, int hint_t1) {
    double best = 1e9;
    long sink = 0;
    const size_t part = n / S;
    for (int rep = 0; rep < 4; rep++) {
        __m256i acc = _mm256_setzero_si256();
        const double t0 = now();
        for (size_t o = 0; o < part; o += 64) {
            if (pf)
                for (int s = 0; s < S; s++) {
                    if (hint_t1) _mm_prefetch(a + s * part + o + pf, _MM_HINT_T1);
                    else _mm_prefetch(a + s * part + o + pf, _MM_HINT_T0);
                }
            for (int s = 0; s < S; s++) {
                const __m256i *p = (const __m256i *)(a + s * part + o);
                acc = _mm256_xor_si256(acc, _mm256_xor_si256(_mm256_load_si256(p), _mm256_load_si256(p + 1)));
            }
        }
        const double t = now() - t0;
        if (t < best) best = t;
        sink += _mm256_extract_epi64(acc, 0);
    }
    if (sink == 42) printf(" ");
    return n / best / 1e9;
}

int main(int argc, char **argv) {
    instruction_rates();
    const size_t n = (size_t)(argc > 1 ? atoi(argv[1]) : 256) << 20;
    char *a = aligned_alloc(2 << 20, n);
    if (!a) return 1;
    memset(a, 1, n);
    for (int S = 1; S <= 16; S *= 2)
        printf("read %zu MB, %2d streams: %.1f GB/s\n", n >> 20, S, read_rate(a, n, S, 0, 0));
    for (int pf = 256; pf <= 2048; pf *= 2)
        printf("read %zu MB,  4 streams, prefetch %4d ahead: T0 %.1f, T1 %.1f GB/s\n", n >> 20, pf,
               read_rate(a, n, 4, pf, 0), read_rate(a, n, 4, pf, 1));
    free(a);
    return 0;
}
