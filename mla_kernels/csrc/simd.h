/* AVX2/FMA helpers shared by the compiled CPU kernels. */
#ifndef MLA_SIMD_H
#define MLA_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* n bytes on a 64-byte boundary (a cache line; a zmm load's width), for rows the kernels read with vector loads:
 * malloc's 16-byte alignment split a cache line on every other such load, and the speed of a product then changed
 * with where the allocator had put its buffer (64 rows of int4 [4096, 1024], VNNI: 0.74 or 1.17 ms from one process
 * to the next). Released with free(). */
static inline void *alloc_lines(size_t n) { return aligned_alloc(64, (n + 63) & ~(size_t)63); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* the sum of the eight int32 lanes, in int32 (wrapping as int32 addition does) */
static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* the largest of the eight lanes */
static inline float hmax8(__m256 v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    return _mm_cvtss_f32(m4);
}

/* sum_i w[i] x[i], four independent accumulators along the row */
static inline float dot_f32(const float *w, const float *x, int64_t k) {
    const int64_t k32 = k - k % 32, k8 = k - k % 8;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i < k32; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i < k8; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++) s += w[i] * x[i];
    return s;
}

#endif
