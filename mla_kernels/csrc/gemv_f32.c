/* Products of one or a few rows with a weight matrix for x86-64 with AVX2 and FMA: float32 W, or int8 W with one
 * float32 scale per row (read at one byte per weight; the input rows rounded to int16 with a power-of-two scale and
 * multiplied with integer multiply-adds). Also the one-thread RMSNorm, and a dense MLP or a MoE layer of one row
 * (router, routing, experts) in one call.
 *
 * Compiled into the typed torch operators (ops/cpu_kernels.cpp) and linked against the OpenMP runtime PyTorch
 * loaded, so its threads are PyTorch's. One-row products: each thread takes a contiguous range of
 * rows and reads it as two sequential streams, the range's two halves side by side (one stream per thread reached
 * about 8.5 GB/s a core on a 2-core EPYC, two 10-20 % more; four rows interleaved were up to 2x slower on int8 rows
 * of 1 KB). x stays in L1. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"
#include "simd.h"

#define MOE_MAX_TOPK MLA_MOE_MAX_TOPK

static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Two rows' dot products with x, side by side: two sequential streams, two accumulators each. */
static inline void dot2_f32(const float *wa, const float *wb, const float *x, int64_t k, float *ya, float *yb) {
    const int64_t k16 = k - k % 16;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t i = 0;
    for (; i < k16; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wa + i), x0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wa + i + 8), x1, a1);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(wb + i), x0, b0);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(wb + i + 8), x1, b1);
    }
    float sa = hsum(_mm256_add_ps(a0, a1)), sb = hsum(_mm256_add_ps(b0, b1));
    for (; i < k; i++) {
        sa += wa[i] * x[i];
        sb += wb[i] * x[i];
    }
    *ya = sa;
    *yb = sb;
}

/* x [k] as int16 with one power-of-two scale (|q| <= 16383; exact for values of few significant bits), for the
 * int8 products below; returns the scale. Each value is x times a power of two, rounded to the nearest integer (ties
 * to even), eight at a time. A row holding infinity or NaN gets zeros and a NaN scale: its products come out NaN. */
static float quantize16(const float *x, int16_t *q, int64_t k) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
    __m256 mv = _mm256_setzero_ps(), bad = mv;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
        mv = _mm256_max_ps(mv, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  /* infinity or NaN */
    }
    float amax = hmax8(mv);
    int finite = _mm256_movemask_ps(bad) == 0;
    for (; i < k; i++) {
        finite &= isfinite(x[i]) != 0;
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    if (!finite) {
        memset(q, 0, (size_t)k * sizeof(int16_t));
        return NAN;
    }
    int e = 0;
    if (amax > 0.0f) frexpf(amax / 16383.0f, &e);  /* 2^e >= amax / 16383 */
    const float inv = ldexpf(1.0f, -e);
    const __m256 iv = _mm256_set1_ps(inv);
    for (i = 0; i + 16 <= k; i += 16) {  /* the conversion rounds as lrintf does, to nearest even */
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), iv));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8));
    }
    for (; i < k; i++) q[i] = (int16_t)lrintf(x[i] * inv);
    return ldexpf(1.0f, e);
}

static inline __m256i madd8(const int8_t *w, const int16_t *x) {  /* 16 int8 x int16 products, summed in pairs */
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)),
                             _mm256_loadu_si256((const __m256i *)x));
}

/* Two int8 rows' dot products with the int16 row xq: integer multiply-adds (one instruction per 16 weights where
 * widening to float takes three per 8), int32 sums moved to float every I16_CHUNK values, before they could
 * overflow (127 * 16383 * 2 per pair and step). Each chunk's sum is added in the order few_i8 adds it, so a row
 * decoded alone gets the bits it gets among others (a speculative verification's rows). */
