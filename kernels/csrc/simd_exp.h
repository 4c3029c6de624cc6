/* exp8: the exp of 8 floats for AVX2 + FMA, shared by paged_cpu.c (softmax) and decode_cpu.c
 * (SiLU). Header-only so both inline it; kernels/cpu.py hashes this directory's headers into the
 * library's cache key. */
#ifndef TRITON_LLM_SIMD_EXP_H
#define TRITON_LLM_SIMD_EXP_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp of 8 floats (Cephes expf: n = round(x log2 e), r = x - n ln 2 in two parts, degree-6
 * polynomial, times 2^n): within ~2 ulp of expf over the clamped range. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654475f)), _mm256_set1_ps(88.37626266f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif
#endif
