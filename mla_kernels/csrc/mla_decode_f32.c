/* Absorbed MLA decode for x86-64 with AVX2 and FMA (AVX-512 where the CPU has it): float32 queries, float32 or
 * bfloat16 absorbed factors, a float32, bfloat16, float16, int8 or float8_e4m3fn latent cache (CacheKind; the last
 * two with a scale per token and part). For query row t
 * and head h, with c_j / k_r_j the latent and RoPE key of the row's j-th cached token:
 *
 *     q~ = W_UK[h]^T q_n[t, h]                                   (d_c values)
 *     s_j = scale * (q~ . c_j + q_r[t, h] . k_r_j),  j < len[t]
 *     o_lat = sum_j softmax(s)_j c_j                             (d_c values)
 *     out[t, h] = W_UV[h] o_lat = sum_c o_lat[c] W_UV^T[h][c, :]  (d_v values)
 *
 * One call does a whole layer's decode attention: the absorption, the attention over the cache and the
 * up-projection, where torch needs a batched product, a concatenation, a gather, two more batched products and a
 * softmax. Each thread takes a group of heads for every row: it reads each head's 2 * d_c * d_n
 * weights from memory once and again from its cache for the head's other rows. The caller provides each thread's
 * scratch (q~, o_lat and the scores: 2 * d_c + max(lens) floats).
 *
 * The same source holds the prefill's attention over the keys and values the up-projection rebuilt (causal, one
 * RoPE key per token shared by the heads): mla_prefill_attention_f32.
 *
 * The attention's source (decode_attention.h) is written over a vector of VL floats and compiled twice here, for
 * AVX2 (8 lanes) and AVX-512 (16), chosen at run time. Compiled with gemv_f32.c into the typed operators
 * (ops/cpu_kernels.cpp). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"
#include "simd.h"

#define MAX_GROUP MLA_DECODE_MAX_GROUP  /* heads per thread */

#define DECODE_PARAMS                                                                                                \
    const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t, int64_t qr_h, const void *w_uk,    \
        const void *w_uv_t, const void *cache, const float *cache_scales, const int64_t *slots, int64_t slot_stride, \
        const int64_t *lens, float scale, float *out, float *scratch, int64_t scratch_stride, int64_t rows,          \
        int64_t heads, int64_t d_n, int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads
#define DECODE_ARGS                                                                                                  \
    q_n, qn_t, qn_h, q_r, qr_t, qr_h, w_uk, w_uv_t, cache, cache_scales, slots, slot_stride, lens, scale, out,       \
        scratch, scratch_stride, rows, heads, d_n, d_r, d_c, d_v, threads

/* Ask for n bytes at p in cache, front to back: one sequential stream the memory system can run ahead on (the
 * products below read their weights by column blocks, which the hardware prefetchers follow poorly from memory). */
static inline void prefetch(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

static inline __attribute__((always_inline)) float load1(const void *b, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)b)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)b)[i];
}

/* The factor value at (i, j) of a head's k x n factor b in format wf (FactorFormat), alone. */
static inline __attribute__((always_inline)) float load1w(const void *b, int64_t k, int64_t n, int64_t i, int64_t j,
                                                          const int wf) {
    if (wf == FACTOR_RUNS) {
        const float *a = (const float *)((const int8_t *)b + k * n) + i / FACTOR_RUN * n + j;
        return fmaf(a[0], (float)((const int8_t *)b)[i * n + j], a[k / FACTOR_RUN * n]);
    }
    return load1(b, i * n + j, wf == FACTOR_BF16);
}

/* Bytes of a head's k x n factor in format wf. */
static inline __attribute__((always_inline)) int64_t factor_bytes(int64_t k, int64_t n, const int wf) {
    return wf == FACTOR_RUNS ? k * n + 8 * (k / FACTOR_RUN) * n : k * n * (wf == FACTOR_BF16 ? 2 : 4);
}