#define I16_CHUNK 4096
#define I8_STREAM_ROWS 8  /* products of more rows take many_i8_rows (below) */
static inline void dot2_i16(const int8_t *wa, const int8_t *wb, const int16_t *xq, int64_t k, float *ya, float *yb) {
    const int64_t k16 = k - k % 16;
    float sa = 0.0f, sb = 0.0f;
    for (int64_t c = 0; c < k16; c += I16_CHUNK) {
        const int64_t end = c + I16_CHUNK < k16 ? c + I16_CHUNK : k16;
        __m256i a = _mm256_setzero_si256(), b = a;
        for (int64_t i = c; i < end; i += 16) {
            a = _mm256_add_epi32(a, madd8(wa + i, xq + i));
            b = _mm256_add_epi32(b, madd8(wb + i, xq + i));
        }
        sa += hsum(_mm256_cvtepi32_ps(a));
        sb += hsum(_mm256_cvtepi32_ps(b));
    }
    for (int64_t i = k16; i < k; i++) {
        sa += (float)wa[i] * xq[i];
        sb += (float)wb[i] * xq[i];
    }
    *ya = sa;
    *yb = sb;
}

/* A weight operand, as the tables hold it (mla_cpu.h): op[0] the weight, op[1] its scales, op[2] its kind. */

static inline __m256 widen_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float bf16_value(uint16_t v) {
    union { uint32_t u; float f; } bits = {(uint32_t)v << 16};
    return bits.f;
}

/* float16 weights, widened exactly by the F16C conversion (every AVX2 CPU has it). */
static inline __m256 widen_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline float f16_value(uint16_t v) { return _cvtsh_ss(v); }

/* dot2_f32 with half-precision rows (bfloat16 or float16: WIDEN and VALUE). */
#define DOT2_HALF(NAME, WIDEN, VALUE)                                                                                \
    static inline void NAME(const uint16_t *wa, const uint16_t *wb, const float *x, int64_t k, float *ya,            \
                            float *yb) {                                                                             \
        const int64_t k16 = k - k % 16;                                                                              \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;                                                  \
        int64_t i = 0;                                                                                               \
        for (; i < k16; i += 16) {                                                                                   \
            const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);                              \
            a0 = _mm256_fmadd_ps(WIDEN(wa + i), x0, a0);                                                             \
            a1 = _mm256_fmadd_ps(WIDEN(wa + i + 8), x1, a1);                                                         \
            b0 = _mm256_fmadd_ps(WIDEN(wb + i), x0, b0);                                                             \
            b1 = _mm256_fmadd_ps(WIDEN(wb + i + 8), x1, b1);                                                         \
        }                                                                                                            \
        float sa = hsum(_mm256_add_ps(a0, a1)), sb = hsum(_mm256_add_ps(b0, b1));                                    \
        for (; i < k; i++) {                                                                                         \
            sa += VALUE(wa[i]) * x[i];                                                                               \
            sb += VALUE(wb[i]) * x[i];                                                                               \
        }                                                                                                            \
        *ya = sa;                                                                                                    \
        *yb = sb;                                                                                                    \
    }
DOT2_HALF(dot2_bf16, widen_bf16, bf16_value)
DOT2_HALF(dot2_f16, widen_f16, f16_value)

/* One input row in the forms the operands read: x (float32: float, half and FP4 weights), xq (int16, scale sx: int8
 * weights), x8 (prepared for int4 weights: mla_q8_prepare), xg (prepared for ggml block types: mla_gg_prepare), xw
 * (rounded to int8 per row, scale sw: W8A8 weights, mla_w8a8_prepare); a form no operand reads may be absent. */
typedef struct {
    const float *x;
    const int16_t *xq;
    float sx;
    const uint8_t *x8, *xg;
    const int16_t *xw;
    float sw;
} Row;

/* Inside a parallel region: this thread's share of rows [0, n) of y = alpha * (W x) (+ y when add), W the operand
 * op; float32 and int8 rows read as two streams. No barrier. */
