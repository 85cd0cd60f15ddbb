/* One-row matrix-vector products y = W x for x86-64 with AVX2 and FMA: float32 W, or int8 W with one float32 scale
 * per row (each int8 weight widened to float32 in registers, so a row is read at one byte per weight).
 *
 * Built at run time by mla_kernels.cpu_gemv with the system C compiler and linked against the OpenMP runtime
 * PyTorch already loaded, so its threads are PyTorch's. Each thread takes a contiguous range of rows and reads
 * them one after the other, front to back: one long sequential stream per thread, which the hardware prefetcher
 * follows best (four rows interleaved were up to 2x slower on int8 rows of 1 KB), with four independent
 * accumulators along the row. x stays in L1. */
#include <math.h>

#include "simd.h"

static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static float dot_i8(const int8_t *w, const float *x, int64_t k) {
    const int64_t k32 = k - k % 32, k8 = k - k % 8;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i < k32; i += 32) {
        a0 = _mm256_fmadd_ps(widen8(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(widen8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i < k8; i += 8) a0 = _mm256_fmadd_ps(widen8(w + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++) s += (float)w[i] * x[i];
    return s;
}

void mla_gemv_f32(const float *w, const float *x, float *y, int64_t n, int64_t k, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads((int)threads)
    for (int64_t r = 0; r < n; r++) y[r] = dot_f32(w + r * k, x, k);
}

void mla_gemv_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t n, int64_t k,
                 int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads((int)threads)
    for (int64_t r = 0; r < n; r++) y[r] = dot_i8(w + r * k, x, k) * scale[r];
}

/* A few rows at once (1 <= m <= 8, a speculative verification or a small batch): Y [m, n] = X [m, k] W^T. Each
 * weight row is read once, front to back, and multiplied into all m input rows (which stay in L1). The row count
 * is a compile-time constant in each instance (the switches below), so the m accumulators live in registers. */
static inline __attribute__((always_inline)) void few_f32(const float *wr, const float *x, float *y, int64_t r,
                                                          const int m, int64_t n, int64_t k) {
    const int64_t k8 = k - k % 8;
    __m256 acc[8];
    for (int j = 0; j < m; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k8; i += 8) {
        const __m256 wv = _mm256_loadu_ps(wr + i);
        for (int j = 0; j < m; j++) acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i), acc[j]);
    }
    for (int j = 0; j < m; j++) {
        float s = hsum(acc[j]);
        for (int64_t i = k8; i < k; i++) s += wr[i] * x[j * k + i];
        y[j * n + r] = s;
    }
}

static inline __attribute__((always_inline)) void few_i8(const int8_t *wr, float scale, const float *x, float *y,
                                                         int64_t r, const int m, int64_t n, int64_t k) {
    const int64_t k8 = k - k % 8;
    __m256 acc[8];
    for (int j = 0; j < m; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k8; i += 8) {
        const __m256 wv = widen8(wr + i);
        for (int j = 0; j < m; j++) acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * k + i), acc[j]);
    }
    for (int j = 0; j < m; j++) {
        float s = hsum(acc[j]);
        for (int64_t i = k8; i < k; i++) s += (float)wr[i] * x[j * k + i];
        y[j * n + r] = s * scale;
    }
}

#define ROWS_CASES(CALL) \
    switch (m) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; case 5: CALL(5); break; \
                 case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

void mla_gemm_few_f32(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
#define F32_ROW(M) few_f32(w + r * k, x, y, r, M, n, k)
    #pragma omp parallel for schedule(static) num_threads((int)threads)
    for (int64_t r = 0; r < n; r++) ROWS_CASES(F32_ROW)
}

void mla_gemm_few_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads) {
#define I8_ROW(M) few_i8(w + r * k, scale[r], x, y, r, M, n, k)
    #pragma omp parallel for schedule(static) num_threads((int)threads)
    for (int64_t r = 0; r < n; r++) ROWS_CASES(I8_ROW)
}

/* RMSNorm of m rows of x [m, k] (row stride ld) into y [m, k]: y = x / sqrt(mean(x^2) + eps) * weight, in float32.
 * One thread: a decode step's few rows take microseconds, less than waking the thread pool would. */
void mla_rms_norm_f32(const float *x, int64_t ld, const float *weight, float *y, int64_t m, int64_t k, float eps) {
    for (int64_t j = 0; j < m; j++) {
        const float *xr = x + j * ld;
        const float r = 1.0f / sqrtf(dot_f32(xr, xr, k) / (float)k + eps);
        float *yr = y + j * k;
        const __m256 rv = _mm256_set1_ps(r);
        int64_t i = 0;
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), rv), _mm256_loadu_ps(weight + i)));
        for (; i < k; i++) yr[i] = xr[i] * r * weight[i];
    }
}

/* Gated MLPs of one row x [d], summed: y = sum_e w_e * down_e(silu(gate_e x) * up_e x), the experts a MoE layer
 * routed the row to plus its shared experts (or one dense MLP). table [*, 5] holds each MLP's gate_up [2 I, d] and
 * down [d, I] weights with their row scales (0: float32 weights, else int8 weights and float32 scales) and I; ids
 * and w name the n MLPs and their weights. One parallel region for all of them: each product's rows are split over
 * the threads, with a barrier between the products. scratch: 3 max(I) floats. */
void mla_gated_mlps(const float *x, float *y, int64_t d, const int64_t *table, const int64_t *ids, const float *w,
                    int64_t n, float *scratch, int64_t threads) {
    #pragma omp parallel num_threads((int)threads)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < d; r++) y[r] = 0.0f;
        for (int64_t e = 0; e < n; e++) {
            const int64_t *mlp = table + ids[e] * 5, inter = mlp[4];
            const float *gu_scale = (const float *)mlp[1], *down_scale = (const float *)mlp[3];
            float *act = scratch + 2 * inter;
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < 2 * inter; r++)
                scratch[r] = gu_scale ? dot_i8((const int8_t *)mlp[0] + r * d, x, d) * gu_scale[r]
                                      : dot_f32((const float *)mlp[0] + r * d, x, d);
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < inter; r++) act[r] = scratch[r] / (1.0f + expf(-scratch[r])) * scratch[inter + r];
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < d; r++)
                y[r] += w[e] * (down_scale ? dot_i8((const int8_t *)mlp[2] + r * inter, act, inter) * down_scale[r]
                                           : dot_f32((const float *)mlp[2] + r * inter, act, inter));
        }
    }
}
