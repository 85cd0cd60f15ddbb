/* W8A8 products for x86-64: int8 weights with one float32 scale per output row, against input rows rounded to int8
 * per row (per token) on the fly, the dynamic activation quantisation of W8A8 int8 checkpoints:
 *
 *     sx = amax(|x|) / 127      xq = round(x / sx), to nearest even     (a row of zeros: sx = 0, xq = 0)
 *     y[j, c] = float(sum_i w[c, i] * xq[j, i]) * sx[j] * sw[c]
 *
 * the sum exact in int32 (int8 values sign-extended to int16, multiplied and summed in pairs: vpmaddwd on AVX2,
 * vpdpwssd on AVX-512 VNNI for a lone row; several rows on AVX-512 VNNI as unsigned bytes xq + 128 against the
 * signed weight bytes, vpdpbusd, less 128 times the weight row's sum; on AMX tiles, amx_int8.c, TDPBSSD), then turned to
 * float32 and scaled, the two multiplications in that order. Every variant (w8a8_rows.h, once per instruction set, and
 * amx_int8.c) computes the same integers, so the same bits, and a row's result does not depend on the rows beside it. torch computes the same values (mla_runtime.layers.w8a8: torch._int_mm). Given
 * row_amax (not NULL), row j takes amax = row_amax[j] in place of its own: a tensor-parallel rank holding a slice of
 * K rounds its slice with the whole row's amax (the ranks' MAX), as one rank would. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"
#include "simd.h"

/* One row rounded to int8 values held as int16, by the rule above; returns its scale. Division and rounding as
 * torch computes them (an IEEE division, rounded to nearest even), eight values a step: the same values as the scalar
 * nearbyintf(x[i] / s) (a NaN's conversion keeps its low 16 bits, as the scalar conversion to int16 does). */
static float quantize_row_i8(const float *x, int16_t *q, int64_t k, const float *given_amax) {
    float amax = 0.0f;
    int64_t i = 0;
    if (given_amax) amax = *given_amax;
    else {  /* NaNs left out, as fmaxf leaves them out: max_ps returns its second operand when either is NaN */
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 m = _mm256_setzero_ps();
        for (; i + 8 <= k; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m);
        amax = hmax8(m);
        for (; i < k; i++) amax = fmaxf(amax, fabsf(x[i]));
    }
    const float s = amax / 127.0f;
    if (!(s > 0.0f)) {
        memset(q, 0, (size_t)k * sizeof(int16_t));
        return s == 0.0f ? 0.0f : s;
    }
    const __m256 sv = _mm256_set1_ps(s);
    const __m256i low = _mm256_set1_epi32(0xffff);
    for (i = 0; i + 16 <= k; i += 16) {
        const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv), r));
        const __m256i b = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8), sv), r));
        const __m256i ab = _mm256_packus_epi32(_mm256_and_si256(a, low), _mm256_and_si256(b, low));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(ab, 0xd8));
    }
    for (; i < k; i++) q[i] = (int16_t)nearbyintf(x[i] / s);
    return s;
}

#include "vec_avx2.h"
#include "w8a8_rows.h"
#include "vec_end.h"
#include "vec_avx512.h"
#include "w8a8_rows.h"
#include "vec_end.h"

/* The variants this process runs, bit i for variant i: 0 AVX2, 1 AVX-512 VNNI, 2 AMX int8 tiles (amx_int8.c: from
 * AMX_W8A8_ROWS rows, the AVX-512 VNNI products below them). */
int64_t mla_w8a8_variants(void) { return mla_i8_variants() | (mla_amx_int8() && (mla_i8_variants() & 2)) << 2; }

/* The rows from which the AMX variant takes the tiles: fewer stream the weight as fast through the VNNI products */
#define AMX_W8A8_ROWS 8

/* Fewer rows than this read each thread's share of the weight as long streams (w8a8_streams); more pass over tiles of
 * adjacent rows kept in cache (w8a8_rows). A [2816, 2048] weight streamed from memory, 2-core Xeon, VNNI: 8 rows 388
 * -> 255 µs, 16 rows 613 -> 477; AVX2: 4 rows 587 -> 303 (bench_gemv.py --families w8a8); from about 48 rows the two
 * tie. */
#ifndef W8A8_STREAM_ROWS
#define W8A8_STREAM_ROWS 33
#endif

void mla_gemm_w8a8(const int8_t *w, const float *scale, const float *x, const float *row_amax, float *y, int64_t rows,
                   int64_t n, int64_t k, int64_t threads, int64_t variant) {
    if (variant < 0) variant = mla_w8a8_variants() >> 2 & 1 ? 2 : mla_i8_variants() >> 1 & 1;
    const int vnni = variant >= 1, tiles = variant == 2 && rows >= AMX_W8A8_ROWS;
    int16_t *xq = (int16_t *)alloc_lines((size_t)(rows * k) * sizeof(int16_t));
    float *sx = (float *)malloc((size_t)rows * sizeof(float));
    if (!xq || !sx) abort(); /* ops/cpu_kernels.cpp bounds the rows a call takes */
    #pragma omp parallel for num_threads((int)(rows >= 8 ? threads : 1))  /* a decode step's rows: no fork */
    for (int64_t j = 0; j < rows; j++) sx[j] = quantize_row_i8(x + j * k, xq + j * k, k, row_amax ? row_amax + j : NULL);
    if (tiles) {
        mla_amx_w8a8(w, scale, xq, sx, y, rows, n, k, threads);
    } else if (rows == 1) {  /* a decode step's row: the weight read as streams (w8a8_share), the same bits */
        #pragma omp parallel num_threads((int)threads)
        (vnni ? w8a8_share_avx512 : w8a8_share_avx2)(w, scale, xq, sx[0], y, n, k, 1.0f, 0);
    } else if (vnni) {
        uint8_t *xu = (uint8_t *)alloc_lines((size_t)(rows * k));
        if (!xu) abort();
        for (int64_t i = 0; i < rows * k; i++) xu[i] = (uint8_t)(xq[i] + 128);
        (rows < W8A8_STREAM_ROWS ? w8a8_streams_avx512 : w8a8_rows_avx512)(w, scale, xq, xu, sx, y, rows, n, k, threads);
        free(xu);
    } else {
        (rows < W8A8_STREAM_ROWS ? w8a8_streams_avx2 : w8a8_rows_avx2)(w, scale, xq, NULL, sx, y, rows, n, k, threads);
    }
    free(xq);
    free(sx);
}

float mla_w8a8_prepare(const float *x, int16_t *xq, int64_t k) { return quantize_row_i8(x, xq, k, NULL); }

/* Inside a parallel region: this thread's share of the rows of y [n] = alpha (W x) (+ y when add) for one input row
 * prepared by mla_w8a8_prepare (xq, sx); the same bits as mla_gemm_w8a8's row. No barrier. */
void mla_w8a8_share(int64_t variant, const int8_t *w, const float *scale, const int16_t *xq, float sx, float *y,
                    int64_t n, int64_t k, float alpha, int add) {
    (variant >= 1 ? w8a8_share_avx512 : w8a8_share_avx2)(w, scale, xq, sx, y, n, k, alpha, add);
}
