/* Products of 1 to 64 float32 rows with a block-FP8 weight for x86-64 with AVX2, FMA and F16C: W [n, k] stored as
 * float8_e4m3fn bytes with one float32 scale per (bn x bk) block, scale [ceil(n / bn), ceil(k / bk)] (DeepSeek-V3's
 * layout: the dequantised weight is fp8 * scale of its block). The weight is read at one byte per value.
 *
 * Widening e4m3 to float: an e4m3 byte s.eeee.mmm and the float16 s.0eeee.mmm0000000 differ by exactly 2^8 in value
 * (exponent biases 7 and 15; e4m3 subnormals land on float16 subnormals with the same ratio), so sixteen bytes are
 * widened with a sign extension, a shift and a mask to sixteen float16 values and converted by F16C; the factor 2^8
 * is folded into the block's scale (exact: a power of two). The bytes 0x7f / 0xff (NaN in e4m3fn) become a float16
 * NaN. Each widened value times its scale is the float32 value of the dequantised matrix (one rounding, as
 * ``w.float() * scale``).
 *
 * Threads (OpenMP, PyTorch's runtime) split the output rows. Up to four input rows: each weight row is widened in
 * registers and multiplied straight into them. More rows: a thread widens a weight row into a float32 buffer of k
 * values, then multiplies it into the input rows four at a time. Both ways every (output, input) pair is summed in
 * the same order (two accumulators, the even and odd eight-value groups, then the tail), so a row's result does not
 * depend on the rows beside it nor on the thread count. Compiled with the other
 * sources into the typed operators (ops/cpu_kernels.cpp). */
#include <omp.h>
#include <stdlib.h>

#include "mla_cpu.h"
#include "simd.h"

#define FP8_TARGET __attribute__((target("avx2,fma,f16c")))
#define FP8_CHUNK 4  /* input rows multiplied together */

/* Sixteen e4m3 bytes as float16 bits (value / 2^8). */
static inline __m256i e4m3_to_half_bits(const uint8_t *p) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));  /* sign copied into bits 7-15 */
    /* bits 0-6 (eeee.mmm) move to 7-13, the sign to 14 and 15: keep 15, clear 14 */
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBF80));
    /* NaN (magnitude bits 0x3f80, the largest): + 0x80 carries into bit 14, which completes an all-ones exponent */
    return _mm256_or_si256(h, _mm256_and_si256(_mm256_add_epi16(h, _mm256_set1_epi16(0x80)),
                                               _mm256_set1_epi16(0x4000)));
}

static inline FP8_TARGET float e4m3_to_half_scalar(uint8_t b) {  /* one byte, the same way (value / 2^8) */
    const uint16_t mag = b & 0x7F;
    uint16_t h = (uint16_t)(((b & 0x80) << 8) | (mag << 7));
    if (mag == 0x7F) h |= 0x7C00;
    return _cvtsh_ss(h);
}

/* The tail of a row (k % 16 values): wf[0:k - k16] times the rows' tails, added to sums s[0:m] in order. */
static inline __attribute__((always_inline)) void dot_tail(const float *wf, const float *x, float *s, const int m,
                                                            int64_t k16, int64_t k) {
    for (int j = 0; j < m; j++)
        for (int64_t i = k16; i < k; i++) s[j] += wf[i - k16] * x[j * k + i];
}

/* wf[0:k] = the dequantised weight row: each byte widened, times its block's scale (srow, one per bk values). */
static FP8_TARGET void widen_row(const uint8_t *wr, const float *srow, int64_t bk, int64_t k, float *wf) {
    for (int64_t b0 = 0, blk = 0; b0 < k; b0 += bk, blk++) {
        const int64_t end = b0 + bk < k ? b0 + bk : k;
        const float s = srow[blk] * 256.0f;  /* the float16 values are the e4m3 ones / 2^8 */
        const __m256 sv = _mm256_set1_ps(s);
        int64_t i = b0;
        for (; i + 16 <= end; i += 16) {
            const __m256i h = e4m3_to_half_bits(wr + i);
            _mm256_storeu_ps(wf + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sv));
            _mm256_storeu_ps(wf + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sv));
        }
        for (; i < end; i++) wf[i] = e4m3_to_half_scalar(wr[i]) * s;
    }
}

/* y[j * n] = wf . x[j * k : (j + 1) * k] for the m (<= FP8_CHUNK) rows of x (wf: a widened row). m is a
 * compile-time constant in each instance (the switches below). */