static void product_rows(const int64_t *op, const Row *in, int64_t n, int64_t k, float alpha, int add, float *y) {
    if (W_IS_GG(op[2])) {
        mla_gg_share(op[2] - W_GG, (const int64_t *)op[0], in->xg, y, alpha, add);
        return;
    }
    if (W_IS_W8A8(op[2])) {
        mla_w8a8_share(op[2] - W_W8A8, (const int8_t *)op[0], (const float *)op[1], in->xw, in->sw, y, n, k, alpha,
                       add);
        return;
    }
    if (W_IS_FP4(op[2])) {
        mla_fp4_share(op[2] - W_FP4, (const uint8_t *)op[0], (const int64_t *)op[1], in->x, y, alpha, add);
        return;
    }
    if (W_IS_I4G(op[2])) {
        mla_i4g_share(op[2] - W_I4G, (const uint8_t *)op[0], (const int64_t *)op[1], in->x8, y, alpha, add);
        return;
    }
    if (W_IS_I4(op[2])) {
        mla_i4_share(op[2] - W_I4, (const uint8_t *)op[0], (const uint16_t *)op[1], in->x8, y, n, k, alpha, add);
        return;
    }
    const int8_t *wq = op[2] == W_I8 ? (const int8_t *)op[0] : NULL;
    const uint16_t *wh = op[2] == W_BF16 || op[2] == W_F16 ? (const uint16_t *)op[0] : NULL;
    const float *wf = (const float *)op[0], *scale = (const float *)op[1];
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt, half = (r1 - r0 + 1) / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t ra = r0 + i, rb = r0 + half + i < r1 ? r0 + half + i : ra;  /* an odd range's last row: twice */
        float va, vb;
        if (wq) {
            dot2_i16(wq + ra * k, wq + rb * k, in->xq, k, &va, &vb);
            va = va * in->sx * scale[ra];  /* as few_i8 rounds it */
            vb = vb * in->sx * scale[rb];
        } else if (wh && op[2] == W_BF16) {
            dot2_bf16(wh + ra * k, wh + rb * k, in->x, k, &va, &vb);
        } else if (wh) {
            dot2_f16(wh + ra * k, wh + rb * k, in->x, k, &va, &vb);
        } else {
            dot2_f32(wf + ra * k, wf + rb * k, in->x, k, &va, &vb);
        }
        y[ra] = alpha * va + (add ? y[ra] : 0.0f);
        if (rb != ra) y[rb] = alpha * vb + (add ? y[rb] : 0.0f);
    }
}

void mla_gemv_f32(const float *w, const float *x, float *y, int64_t n, int64_t k, int64_t threads) {
    const int64_t op[3] = {(int64_t)(intptr_t)w, 0, W_F32};
    const Row in = {x, NULL, 0.0f, NULL, NULL, NULL, 0.0f};
    #pragma omp parallel num_threads((int)threads)
    product_rows(op, &in, n, k, 1.0f, 0, y);
}

void mla_gemv_half(const uint16_t *w, int64_t kind, const float *x, float *y, int64_t n, int64_t k,
                   int64_t threads) {
    const int64_t op[3] = {(int64_t)(intptr_t)w, 0, kind};
    const Row in = {x, NULL, 0.0f, NULL, NULL, NULL, 0.0f};
    #pragma omp parallel num_threads((int)threads)
    product_rows(op, &in, n, k, 1.0f, 0, y);
}

void mla_gemv_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t n, int64_t k,
                 int64_t threads) {
    int16_t xq[k];
    const float sx = quantize16(x, xq, k);
    const int64_t op[3] = {(int64_t)(intptr_t)w, (int64_t)(intptr_t)scale, W_I8};
    const Row in = {NULL, xq, sx, NULL, NULL, NULL, 0.0f};
    #pragma omp parallel num_threads((int)threads)
    product_rows(op, &in, n, k, 1.0f, 0, y);
}

/* Bytes ahead of the weight row being read that the few-row kernels prefetch (float32; half weights, read at half
 * the rate, half as far): measured best of 1, 2 and 4 KB. */
#define PF_BYTES(T) (sizeof(T) == 4 ? 2048 : 1024)

/* Inside a parallel region: this thread's rows of [0, n), read as R streams side by side (R parts of len rows from
 * r0). Weight rows shorter than a page taken a few at a time kept the prefetchers starting over; long streams (and a
 * software prefetch) read them 1.4-1.7x faster at eight rows (bench/bench_gemv.py, 2-core AVX-512 EPYC). */
static inline void stream_split(int64_t n, int R, int64_t *r0, int64_t *r1, int64_t *len) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    *r0 = n * t / nt;
    *r1 = n * (t + 1) / nt;
    *len = (*r1 - *r0 + R - 1) / R;
}

/* Step i's rows of the range [r0, r1): one from each stream (a short last stream repeats the range's last row, which
 * gives the same value again). */
static inline void stream_rows(int64_t r0, int64_t r1, int64_t len, int R, int64_t i, int64_t *rows) {
    for (int q = 0; q < R; q++) rows[q] = r0 + q * len + i < r1 ? r0 + q * len + i : r1 - 1;
}