/* Bytes of a cached value. */
static inline __attribute__((always_inline)) int64_t cache_bytes(const int ck) {
    return ck == C_F32 ? 4 : ck == C_BF16 || ck == C_F16 ? 2 : 1;
}

static inline __attribute__((always_inline)) int quantised(const int ck) { return ck == C_I8 || ck == C_FP8; }

/* An e4m3 byte s.eeee.mmm as the float16 s.0eeee.mmm0000000, whose value is the e4m3 value / 2^8 exactly (exponent
 * biases 7 and 15; subnormals map to subnormals); the NaN bytes 0x7f / 0xff to a float16 NaN (gemv_fp8.c widens
 * sixteen at a time the same way). */
static inline uint16_t e4m3_half_bits(uint8_t b) {
    const uint16_t mag = b & 0x7F;
    return (uint16_t)(((b & 0x80) << 8) | (mag << 7) | (mag == 0x7F ? 0x7C00 : 0));
}

/* Cached value i from c, widened (ck a constant wherever this is inlined); an e4m3 value / 2^8 (kscale has the 2^8). */
static inline __attribute__((always_inline)) float load1c(const void *c, int64_t i, const int ck) {
    if (ck == C_F16) return _cvtsh_ss(((const uint16_t *)c)[i]);
    if (ck == C_I8) return (float)((const int8_t *)c)[i];
    if (ck == C_FP8) return _cvtsh_ss(e4m3_half_bits(((const uint8_t *)c)[i]));
    return load1(c, i, ck == C_BF16);
}

/* The factor a quantised cache row's part (0: the latent, 1: the RoPE key) is widened by: its scale (times 2^8 for
 * e4m3, which load1c / V_FP8 give divided by 2^8: exact); 1 for a float cache. */
static inline __attribute__((always_inline)) float kscale(const float *cs, int64_t slot, int part, const int ck) {
    return ck == C_I8 ? cs[2 * slot + part] : ck == C_FP8 ? cs[2 * slot + part] * 256.0f : 1.0f;
}

/* Cached value i (of the row at slot, part) dequantised: one rounding, as dequantize_rows. */
static inline __attribute__((always_inline)) float value_c(const void *c, int64_t i, const int ck, const float *cs,
                                                           int64_t slot, int part) {
    return quantised(ck) ? load1c(c, i, ck) * kscale(cs, slot, part, ck) : load1c(c, i, ck);
}

/* x . key[0:n] for a cached key row (part) of any kind, times its factor s: dot_f32 over its values dequantised (the
 * same sums as a float32 row of those values). */
static inline __attribute__((always_inline)) float dot_c(const float *x, const void *key, int64_t n, const int ck,
                                                         float s) {
    if (ck == C_F32) return dot_f32(x, (const float *)key, n);
    float wide[n];
    for (int64_t i = 0; i < n; i++) wide[i] = quantised(ck) ? load1c(key, i, ck) * s : load1c(key, i, ck);
    return dot_f32(x, wide, n);
}

/* Ask for a cached key row (bytes long) in L1. A row of DeepSeek's latent is 2304 bytes in float32, so consecutive
 * keys cross a 4 KB page every other row, where the hardware prefetchers stop; the scores ask for the pair of keys
 * KEYS_AHEAD ahead (bench/RESULTS.md: 10-20 % off the attention over 224 keys). */
#define KEYS_AHEAD 4
static inline void fetch_key(const void *key, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)key + b, _MM_HINT_T0);
}

/* How a call's threads share the work: a group of heads of every row each (a few rows: every thread reads every
 * row's keys), or from two rows a thread on, every head of a run of rows each (each key read by one thread, once for
 * all heads; measured on a 2-core Xeon, 32 rows of 192 keys: see bench/RESULTS.md). */
int64_t mla_decode_by_rows(int64_t rows, int64_t heads, int64_t threads) {
    return threads > 1 && rows >= 2 * threads && heads <= MAX_GROUP;
}

