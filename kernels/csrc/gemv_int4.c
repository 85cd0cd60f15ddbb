/* Products of 1 to a few dozen rows with a group-wise int4 weight, for x86-64 with AVX2 and FMA.
 *
 * The weight W [n, k] is stored as kp = k rounded up to a multiple of 32 columns (the padding is zero): packed
 * nibbles [n, kp / 2] and one float16 scale per group of 32 along k, [n, kp / 32]. A group's 16 bytes hold its
 * 32 values q in [-8, 7] as q + 8: byte j has value j in its low nibble and value j + 16 in its high nibble (the
 * order of ggml's Q4_0 blocks). W[r, c] = (q[r, c] - 8) * scale[r, c / 32].
 *
 * Activations: each input row is rounded to int16 with one power-of-two scale per row (its largest magnitude to
 * at most 32767, so the rounding error of any value is at most 2^-15 of the row's largest value), then each group
 * is an integer dot product (_mm256_madd_epi16 of the widened nibbles with the int16 row, exact in int32), turned
 * to float and accumulated with the group's scale by one FMA into eight float32 lanes per row.
 *
 * The weight is streamed from memory once for all the rows: each thread takes blocks of weight rows (a block's
 * packed bytes fit in L1/L2) and passes over them once per tile of up to 8 input rows, with the tile's row count
 * compiled into each instance (the switch below) so the accumulators live in registers, and a software prefetch
 * running ahead of the weight stream. Every (weight row, input row) pair has its own accumulator and sees the same
 * sequence of operations whatever the tile, so a row's result does not depend on the other rows of the batch. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "simd.h"

#define I4_GROUP 32            /* values per scale */
#define I4_TILE 8              /* input rows per pass over a block of weight rows */
#define I4_BLOCK_BYTES 16384   /* packed bytes of a block of weight rows (stays in L1/L2 across the tiles) */
#define I4_XMAX 32767.0f       /* the int16 rows' largest magnitude */
#ifndef I4_PREFETCH
#define I4_PREFETCH 1024       /* bytes ahead in the weight stream */
#endif

/* Eight float16 values (bit patterns) as float32, exactly (subnormals, infinities and NaN included), with integer
 * operations only (F16C is not assumed). */
static inline __m256 half8_to_float(__m128i bits) {
    const __m256i h = _mm256_cvtepu16_epi32(bits);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
    const __m256i expo = _mm256_and_si256(h, _mm256_set1_epi32(0x7c00));
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7fff)), 13);
    /* normal: rebias the exponent (15 -> 127) */
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(mag, _mm256_set1_epi32(112 << 23)));
    /* zero and subnormal: mantissa * 2^-24 (a normal float32: no subnormal float32 is ever formed) */
    const __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(h, _mm256_set1_epi32(0x03ff))),
                                       _mm256_set1_ps(0x1p-24f));
    /* infinity and NaN: the float32 exponent all ones, the mantissa kept */
    const __m256 special = _mm256_castsi256_ps(_mm256_or_si256(mag, _mm256_set1_epi32(0x7f800000)));
    const __m256 is_small = _mm256_castsi256_ps(_mm256_cmpeq_epi32(expo, _mm256_setzero_si256()));
    const __m256 is_special = _mm256_castsi256_ps(_mm256_cmpeq_epi32(expo, _mm256_set1_epi32(0x7c00)));
    __m256 f = _mm256_blendv_ps(normal, small, is_small);
    f = _mm256_blendv_ps(f, special, is_special);
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

static void halves_to_float(const uint16_t *h, float *f, int64_t count) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(f + i, half8_to_float(_mm_loadu_si128((const __m128i *)(h + i))));
    if (i < count) {
        uint16_t tail[8] = {0};
        float out[8];
        for (int64_t j = i; j < count; j++) tail[j - i] = h[j];
        _mm256_storeu_ps(out, half8_to_float(_mm_loadu_si128((const __m128i *)tail)));
        for (int64_t j = i; j < count; j++) f[j] = out[j - i];
    }
}

/* x [k] as int16 q [kp] (zeros past k) with one power-of-two scale: |q| <= 32767, exact for values of few
 * significant bits. Returns the scale (NaN where x has a non-finite value: its products come out NaN). */