/* Runs the statements that follow (the macro's arguments) once per step of this thread's streams, in a parallel region
 * of the caller's `threads` threads, with rows[0..R) the step's weight rows (stream_split, stream_rows). */
#define FOR_STREAM_ROWS(n, R, ...)                                                                                   \
    _Pragma("omp parallel num_threads((int)threads)")                                                                \
    {                                                                                                                \
        int64_t r0_, r1_, len_;                                                                                      \
        stream_split(n, R, &r0_, &r1_, &len_);                                                                       \
        for (int64_t i_ = 0; i_ < len_; i_++) {                                                                      \
            int64_t rows[4];                                                                                         \
            stream_rows(r0_, r1_, len_, R, i_, rows);                                                                \
            __VA_ARGS__                                                                                              \
        }                                                                                                            \
    }

/* CALL(M) with M the value of v, a constant in each case: 1 to 4, or 1 to 8. */
#define CASES4(v, CALL) \
    switch (v) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; default: CALL(4); break; }
#define CASES8(v, CALL) \
    switch (v) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; case 5: CALL(5); break; \
                 case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

/* The few-row float drivers' loop: each thread's weight rows as R streams (stream_split), the m input rows BLOCK (at
 * most four) at a time, each block of M rows at row c through the weight kind's kernel: F32(M), BF16(M) or F16(M). */
#define KIND_BLOCKS(R, BLOCK, F32, BF16, F16)                                                                        \
    FOR_STREAM_ROWS(n, R,                                                                                            \
        for (int64_t c = 0; c < m; c += (BLOCK)) {                                                                   \
            const int64_t mb = m - c < (BLOCK) ? m - c : (BLOCK);                                                    \
            if (kind == W_F32) CASES4(mb, F32)                                                                       \
            else if (kind == W_BF16) CASES4(mb, BF16)                                                                \
            else CASES4(mb, F16)                                                                                     \
        })

/* Products of more rows than a decode step's (a prefill chunk's): each thread takes a contiguous part of the weight
 * rows in blocks of about I8_BLOCK_BYTES (they stay in L2), and each block passes over the input rows four at a time,
 * the block's weight rows R at a time against the four while their int16 rows stay in L1. The streaming drivers pass
 * every input row over each step's weight rows instead: 128 KB of int16 rows from L2 a step for 64 rows of 1024. 64
 * rows of [4096, 1024] / [1024, 2048] / [32000, 1024] on a 2-core Zen 5 EPYC (bench/bench_quant_rows.py), streaming
 * -> blocks: AVX2 2.68 / 1.38 / 21.9 -> 1.50 / 0.73 / 12.8 ms, VNNI 1.84 / 0.82 / 14.9 -> 0.83 / 0.35 / 7.4 ms. The
 * same kernels on the same chunks, so the same bits as the streaming drivers; where a block's rows run out, a step
 * repeats the block's last row (the same value written again). */
