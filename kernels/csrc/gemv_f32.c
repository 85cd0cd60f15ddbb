/* One-row float32 matrix-vector product y = W x, W [N, K] row-major, for x86-64 with AVX2 and FMA.
 *
 * Built at run time by mla_kernels.cpu_gemv with the system C compiler and linked against the OpenMP runtime
 * PyTorch already loaded, so its threads are PyTorch's. Each thread streams whole rows of W, four at a time,
 * against x (which stays in L1): the hardware prefetcher sees four sequential streams and the loop keeps eight
 * loads in flight, which is what a one-row product needs to reach the memory bandwidth. */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static inline float dot_tail(const float *w, const float *x, int64_t k0, int64_t k) {
    float s = 0.0f;
    for (int64_t i = k0; i < k; i++) s += w[i] * x[i];
    return s;
}

void mla_gemv_f32(const float *w, const float *x, float *y, int64_t n, int64_t k, int64_t threads) {
    const int64_t k8 = k - k % 8, blocks = (n + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads((int)threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r = 4 * b, rows = n - r < 4 ? n - r : 4;
        const float *w0 = w + r * k;
        const float *w1 = rows > 1 ? w0 + k : w0, *w2 = rows > 2 ? w0 + 2 * k : w0, *w3 = rows > 3 ? w0 + 3 * k : w0;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < k8; i += 8) {
            const __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
        }
        const float s[4] = {hsum(a0) + dot_tail(w0, x, k8, k), hsum(a1) + dot_tail(w1, x, k8, k),
                            hsum(a2) + dot_tail(w2, x, k8, k), hsum(a3) + dot_tail(w3, x, k8, k)};
        for (int64_t j = 0; j < rows; j++) y[r + j] = s[j];
    }
}

/* The same product for a weight-only int8 matrix: W [N, K] int8 with one float32 scale per row,
 * y[n] = scale[n] * sum_k W[n, k] x[k]. Each int8 weight is widened to float32 in registers, so a row is read at one
 * byte per weight and summed in float32 like the float kernel. */
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float dot_tail_i8(const int8_t *w, const float *x, int64_t k0, int64_t k) {
    float s = 0.0f;
    for (int64_t i = k0; i < k; i++) s += (float)w[i] * x[i];
    return s;
}

void mla_gemv_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t n, int64_t k,
                 int64_t threads) {
    const int64_t k8 = k - k % 8, blocks = (n + 3) / 4;
    #pragma omp parallel for schedule(static) num_threads((int)threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t r = 4 * b, rows = n - r < 4 ? n - r : 4;
        const int8_t *w0 = w + r * k;
        const int8_t *w1 = rows > 1 ? w0 + k : w0, *w2 = rows > 2 ? w0 + 2 * k : w0, *w3 = rows > 3 ? w0 + 3 * k : w0;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < k8; i += 8) {
            const __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(widen8(w0 + i), xv, a0);
            a1 = _mm256_fmadd_ps(widen8(w1 + i), xv, a1);
            a2 = _mm256_fmadd_ps(widen8(w2 + i), xv, a2);
            a3 = _mm256_fmadd_ps(widen8(w3 + i), xv, a3);
        }
        const float s[4] = {hsum(a0) + dot_tail_i8(w0, x, k8, k), hsum(a1) + dot_tail_i8(w1, x, k8, k),
                            hsum(a2) + dot_tail_i8(w2, x, k8, k), hsum(a3) + dot_tail_i8(w3, x, k8, k)};
        for (int64_t j = 0; j < rows; j++) y[r + j] = s[j] * scale[r + j];
    }
}