static float quantize_row16(const float *x, int16_t *q, int64_t k, int64_t kp) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
    __m256 mv = _mm256_setzero_ps(), bad = mv;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
        mv = _mm256_max_ps(mv, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  /* infinity or NaN */
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    int finite = _mm256_movemask_ps(bad) == 0;
    for (; i < k; i++) {
        finite &= isfinite(x[i]) != 0;
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    if (!finite) {
        for (int64_t j = 0; j < kp; j++) q[j] = 0;
        return NAN;
    }
    int e = 0;
    if (amax > 0.0f) frexpf(amax / I4_XMAX, &e);  /* 2^e > amax / 32767 */
    const float inv = ldexpf(1.0f, -e);
    const __m256 iv = _mm256_set1_ps(inv);
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {  /* round to nearest even (the default mode), as lrintf */
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j), iv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8), iv));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
    }
    for (; j < k; j++) q[j] = (int16_t)lrintf(x[j] * inv);
    for (; j < kp; j++) q[j] = 0;
    return ldexpf(1.0f, e);
}

/* Weight row r (packed wr, float scales sc, g_n groups) times m int16 rows xq (row stride kp = 32 g_n):
 * y[j n + r] = sx[j] * sum_g sc[g] * (q_g . xq_jg). */
static inline __attribute__((always_inline)) void i4_row(const uint8_t *wr, const float *sc, int64_t g_n,
                                                         const int16_t *xq, const float *sx, float *y, int64_t n,
                                                         int64_t r, const int m) {
    const int64_t kp = g_n * I4_GROUP;
    const __m256i eight = _mm256_set1_epi16(8), low = _mm256_set1_epi16(0x0f);
    __m256 acc[I4_TILE];
    for (int j = 0; j < m; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < g_n; g++) {
        if ((g & 3) == 0) _mm_prefetch((const char *)(wr + g * 16) + I4_PREFETCH, _MM_HINT_T0);
        /* 16 bytes -> 16 int16 lanes, each a byte: its low nibbles are values 0..15, its high nibbles 16..31 */
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr + g * 16)));
        const __m256i w0 = _mm256_sub_epi16(_mm256_and_si256(b, low), eight);
        const __m256i w1 = _mm256_sub_epi16(_mm256_srli_epi16(b, 4), eight);
        const __m256 s = _mm256_broadcast_ss(sc + g);
        for (int j = 0; j < m; j++) {
            const int16_t *xj = xq + j * kp + g * I4_GROUP;
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xj)),
                                               _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xj + 16))));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[j]);
        }
    }
    for (int j = 0; j < m; j++) y[j * n + r] = hsum(acc[j]) * sx[j];
}

#define I4_TILE_CASES(CALL) \
    switch (m) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
                 case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

/* Y [rows, n] = X [rows, k] W^T in float32, W as above (w packed, scales float16 bit patterns). */
void mla_gemm_i4(const uint8_t *w, const uint16_t *scales, const float *x, float *y, int64_t rows, int64_t n,
                 int64_t k, int64_t threads) {
    const int64_t g_n = (k + I4_GROUP - 1) / I4_GROUP, kp = g_n * I4_GROUP;
    int64_t block = I4_BLOCK_BYTES / (kp / 2);
    const int64_t balanced = n / (4 * threads);  /* at least about four blocks a thread */
    block = block < balanced ? block : balanced;
    block = block < 1 ? 1 : block;
    const int64_t blocks = (n + block - 1) / block;
    int16_t *xq = malloc((size_t)(rows * kp) * sizeof(int16_t));
    float *sx = malloc((size_t)rows * sizeof(float));
    float *sc_all = malloc((size_t)(threads * block * g_n) * sizeof(float));
    if (!xq || !sx || !sc_all) abort();  /* mla_kernels.cpu_gemv bounds the rows */
    #pragma omp parallel num_threads((int)threads)
    {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < rows; j++) sx[j] = quantize_row16(x + j * k, xq + j * kp, k, kp);
        float *sc = sc_all + omp_get_thread_num() * block * g_n;  /* this thread's block's scales as float32 */
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * block, r1 = r0 + block < n ? r0 + block : n;
            halves_to_float(scales + r0 * g_n, sc, (r1 - r0) * g_n);
            for (int64_t c = 0; c < rows; c += I4_TILE) {
                const int m = rows - c < I4_TILE ? (int)(rows - c) : I4_TILE;
#define I4_TILE_CALL(M) \
    for (int64_t r = r0; r < r1; r++) i4_row(w + r * (kp / 2), sc + (r - r0) * g_n, g_n, xq + c * kp, sx + c, y + c * n, n, r, M)
                I4_TILE_CASES(I4_TILE_CALL)
            }
        }
    }
    free(xq);
    free(sx);
    free(sc_all);
}