#define I8_BLOCK_BYTES (256 << 10)
#define I8_TILE_ROWS 4  /* input rows a step */
#define MANY_I8_ROWS(R, CALL)                                                                                        \
    _Pragma("omp parallel num_threads((int)threads)")                                                                \
    {                                                                                                                \
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();                                          \
        const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt;                                                        \
        const int64_t block = I8_BLOCK_BYTES / k > (R) ? I8_BLOCK_BYTES / k / (R) * (R) : (R);                       \
        for (int64_t b = r0; b < r1; b += block) {                                                                   \
            const int64_t be = b + block < r1 ? b + block : r1;                                                      \
            for (int64_t c = 0; c < rows_in; c += I8_TILE_ROWS) {                                                    \
                const int64_t mb = rows_in - c < I8_TILE_ROWS ? rows_in - c : I8_TILE_ROWS;                          \
                for (int64_t s0 = b; s0 < be; s0 += (R)) {                                                           \
                    const int64_t last = be - 1, rows[4] = {s0, s0 + 1 < be ? s0 + 1 : last,                         \
                                                            s0 + 2 < be ? s0 + 2 : last, s0 + 3 < be ? s0 + 3 : last}; \
                    CASES4(mb, CALL)                                                                                 \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }

/* The few-row kernels, once per instruction set (few_rows.h): few_float, few_i8_rows and many_i8_rows, suffixed _avx2
 * and _avx512 (the integer ones with VNNI). */
#include "vec_avx2.h"
#include "few_rows.h"
#include "vec_end.h"
#include "vec_avx512.h"
#include "few_rows.h"
#include "vec_end.h"

/* The few-row products' variants this CPU runs, bit i for variant i (0: AVX2; 1: AVX-512, with VNNI for int8); a call
 * names one, or -1 for the fastest. */
int64_t mla_float_variants(void) { return 1 | (mla_isa_runs(MLA_CPU_AVX512, MLA_ISA_AVX512) << 1); }
int64_t mla_i8_variants(void) { return 1 | (mla_isa_runs(MLA_CPU_AVX512 | MLA_CPU_VNNI, MLA_ISA_AVX512) << 1); }

/* The variant a call runs: the one named, else (-1) the AVX-512 one for float32 weights from four rows on and for half
 * weights from two, where it measured faster than the AVX2 one with the weights streamed (bench/bench_gemv.py on a
 * 2-core AVX-512 EPYC: eight rows of [4096, 1024] float32 0.79 against 1.68 ms, bfloat16 0.58 against 1.13 ms);
 * fewer rows stream their weights as fast or faster through the AVX2 one. */
static int use_avx512(int64_t variant, int64_t kind, int64_t m) {
    return variant < 0 ? (mla_float_variants() >> 1 & 1) && m >= (kind == W_F32 ? 4 : 2) : variant == 1;
}

void mla_gemm_few_f32(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t threads,
                      int64_t variant) {
    (use_avx512(variant, W_F32, m) ? few_float_avx512 : few_float_avx2)(w, W_F32, x, y, m, n, k, threads);
}

void mla_gemm_few_half(const uint16_t *w, int64_t kind, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                       int64_t threads, int64_t variant) {
    (use_avx512(variant, kind, m) ? few_float_avx512 : few_float_avx2)(w, kind, x, y, m, n, k, threads);
}

/* Any number of rows (each row's result does not depend on the others: a verification step's rows come out as the
 * same rows decoded one by one would). Each thread's weight rows are read as streams (stream_split), and each step's
 * weight rows are multiplied into every input row, eight (VNNI) or four (AVX2) at a time, while they are in cache:
 * a prefill's rows read the weight once. */
void mla_gemm_few_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t rows, int64_t n, int64_t k,
                     int64_t threads, int64_t variant) {
    const int vnni = variant < 0 ? (int)(mla_i8_variants() >> 1 & 1) : variant == 1;
    int16_t *xq = (int16_t *)alloc_lines((size_t)(rows * k) * sizeof(int16_t));
    float *sx = (float *)malloc((size_t)rows * sizeof(float));
    if (!xq || !sx) abort();  /* a few hundred kilobytes: ops/cpu_kernels.cpp bounds the rows */
    #pragma omp parallel for num_threads((int)(rows > I8_STREAM_ROWS ? threads : 1))  /* a decode step's: no fork */
    for (int64_t j = 0; j < rows; j++) sx[j] = quantize16(x + j * k, xq + j * k, k);
    if (rows > I8_STREAM_ROWS)
        (vnni ? many_i8_rows_avx512 : many_i8_rows_avx2)(w, scale, xq, sx, y, rows, n, k, threads);
    else
        (vnni ? few_i8_rows_avx512 : few_i8_rows_avx2)(w, scale, xq, sx, y, rows, n, k, threads);
    free(xq);
    free(sx);
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
 * routed the row to plus its shared experts (or one dense MLP). table [*, MLP_FIELDS] holds each MLP's gate_up
 * [2 I, d] and down [d, I] operands (weight, scales, kind: product_rows) and I; ids and w name the n MLPs and their
 * weights. Inside a parallel region: each product's rows are split over the threads, with a barrier between the
 * products. scratch: 3 max(I) floats; xs and as: the input rows' int16 and int4-prepared forms (d and max(I)
 * values: QBuf), shared by the team. */

typedef struct {
    int16_t *xq;
    uint8_t *x8, *xg;
    int16_t *xw;
    float sx, sw;
} QBuf;

/* (one thread) the forms of x [k] that operands of these kinds read */
static Row prepare_row(const float *x, int64_t k, int kinds, QBuf *q) {
    Row in = {x, NULL, 0.0f, NULL, NULL, NULL, 0.0f};
    if (kinds & (1 << W_I8)) {
        q->sx = quantize16(x, q->xq, k);
        in.xq = q->xq;
        in.sx = q->sx;
    }
    if (kinds & (1 << W_I4)) {
        mla_q8_prepare(x, 1, k, q->x8);
        in.x8 = q->x8;
    }
    if (kinds & (1 << W_GG)) {
        mla_gg_prepare(x, k, q->xg);
        in.xg = q->xg;
    }
    if (kinds & (1 << W_W8A8)) {
        q->sw = mla_w8a8_prepare(x, q->xw, k);
        in.xw = q->xw;
        in.sw = q->sw;
    }
    return in;
}

static int kind_bit(int64_t kind) {  /* the input form a kind reads: float32 rows for float32, half and FP4 weights */
    if (W_IS_GG(kind)) return 1 << W_GG;
    if (W_IS_W8A8(kind)) return 1 << W_W8A8;
    if (W_IS_I4G(kind)) return 1 << W_I4;  /* the int4 kernels' prepared row */
    return kind == W_BF16 || kind == W_F16 || W_IS_FP4(kind) ? 1 << W_F32 : 1 << (W_IS_I4(kind) ? W_I4 : (int)kind);
}

static void gated_mlps(const float *x, float *y, int64_t d, const int64_t *table, const int64_t *ids, const float *w,
                       int64_t n, float *scratch, QBuf *xs, QBuf *as) {
    if (n == 0) {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < d; r++) y[r] = 0.0f;
    }
    int kinds = 0;
    for (int64_t e = 0; e < n; e++) kinds |= kind_bit(table[ids[e] * MLP_FIELDS + 2]);
    #pragma omp single
    prepare_row(x, d, kinds, xs);  /* cheap next to any product */
    const Row in = {x, xs->xq, xs->sx, xs->x8, xs->xg, xs->xw, xs->sw};
    for (int64_t e = 0; e < n; e++) {
        const int64_t *mlp = table + ids[e] * MLP_FIELDS, inter = mlp[6];
        float *act = scratch + 2 * inter;
        product_rows(mlp, &in, 2 * inter, d, 1.0f, 0, scratch);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < inter; r++) act[r] = scratch[r] / (1.0f + expf(-scratch[r])) * scratch[inter + r];
        if (mlp[5] != W_F32) {
            #pragma omp single
            prepare_row(act, inter, kind_bit(mlp[5]), as);
        }
        const Row mid = {act, as->xq, as->sx, as->x8, as->xg, as->xw, as->sw};
        product_rows(mlp + 3, &mid, d, inter, w[e], e > 0, y);
        #pragma omp barrier  /* the next MLP's gate_up output overwrites the scratch this one read */
    }
}