static inline __attribute__((always_inline)) void dot_rows(const float *wf, const float *x, float *y, const int m,
                                                            int64_t n, int64_t k) {
    const int64_t k16 = k - k % 16;
    __m256 a0[FP8_CHUNK], a1[FP8_CHUNK];
    for (int j = 0; j < m; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k16; i += 16) {
        const __m256 w0 = _mm256_loadu_ps(wf + i), w1 = _mm256_loadu_ps(wf + i + 8);
        for (int j = 0; j < m; j++) {
            a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * k + i), a0[j]);
            a1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * k + i + 8), a1[j]);
        }
    }
    float s[FP8_CHUNK];
    for (int j = 0; j < m; j++) s[j] = hsum(_mm256_add_ps(a0[j], a1[j]));
    dot_tail(wf + k16, x, s, m, k16, k);
    for (int j = 0; j < m; j++) y[j * n] = s[j];
}

/* The same products straight from the bytes wr (a row of W, srow its blocks' scales; bk a multiple of 16, so that
 * sixteen values share a scale), each widened value used for all m rows while in registers. */
static inline __attribute__((always_inline)) FP8_TARGET void fused_rows(const uint8_t *wr, const float *srow,
                                                                         int64_t bk, const float *x, float *y,
                                                                         const int m, int64_t n, int64_t k) {
    const int64_t k16 = k - k % 16;
    __m256 a0[FP8_CHUNK], a1[FP8_CHUNK];
    for (int j = 0; j < m; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < k16; b0 += bk) {
        const __m256 sv = _mm256_set1_ps(srow[b0 / bk] * 256.0f);  /* the float16 values are the e4m3 ones / 2^8 */
        const int64_t end = b0 + bk < k16 ? b0 + bk : k16;
        for (int64_t i = b0; i < end; i += 16) {
            const __m256i h = e4m3_to_half_bits(wr + i);
            const __m256 w0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sv);
            const __m256 w1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sv);
            for (int j = 0; j < m; j++) {
                a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + j * k + i), a0[j]);
                a1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + j * k + i + 8), a1[j]);
            }
        }
    }
    float s[FP8_CHUNK], tail[16];
    for (int j = 0; j < m; j++) s[j] = hsum(_mm256_add_ps(a0[j], a1[j]));
    for (int64_t i = k16; i < k; i++) tail[i - k16] = e4m3_to_half_scalar(wr[i]) * (srow[i / bk] * 256.0f);
    dot_tail(tail, x, s, m, k16, k);
    for (int j = 0; j < m; j++) y[j * n] = s[j];
}

/* Y [m, n] = X [m, k] W^T, W the block-FP8 matrix (w bytes [n, k], scale [ceil(n / bn), ceil(k / bk)] float32). */
static FP8_TARGET void gemm_fp8(const uint8_t *w, const float *scale, int64_t bn, int64_t bk, const float *x,
                                float *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
    const int64_t kb = (k + bk - 1) / bk;
    const int fused = m <= FP8_CHUNK && bk % 16 == 0;  /* one pass, no buffer */
    #pragma omp parallel num_threads((int)threads)
    {
        float *wf = NULL;  /* a widened weight row: k floats */
        if (!fused && !(wf = (float *)aligned_alloc(32, (size_t)((k + 8) / 8 * 8) * sizeof(float)))) abort();
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const uint8_t *wr = w + r * k;
            const float *srow = scale + (r / bn) * kb;
            if (fused) {
                switch (m) {
                    case 1: fused_rows(wr, srow, bk, x, y + r, 1, n, k); break;
                    case 2: fused_rows(wr, srow, bk, x, y + r, 2, n, k); break;
                    case 3: fused_rows(wr, srow, bk, x, y + r, 3, n, k); break;
                    default: fused_rows(wr, srow, bk, x, y + r, 4, n, k); break;
                }
                continue;
            }
            widen_row(wr, srow, bk, k, wf);
            for (int64_t c = 0; c < m; c += FP8_CHUNK) {
                const float *xc = x + c * k;
                float *yc = y + c * n + r;
                switch (m - c < FP8_CHUNK ? m - c : FP8_CHUNK) {
                    case 1: dot_rows(wf, xc, yc, 1, n, k); break;
                    case 2: dot_rows(wf, xc, yc, 2, n, k); break;
                    case 3: dot_rows(wf, xc, yc, 3, n, k); break;
                    default: dot_rows(wf, xc, yc, 4, n, k); break;
                }
            }
        }
        free(wf);
    }
}

void mla_gemm_fp8(const uint8_t *w, const float *scale, int64_t bn, int64_t bk, const float *x, float *y, int64_t m,
                  int64_t n, int64_t k, int64_t threads) {
    gemm_fp8(w, scale, bn, bk, x, y, m, n, k, threads);
}
