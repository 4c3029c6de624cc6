/* Shared by the CPU weight-only quantized GEMMs (the .c files here, one library built by
 * backend/quant/cpu.py through kernels/cpu.py's cache: cc -O3 -march=native -fopenmp, ctypes, GIL
 * dropped during the call). OpenMP resolves to the libgomp torch already loaded (same soname), so
 * the kernels share torch's thread pool instead of starting a second one.
 *
 *   w8_gemm.c   int8 entry point: routing by rows, CPU features and group size; w8_dequant
 *   w8_f32a.c   int8 weight-only loops (fp32 activations): the reference numerics
 *   w8_a16.c    int8 x int16 activations, M >= a16_min_m (AVX2 vpmaddwd tiles)
 *   w8_gemv.c   int8 x int16 activations at 1 and 2 rows (decode at 1-2 streams)
 *   w8_avx512.c int8 in groups of 32 x int16 activations, 512-bit (AVX-512BW hosts), any row count
 *   w8_packed.c int8 in groups of 32 on a layout packed at load (16 columns per vector), M >= 2
 *   w4.c        int4 (weight-only loops, dequantize)
 *
 * Layouts (backend/quant/layout.py):
 *   int8: w int8 [N, K] row-major; scales fp16 [N, NG], NG = ceil(K / G) (G = 32: llama.cpp Q8_0's
 *         blocks, the default; G = K: one scale per output channel): W[n,k] = w[n,k] * scales[n, k / G]
 *   int4: w uint8 [N, KB * 16], KB = ceil(K / 32) blocks of 32 values, byte j of a block holds
 *         value j in its low nibble and value j + 16 in its high one (GGUF Q4_0/Q4_1's order);
 *         scales, zeros fp16 [N, NG], NG = ceil(K / G), G a multiple of 32:
 *         W[n,k] = (q[n,k] - 8) * scales[n, k / G] + zeros[n, k / G]
 */
#ifndef QUANT_CPU_H
#define QUANT_CPU_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}
static inline float h2f(uint16_t h) {     /* IEEE half -> float, subnormals included */
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 31) u = sign | 0x7f800000u | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else {
        float f = (float)m * (1.0f / 16777216.0f);     /* m * 2^-24 */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f; memcpy(&f, &u, 4); return f;
}
static inline v8 i8_to_f32(const int8_t *p) {
#ifdef __AVX2__
    /* gcc scalarizes __builtin_convertvector from an 8-byte vector: say vpmovsxbd + vcvtdq2ps */
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8 x; memcpy(&x, &f, sizeof x); return x;
#else
    v8i8 q; memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, v8);
#endif
}

/* Activation rows per weight pass: 8 while at least 8 are left (each dequantized weight vector
 * feeds 8 FMA chains, and is dequantized half as often as with 4-row tiles), then 4, then 1..3. */
#define MT_MAX 8
static inline int64_t m_tile(int64_t left) { return left >= 8 ? 8 : left >= 4 ? 4 : left; }

/* int8 x int16 activations: xq = round(x / sx) per row, sx = max|x[m]| / Q, Q = a16_q(K). */
#ifdef __AVX2__
static inline int64_t a16_q(int64_t K) {     /* |dot| <= K * Q * 127 fits int32 */
    int64_t q = (int64_t)2147483647 / (127 * (K > 0 ? K : 1));
    return q < 32767 ? q : q < 1 ? 1 : 32767;
}

static inline __m256i ld_w16(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i ld_x16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 8 int32 vectors -> their 8 horizontal sums, in order. */
static inline __m256i hsum8_i32(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m256i a4, __m256i a5,
                                __m256i a6, __m256i a7) {
    __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    __m256i b2 = _mm256_hadd_epi32(a4, a5), b3 = _mm256_hadd_epi32(a6, a7);
    __m256i c0 = _mm256_hadd_epi32(b0, b1), c1 = _mm256_hadd_epi32(b2, b3);   /* per 128-bit half */
    return _mm256_add_epi32(_mm256_permute2x128_si256(c0, c1, 0x20), _mm256_permute2x128_si256(c0, c1, 0x31));
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
void a16_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t Q, int16_t *xq, int64_t ldq,
                  float *sx, int nthreads);
void a16_g32_row(const int16_t *xq, const int8_t *w, const uint16_t *sc, int64_t K, float *out);
void w8_gemv_a16(const float *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t G,
                 const float *bias, int64_t N, float *y, int nthreads);          /* M = 1 */
void w8_gemv2_a16(const float *x, int64_t ldx, int64_t K, const int8_t *w, const uint16_t *scales,
                  const float *bias, int64_t N, float *y, int64_t ldy, int nthreads);   /* M = 2 */
#endif
/* The packed int8 layout (w8_packed.c): w8_gemm's ``w`` with G = W8_PACKED_G points to this header,
 * followed by the packed weights and fp32 scales. G = W8_PACKED_G - b0 (b0 >= 0): the slice of the
 * weight's columns [16 b0, 16 b0 + N) (a caller with its own thread pool hands out column slices;
 * y and bias then point at the slice's first column, as a row-major slice's w and scales would). */
#define W8_PACKED_G (-32)
typedef struct {
    int64_t N, K;
    const int8_t *w;              /* the row-major weight and fp16 scales it was packed from (GEMVs) */
    const uint16_t *scales;
    int64_t pad[4];               /* 64 bytes: the packed weights start cache-line aligned */
} w8p_hdr;
static inline int8_t *w8p_weights(const w8p_hdr *h) { return (int8_t *)h + sizeof(w8p_hdr); }
static inline float *w8p_scales(const w8p_hdr *h) {
    return (float *)(w8p_weights(h) + (h->N + 15) / 16 * 16 * h->K);
}
void w8_gemm_packed(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *buf, int64_t b0,
                    const float *bias, int64_t N, float *y, int64_t ldy, int nthreads);
int w8_has_avx512(void);     /* 1 where w8_avx512.c was built with AVX-512BW */
void w8_gemm_g32_z(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                   const float *bias, int64_t N, float *y, int64_t ldy, int nthreads);
void w8_gemv_g32_z(const float *x, int64_t K, const int8_t *w, const uint16_t *scales, const float *bias,
                   int64_t N, float *y, int nthreads);
void w8_gemm_f32a(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                  int64_t G, const float *bias, int64_t N, float *y, int64_t ldy, int nthreads);
void w8_gemm_a16(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, const uint16_t *scales,
                 int64_t G, const float *bias, int64_t N, float *y, int64_t ldy, int nthreads);
#endif