/* The largest intermediate size among the n MLPs ids names. */
static int64_t largest_inter(const int64_t *table, const int64_t *ids, int64_t n) {
    int64_t m = 1;
    for (int64_t e = 0; e < n; e++) m = table[ids[e] * MLP_FIELDS + 6] > m ? table[ids[e] * MLP_FIELDS + 6] : m;
    return m;
}

void mla_gated_mlps(const float *x, float *y, int64_t d, const int64_t *table, const int64_t *ids, const float *w,
                    int64_t n, float *scratch, int64_t threads) {
    const int64_t inter = largest_inter(table, ids, n);
    int16_t xq[d], aq[inter], xw[d], aw[inter];
    uint8_t x8[mla_q8_row_bytes(d)], a8[mla_q8_row_bytes(inter)];
    uint8_t xg[mla_gg_prepared_bytes(d)], ag[mla_gg_prepared_bytes(inter)];
    QBuf xs = {xq, x8, xg, xw, 0.0f, 0.0f}, as = {aq, a8, ag, aw, 0.0f, 0.0f};
    #pragma omp parallel num_threads((int)threads)
    gated_mlps(x, y, d, table, ids, w, n, scratch, &xs, &as);
}

/* n gated MLPs (table rows ids) of one row x [d], each output apart, unweighted: out [n, d], in one parallel region:
 * every gate_up product, then the activations (each MLP's prepared on its own), then every down product, with
 * barriers between the three only. Each product's rows are split over the threads by product_rows, whose row has the
 * bits of the whole-matrix kernels' (the layer's several-row path, mla_layer_f32.c). */