/* Scratch floats each thread of a call needs: q~ and o_lat of its rows and heads, and its heads' scores. */
int64_t mla_decode_scratch(int64_t rows, int64_t heads, int64_t d_c, int64_t slot_stride, int64_t threads) {
    if (mla_decode_by_rows(rows, heads, threads))
        return (rows + threads - 1) / threads * heads * 2 * d_c + heads * slot_stride;
    const int64_t group = (heads + threads - 1) / threads;
    return rows * group * 2 * d_c + group * slot_stride;
}

#define WEIGH_KEYS 32  /* keys a chunk of the weighted sum (decode_attention.h) */
#define PREFILL_ROWS MLA_PREFILL_ROWS  /* rows of one head a task of the prefill attention (decode_attention.h) */
#define GEMM_KC 128    /* rows of the absorbed factors a pass of small_gemm (decode_attention.h) */

#include "vec_exp.h"

/* Eight e4m3 bytes as float16 bits (e4m3_half_bits, eight lanes): the sign extended into bits 7-15, the magnitude
 * shifted to bits 7-13, bit 14 cleared, then set again for the NaN magnitude 0x7f (its + 0x80 carries into it). */
static inline __m128i e4m3_half8(const uint8_t *p) {
    const __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(v, 7), _mm_set1_epi16((short)0xBF80));
    return _mm_or_si128(h, _mm_and_si128(_mm_add_epi16(h, _mm_set1_epi16(0x80)), _mm_set1_epi16(0x4000)));
}

/* Sixteen e4m3 bytes as float16 bits (the same, sixteen lanes). */
static inline __m256i e4m3_half16(const uint8_t *p) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBF80));
    return _mm256_or_si256(h, _mm256_and_si256(_mm256_add_epi16(h, _mm256_set1_epi16(0x80)),
                                               _mm256_set1_epi16(0x4000)));
}

/* The attention for AVX2 (8 lanes) */
#include "vec_avx2.h"
#include "decode_attention.h"
#include "vec_end.h"

/* The attention for AVX-512 (16 lanes; F, BW, VL, DQ), the same source */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include "vec_avx512.h"
#include "decode_attention.h"
#include "vec_end.h"

/* One function per instruction set, factor format (f32, bf16w, runs) and cache kind, each with its own loops. */
#define DECODE_FORM(ISA, W, WB, C, CK) \
    static void decode_##ISA##_##W##_##C(DECODE_PARAMS) { absorbed_decode_##ISA(DECODE_ARGS, WB, CK); }
#define DECODE_FORMS(ISA, W, WB)                                                                                     \
    DECODE_FORM(ISA, W, WB, c32, C_F32) DECODE_FORM(ISA, W, WB, cbf16, C_BF16) DECODE_FORM(ISA, W, WB, cf16, C_F16) \
    DECODE_FORM(ISA, W, WB, ci8, C_I8) DECODE_FORM(ISA, W, WB, cfp8, C_FP8)
DECODE_FORMS(avx512, f32, FACTOR_F32)
DECODE_FORMS(avx512, bf16w, FACTOR_BF16)
DECODE_FORMS(avx512, runs, FACTOR_RUNS)
#pragma GCC pop_options
DECODE_FORMS(avx2, f32, FACTOR_F32)
DECODE_FORMS(avx2, bf16w, FACTOR_BF16)
DECODE_FORMS(avx2, runs, FACTOR_RUNS)

typedef void (*DecodeFn)(DECODE_PARAMS);
/* [AVX-512][factor format][cache kind] */
#define DECODE_ROW(ISA, W) {decode_##ISA##_##W##_c32, decode_##ISA##_##W##_cbf16, decode_##ISA##_##W##_cf16, \
                            decode_##ISA##_##W##_ci8, decode_##ISA##_##W##_cfp8}
