/* The KV store of the CPU attention path (kernels/cpu.py library(), and the fused step's
 * f32_to_half): K/V rows copied to their slots, and the RNE float -> fp16 / bf16 conversion a half
 * KV cache is stored with (and a bf16 linear's inputs are rounded with, linear_bf16.c). Built into
 * both the attention library and the decode library by kernels/cpu.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

/* Copy each token's K and V rows (Hkv * D elements of elem_size bytes) to its slot; slot < 0 skips. */
void store_kv(const void *key, const void *value, void *kc, void *vc, const int64_t *slots,
              int64_t ntok, int64_t row_bytes) {
    for (int64_t i = 0; i < ntok; i++) {
        if (slots[i] < 0) continue;
        memcpy((char *)kc + slots[i] * row_bytes, (const char *)key + i * row_bytes, (size_t)row_bytes);
        memcpy((char *)vc + slots[i] * row_bytes, (const char *)value + i * row_bytes, (size_t)row_bytes);
    }
}

/* float -> IEEE half, round to nearest even (as torch's .to(float16)): overflow -> inf, NaN kept. */
static inline uint16_t f32_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, 0);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(sign | 0x7e00 | (a >> 13));         /* NaN */
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00);                    /* rounds past 65504 */
    if (a < 0x38800000) {                                                      /* half subnormal / 0 */
        float m;                                                               /* |f| * 2^24, exact */
        memcpy(&m, &a, sizeof m);
        return (uint16_t)(sign | (uint16_t)nearbyintf(m * 16777216.f));
    }
    const uint32_t r = a + 0xfff + ((a >> 13) & 1) - (112u << 23);            /* rebias, round */
    return (uint16_t)(sign | (r >> 13));
#endif
}

/* float -> bf16, round to nearest even (as torch's .to(bfloat16)); NaN -> quiet NaN. */
static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* out[0..n) = x[0..n) as fp16 (kind 1) or bf16 (kind 2): how a K/V row enters a half KV cache
 * (the fused step's store, tests). */
void f32_to_half(const float *x, uint16_t *out, int64_t n, int kind) {
    int64_t i = 0;
    if (kind == 1) {
#ifdef __F16C__
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; i < n; i++) out[i] = f32_f16(x[i]);
    } else {
#ifdef __AVX2__
        const __m256i lsb = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
        const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
        const __m256i quiet = _mm256_set1_epi32(0x400000);
        for (; i + 8 <= n; i += 8) {
            __m256i u = _mm256_loadu_si256((const __m256i *)(x + i));
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
            __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), lsb)));
            r = _mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan);
            r = _mm256_srli_epi32(r, 16);                        /* 8 x u32 in [0, 65535] */
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            _mm_storeu_si128((__m128i *)(out + i), packed);
        }
#endif
        for (; i < n; i++) out[i] = f32_bf16(x[i]);
    }
}