void mla_mlps_row(const float *x, int64_t d, const int64_t *table, const int64_t *ids, int64_t n, float *out,
                  int64_t threads) {
    const int64_t inter = largest_inter(table, ids, n), q8 = mla_q8_row_bytes(inter), gg = mla_gg_prepared_bytes(inter);
    int kinds = 0;
    for (int64_t e = 0; e < n; e++) kinds |= kind_bit(table[ids[e] * MLP_FIELDS + 2]);
    int16_t xq[d], xw[d];
    uint8_t x8[mla_q8_row_bytes(d)], xg[mla_gg_prepared_bytes(d)];
    QBuf xs = {xq, x8, xg, xw, 0.0f, 0.0f};
    float *gate_up = (float *)malloc((size_t)(n * 3 * inter) * sizeof(float));
    int16_t *aq = (int16_t *)malloc((size_t)(n * 2 * inter) * sizeof(int16_t));
    uint8_t *a8 = (uint8_t *)malloc((size_t)(n * (q8 + gg))), *ag = a8 + n * q8;
    QBuf *as = (QBuf *)malloc((size_t)n * sizeof(QBuf));
    if (!gate_up || !aq || !a8 || !as) abort();
    for (int64_t e = 0; e < n; e++) {
        const QBuf b = {aq + e * 2 * inter, a8 + e * q8, ag + e * gg, aq + e * 2 * inter + inter, 0.0f, 0.0f};
        as[e] = b;
    }
    #pragma omp parallel num_threads((int)threads)
    {
        #pragma omp single
        prepare_row(x, d, kinds, &xs);
        const Row in = {x, xs.xq, xs.sx, xs.x8, xs.xg, xs.xw, xs.sw};
        for (int64_t e = 0; e < n; e++) {
            const int64_t *mlp = table + ids[e] * MLP_FIELDS;
            product_rows(mlp, &in, 2 * mlp[6], d, 1.0f, 0, gate_up + e * 2 * inter);
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < n; e++) {
            const int64_t *mlp = table + ids[e] * MLP_FIELDS, I = mlp[6];
            const float *g = gate_up + e * 2 * inter;
            float *act = gate_up + n * 2 * inter + e * inter;
            for (int64_t r = 0; r < I; r++) act[r] = g[r] / (1.0f + expf(-g[r])) * g[I + r];
            if (mlp[5] != W_F32) prepare_row(act, I, kind_bit(mlp[5]), &as[e]);
        }
        for (int64_t e = 0; e < n; e++) {
            const int64_t *mlp = table + ids[e] * MLP_FIELDS;
            const float *act = gate_up + n * 2 * inter + e * inter;
            const Row mid = {act, as[e].xq, as[e].sx, as[e].x8, as[e].xg, as[e].xw, as[e].sw};
            product_rows(mlp + 3, &mid, d, mlp[6], 1.0f, 0, out + e * d);
        }
    }
    free(gate_up);
    free(aq);
    free(a8);
    free(as);
}