static const DecodeFn DECODE[2][3][5] = {
    {DECODE_ROW(avx2, f32), DECODE_ROW(avx2, bf16w), DECODE_ROW(avx2, runs)},
    {DECODE_ROW(avx512, f32), DECODE_ROW(avx512, bf16w), DECODE_ROW(avx512, runs)}};

/* The variant a call runs: the one named (0 AVX2, 1 AVX-512), else (-1) AVX-512 where the CPU runs it (the same
 * probe as the few-row float products: mla_float_variants). */
static int attention_avx512(int64_t variant) { return variant < 0 ? (mla_float_variants() >> 1 & 1) : variant == 1; }

/* float32 W_UK and W_UV^T */
void mla_absorbed_decode_f32(DECODE_PARAMS, int64_t cache_kind, int64_t variant) {
    DECODE[attention_avx512(variant)][FACTOR_F32][cache_kind](DECODE_ARGS);
}

/* bfloat16 W_UK and W_UV^T (read at half the bytes; everything else float32) */
void mla_absorbed_decode_bf16w(DECODE_PARAMS, int64_t cache_kind, int64_t variant) {
    DECODE[attention_avx512(variant)][FACTOR_BF16][cache_kind](DECODE_ARGS);
}

/* W_UK and W_UV^T as runs of int8 values with a float32 scale and offset (FactorFormat): 1.25 bytes a value */
void mla_absorbed_decode_runs(DECODE_PARAMS, int64_t cache_kind, int64_t variant) {
    DECODE[attention_avx512(variant)][FACTOR_RUNS][cache_kind](DECODE_ARGS);
}

/* The prefill's up-projected attention (float32), by the variant a call runs. */
void mla_prefill_attention_f32(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                               int64_t qr_h, const float *kt, int64_t kt_h, int64_t kt_d, const float *krt,
                               int64_t krt_d, const float *v, int64_t v_t, int64_t v_h, const int64_t *cu_q,
                               const int64_t *cu_k, int64_t nseq, float scale, float *out, float *lse, float *scratch,
                               int64_t scratch_stride, int64_t heads, int64_t d_n, int64_t d_r, int64_t d_v,
                               int64_t threads, int64_t variant) {
    (attention_avx512(variant) ? prefill_attention_avx512 : prefill_attention_avx2)(
        q_n, qn_t, qn_h, q_r, qr_t, qr_h, kt, kt_h, kt_d, krt, krt_d, v, v_t, v_h, cu_q, cu_k, nseq, scale, out, lse,
        scratch, scratch_stride, heads, d_n, d_r, d_v, threads);
}

/* RoPE of one d_r vector x into y (y may be x): pair i is (x[2i], x[2i + 1]) when interleaved, else (x[i],
 * x[i + d_r / 2]); written de-interleaved, y[i] = a cos - b sin, y[i + d_r / 2] = b cos + a sin (as
 * mla_runtime.layers.rotary). */
static void rope(const float *x, float *y, const float *cos, const float *sin, int64_t d_r, int interleave) {
    const int64_t half = d_r / 2;
    float t[d_r];
    for (int64_t i = 0; i < half; i++) {
        const float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[i + half];
        t[i] = a * cos[i] - b * sin[i];
        t[i + half] = b * cos[i] + a * sin[i];
    }
    for (int64_t i = 0; i < d_r; i++) y[i] = t[i];
}

/* float32 to bfloat16 as torch rounds: to nearest even, a NaN kept a NaN. */
static inline uint16_t to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if (isnan(v)) return 0x7fc0;
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* float32 (|v| <= 448, or NaN) to float8_e4m3fn as torch rounds: to nearest even; subnormals are multiples of 2^-9,
 * and a normal value keeps three of float32's 23 mantissa bits, its exponent rebiased from 127 to 7. */