/* The index of the largest of v[0:n] not yet taken (ties: the lowest index), or -1. */
static int64_t argmax_free(const float *v, const char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* DeepSeek's routing of one row (mla_runtime.layers.moe.Router): logits [E] -> the top_k experts' ids (ascending)
 * and weights. route[8] = {scoring (0 softmax, 1 sigmoid), method (0 greedy, 1 group-limited greedy, 2 noaux_tc),
 * n_group, topk_group, top_k, norm_topk_prob, E, 0}; bias: the noaux_tc correction (or NULL). scratch: 3 E floats
 * and E + n_group bytes. Returns top_k. */
static int64_t route(const float *logits, const int64_t *cfg, const float *bias, float scaling, int64_t *ids,
                     float *w, float *scratch) {
    const int64_t E = cfg[6], n_group = cfg[2], per = E / n_group, top_k = cfg[4];
    float *score = scratch, *choice = scratch + E, *group = scratch + 2 * E;
    char *taken = (char *)(scratch + 3 * E), *keep = taken + E;
    float mx = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    for (int64_t e = 0; e < E; e++) {
        score[e] = cfg[0] ? 1.0f / (1.0f + expf(-logits[e])) : expf(logits[e] - mx);
        sum += score[e];
    }
    for (int64_t e = 0; e < E; e++) {
        if (!cfg[0]) score[e] /= sum;
        choice[e] = bias ? score[e] + bias[e] : score[e];
        taken[e] = 0;
    }
    if (cfg[1] == 1 || (cfg[1] == 2 && n_group > 1)) {  /* keep the topk_group best groups */
        for (int64_t g = 0; g < n_group; g++) {
            const float *c = choice + g * per;
            float a = -INFINITY, b = -INFINITY;  /* the group's largest two */
            for (int64_t i = 0; i < per; i++) {
                if (c[i] > a) { b = a; a = c[i]; } else if (c[i] > b) b = c[i];
            }
            group[g] = cfg[1] == 2 ? a + b : a;
            keep[g] = 0;
        }
        for (int64_t i = 0; i < cfg[3]; i++) {
            const int64_t g = argmax_free(group, keep, n_group);
            if (g >= 0) keep[g] = 1;
        }
        for (int64_t e = 0; e < E; e++)
            if (!keep[e / per]) choice[e] = cfg[1] == 1 ? 0.0f : -INFINITY;
    }
    float total = 0.0f;
    for (int64_t i = 0; i < top_k; i++) {
        const int64_t e = argmax_free(choice, taken, E);
        taken[e] = 1;
        total += score[e];
    }
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)  /* ascending ids: the order the experts' outputs are summed in */
        if (taken[e]) {
            ids[n] = e;
            w[n++] = score[e];
        }
    for (int64_t i = 0; i < n; i++) w[i] = (cfg[5] ? w[i] / (total + 1e-20f) : w[i]) * scaling;
    return n;
}

/* route() for the other sources: one row's routing (scratch: 4 E + n_group floats will do) */
int64_t mla_route_row(const float *logits, const int64_t *cfg, const float *bias, float scaling, int64_t *ids,
                      float *w, float *scratch) {
    return route(logits, cfg, bias, scaling, ids, w, scratch);
}

/* A MoE layer for one row x [d]: router logits (router [E, d] float32), the routing, then this rank's chosen
 * experts (global ids first .. first + count - 1 are table rows 0 .. count - 1) and the shared experts (table row
 * shared, or -1), summed into y, all in one parallel region. scratch: 3 max(I) + 4 E + n_group floats. */
void mla_moe_row(const float *x, float *y, int64_t d, const float *router, const int64_t *cfg, const float *bias,
                 float scaling, const int64_t *table, int64_t first, int64_t count, int64_t shared, float *scratch,
                 int64_t max_inter, int64_t threads) {
    const int64_t E = cfg[6];
    float *logits = scratch + 3 * max_inter, *route_scratch = logits + E, *w = route_scratch + 4 * E + cfg[2];
    int64_t ids[MOE_MAX_TOPK + 1];
    int64_t n = 0;
    int16_t xq[d], aq[max_inter], xw[d], aw[max_inter];
    uint8_t x8[mla_q8_row_bytes(d)], a8[mla_q8_row_bytes(max_inter)];
    uint8_t xg[mla_gg_prepared_bytes(d)], ag[mla_gg_prepared_bytes(max_inter)];
    QBuf xs = {xq, x8, xg, xw, 0.0f, 0.0f}, as = {aq, a8, ag, aw, 0.0f, 0.0f};
    const int64_t router_op[3] = {(int64_t)(intptr_t)router, 0, W_F32};
    const Row in = {x, NULL, 0.0f, NULL, NULL, NULL, 0.0f};
    #pragma omp parallel num_threads((int)threads)
    {
        product_rows(router_op, &in, E, d, 1.0f, 0, logits);
        #pragma omp barrier
        #pragma omp single
        {
            int64_t chosen[MOE_MAX_TOPK];
            float weight[MOE_MAX_TOPK];
            const int64_t k = route(logits, cfg, bias, scaling, chosen, weight, route_scratch);
            for (int64_t i = 0; i < k; i++)
                if (chosen[i] >= first && chosen[i] < first + count) {
                    ids[n] = chosen[i] - first;
                    w[n++] = weight[i];
                }
            if (shared >= 0) {
                ids[n] = shared;
                w[n++] = 1.0f;
            }
        }
        gated_mlps(x, y, d, table, ids, w, n, scratch, &xs, &as);
    }
}