static inline uint8_t to_e4m3(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    if (isnan(v)) return sign | 0x7F;
    const float a = fabsf(v);
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f);  /* 2^-6, the smallest normal: 8 -> 0x08 */
    uint32_t m = bits & 0x7FFFFFFF;
    m += 0x7FFFF + ((m >> 20) & 1);  /* to nearest even on the 20 bits dropped (a carry moves the exponent) */
    return sign | (uint8_t)((m >> 20) - ((127 - 7) << 3));
}

/* values [n] absmax-quantised into out (int8 or e4m3 bytes) with the returned scale, as quantize_per_token: scale
 * amax / qmax (1 for a zero row), each value divided by it, then int8 rounded to nearest even and clamped to
 * +-127, or e4m3 clamped to +-448 and rounded. */
static float quantise_part(const float *values, int64_t n, int ck, uint8_t *out) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(values[i]));
    const float qmax = ck == C_I8 ? 127.0f : 448.0f;
    const float scale = amax > 0.0f ? amax / qmax : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        const float y = values[i] / scale;
        out[i] = ck == C_I8 ? (uint8_t)(int8_t)fminf(fmaxf(nearbyintf(y), -qmax), qmax)
                            : to_e4m3(fminf(fmaxf(y, -qmax), qmax));
    }
    return scale;
}

/* The latent side of a decode step's rows, on one thread: for row t, cache[slots[t]] = [RMSNorm(c_t) * norm ;
 * RoPE(k_r_t)] from latent_t = [c_t ; k_r_t] (row stride lat_ld), and each head's RoPE part of q (q + t q_t + h q_h
 * + d_n, d_r values) rotated in place. cos, sin: [T, d_r / 2] with row stride cs_ld. A bfloat16 or float16 cache
 * (cache_kind) gets the float32 row rounded to nearest even; an int8 or e4m3 one each part quantised with its scale
 * in cache_scales [S, 2]. */
void mla_rope_store_f32(const float *latent, int64_t lat_ld, const float *norm, float eps, float *q, int64_t q_t,
                        int64_t q_h, int64_t heads, int64_t d_n, const float *cos, const float *sin, int64_t cs_ld,
                        void *cache, int64_t cache_kind, float *cache_scales, const int64_t *slots, int64_t rows,
                        int64_t d_c, int64_t d_r, int64_t interleave) {
    const int64_t width = d_c + d_r;
    float wide[width];
    for (int64_t t = 0; t < rows; t++) {
        const float *c = latent + t * lat_ld, *ct = cos + t * cs_ld, *st = sin + t * cs_ld;
        float *row = cache_kind == C_F32 ? (float *)cache + slots[t] * width : wide;
        const float r = 1.0f / sqrtf(dot_f32(c, c, d_c) / (float)d_c + eps);
        for (int64_t i = 0; i < d_c; i++) row[i] = c[i] * r * norm[i];
        rope(c + d_c, row + d_c, ct, st, d_r, (int)interleave);
        uint16_t *half = (uint16_t *)cache + slots[t] * width;
        if (cache_kind == C_BF16)
            for (int64_t i = 0; i < width; i++) half[i] = to_bf16(wide[i]);
        else if (cache_kind == C_F16)
            for (int64_t i = 0; i < width; i++) half[i] = _cvtss_sh(wide[i], _MM_FROUND_TO_NEAREST_INT);
        if (cache_kind == C_I8 || cache_kind == C_FP8) {
            uint8_t *bytes = (uint8_t *)cache + slots[t] * width;
            cache_scales[2 * slots[t]] = quantise_part(wide, d_c, (int)cache_kind, bytes);
            cache_scales[2 * slots[t] + 1] = quantise_part(wide + d_c, d_r, (int)cache_kind, bytes + d_c);
        }
        for (int64_t h = 0; h < heads; h++) {
            float *qr = q + t * q_t + h * q_h + d_n;
            rope(qr, qr, ct, st, d_r, (int)interleave);
        }
    }
}
