/* Products of 1 to a few dozen rows with a group-wise int4 weight, for x86-64: an AVX2 + FMA + F16C variant and an
 * AVX-512 (F/BW/VL) + VNNI one, chosen per call (the caller names the variant; mla_i4_variants says which this CPU
 * runs). Both compute the same integers and the same float operations in the same order, so their results are
 * identical bit for bit.
 *
 * Weight W [n, k], stored as kp = k rounded up to a multiple of 32 columns (the padding is zero): packed nibbles
 * [n, kp / 2] and one float16 scale per group of 32 along k, [n, kp / 32]. A group's 16 bytes hold its 32 values
 * q in [-8, 7] as q + 8: byte j has value j in its low nibble and value j + 16 in its high nibble (the order of
 * ggml's Q4_0 blocks). W[r, c] = (q[r, c] - 8) * scale[r, c / 32].
 *
 * The same nibbles also carry asymmetric groups and wider ones (mla_gemm_i4_groups): a float16 scale per group of
 * G = 32, 64 or 128 values along k ([n, kp / G]) and optionally a zero point z in [0, 16] per group ([n, kp / G]
 * uint8), W[r, c] = (q'[r, c] - z[r, c / G]) * scale[r, c / G] with q' the stored nibble (the symmetric format is
 * z = 8). A group of 64 or 128 spans 2 or 4 of the activations' groups of 32: each 32-value part takes its group's
 * scale and zero.
 *
 * Activations are rounded to int8 with one float32 scale per group of 32 values, as ggml's Q8_0 rounds them for
 * its Q4_0 products: a = round(x * 127 / amax) to nearest even, scale amax / 127 (amax: the group's largest
 * magnitude; a group holding infinity or NaN gets a NaN scale, so its products come out NaN). A prepared row
 * (mla_q8_prepare) is laid out in chunks of 4 groups (128 values, 64 packed weight bytes), each 256 bytes:
 *
 *     lo [64] int8     values 0..15 of the chunk's groups 0, 1, 2, 3 (the weight bytes' low nibbles)
 *     hi [64] int8     values 16..31 of the same groups (the high nibbles)
 *     bias [16] int32  lane l (group l / 4): -8 times the sum of the 8 values lane l multiplies
 *     scale [16] f32   lane l: its group's activation scale
 *
 * Lane l of a chunk is bytes 4l..4l+3 of lo and of hi: the unsigned nibbles times the signed values, summed
 * (AVX-512 VNNI: vpdpbusd; AVX2: vpmaddubsw, whose int16 pair sums cannot saturate at 15 * 127 * 4, then vpmaddwd),
 * start from the lane's bias (which subtracts the nibbles' offset of 8 exactly; for a zero point z the bias is
 * (bias * z) >> 3 = -z times the lane's activation sum, exact), and the int32 lane is turned to
 * float32 and added into the lane's float accumulator times weight scale * activation scale, one FMA. A row's 16
 * lane accumulators are summed at the end, lanes l and l + 8 first, then the eight in simd.h's hsum order.
 *
 * The weight is streamed from memory once for all the rows: each thread takes blocks of weight rows (a block's
 * packed bytes stay in L1/L2) and passes over them once per tile of input rows (4 in the AVX2 variant, 8 in the
 * AVX-512 one; the count compiled into each instance, so the accumulators live in registers; the AVX-512 one takes
 * two weight rows at a time, each input chunk loaded once for both), with a software prefetch running ahead of the
 * weight stream. Every (weight row, input row) pair has its own accumulators and sees
 * the same operations whatever the tile, so a row's result does not depend on the other rows of the batch. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"
#include "simd.h"

#define I4_GROUP 32             /* values per scale */
#define I4_CHUNK_GROUPS 4       /* groups per chunk */
#define I4_CHUNK_WBYTES 64      /* packed weight bytes of a chunk */
#define I4_CHUNK_XBYTES 256     /* a prepared activation row's bytes per chunk */
#define I4_BLOCK_BYTES 16384    /* packed bytes of a block of weight rows (stays in L1/L2 across the tiles) */
#ifndef I4_PREFETCH
#define I4_PREFETCH 2048        /* bytes ahead in the weight stream */
#endif

enum { I4_AVX2 = 0, I4_AVX512_VNNI = 1 };

static inline int64_t i4_groups(int64_t k) { return (k + I4_GROUP - 1) / I4_GROUP; }
static inline int64_t i4_chunks(int64_t k) { return (i4_groups(k) + I4_CHUNK_GROUPS - 1) / I4_CHUNK_GROUPS; }

/* Bytes of one prepared activation row of k values. */
int64_t mla_q8_row_bytes(int64_t k) { return i4_chunks(k) * I4_CHUNK_XBYTES; }

/* Which variants this CPU runs under the ISA cap: bit I4_AVX2, bit I4_AVX512_VNNI. */
int64_t mla_i4_variants(void) {
    return (mla_isa_runs(MLA_CPU_AVX2, MLA_ISA_AVX2) << I4_AVX2) |
           (mla_isa_runs(MLA_CPU_AVX2 | MLA_CPU_AVX512 | MLA_CPU_VNNI, MLA_ISA_AVX512) << I4_AVX512_VNNI);
}

/* One group of 32 values v -> its 16 lo and 16 hi values, the 4 lanes' biases and scales (the file's comment). */
static inline void q8_group(const float *v, int8_t *lo, int8_t *hi, int32_t *bias, float *scale) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
    __m256 f[4], mv = _mm256_setzero_ps(), bad = mv;
    for (int i = 0; i < 4; i++) {
        f[i] = _mm256_loadu_ps(v + 8 * i);
        const __m256 a = _mm256_and_ps(f[i], abs_mask);
        mv = _mm256_max_ps(mv, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  /* infinity or NaN */
    }
    const float amax = hmax8(mv);
    float d = 0.0f;
    __m256i q[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    if (_mm256_movemask_ps(bad)) {
        d = NAN;
    } else if (amax > 0.0f) {
        const __m256 inv = _mm256_set1_ps(127.0f / amax);
        const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
        d = amax / 127.0f;
        for (int i = 0; i < 4; i++)  /* to nearest even (the default rounding mode) */
            q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv)), top), bottom);
    }
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(bytes));
    _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(bytes, 1));
    int32_t pair[16];  /* values i + 16 j summed over j: [0..7] from q[0] + q[2], [8..15] from q[1] + q[3] */
    _mm256_storeu_si256((__m256i *)pair, _mm256_add_epi32(q[0], q[2]));
    _mm256_storeu_si256((__m256i *)(pair + 8), _mm256_add_epi32(q[1], q[3]));
    for (int l = 0; l < 4; l++) {
        bias[l] = -8 * (pair[4 * l] + pair[4 * l + 1] + pair[4 * l + 2] + pair[4 * l + 3]);
        scale[l] = d;
    }
}

/* One row x [k] -> its prepared form (the file's comment) at out (mla_q8_row_bytes(k) bytes). */
static void q8_prepare_row(const float *x, int64_t k, uint8_t *out) {
    const int64_t g_n = i4_groups(k), chunks = i4_chunks(k);
    if (chunks * I4_CHUNK_GROUPS > g_n)  /* the last chunk's missing groups: zero */
        memset(out + (chunks - 1) * I4_CHUNK_XBYTES, 0, I4_CHUNK_XBYTES);
    for (int64_t g = 0; g < g_n; g++) {
        float tail[I4_GROUP];
        const float *v = x + g * I4_GROUP;
        if ((g + 1) * I4_GROUP > k) {
            for (int64_t i = 0; i < I4_GROUP; i++) tail[i] = g * I4_GROUP + i < k ? v[i] : 0.0f;
            v = tail;
        }
        uint8_t *chunk = out + (g / I4_CHUNK_GROUPS) * I4_CHUNK_XBYTES;
        const int s = (int)(g % I4_CHUNK_GROUPS);
        q8_group(v, (int8_t *)chunk + 16 * s, (int8_t *)chunk + 64 + 16 * s, (int32_t *)(chunk + 128) + 4 * s,
                 (float *)(chunk + 192) + 4 * s);
    }
}

/* groups of 32 int4 values as compressed-tensors stores them (16 bytes: byte b holds values 2b and 2b + 1, low
 * nibble first) -> this file's order (byte j: values j and j + 16), for `groups` groups. */
void mla_i4_from_stored(const uint8_t *src, uint8_t *dst, int64_t groups, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads((int)threads)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *a = src + 16 * g, *b = a + 8;
        uint8_t *o = dst + 16 * g;
        for (int i = 0; i < 8; i++) {
            o[2 * i] = (uint8_t)((a[i] & 0x0f) | (b[i] << 4));
            o[2 * i + 1] = (uint8_t)((a[i] >> 4) | (b[i] & 0xf0));
        }
    }
}

/* rows of x [rows, k] -> out (rows * mla_q8_row_bytes(k) bytes). */
void mla_q8_prepare(const float *x, int64_t rows, int64_t k, uint8_t *out) {
    for (int64_t j = 0; j < rows; j++) q8_prepare_row(x + j * k, k, out + j * mla_q8_row_bytes(k));
}

/* A weight's rows: nibbles w [n, g_n * 16], float16 scales s [n, g_n >> gshift] (a scale per group of 32 << gshift
 * values) and, for asymmetric groups, zeros z [n, g_n >> gshift] in [0, 16] (NULL: symmetric, every zero 8). */
typedef struct { const uint8_t *w; const uint16_t *s; const uint8_t *z; int64_t g_n; int gshift; } i4_mat;
typedef struct { const uint8_t *w; const uint16_t *s; const uint8_t *z; } i4_row_ptr;

static inline i4_row_ptr i4_row_at(const i4_mat *mat, int64_t r) {
    const int64_t per = mat->g_n >> mat->gshift;
    i4_row_ptr p = {mat->w + r * mat->g_n * 16, mat->s + r * per, mat->z ? mat->z + r * per : NULL};
    return p;
}

/* Chunk c of a row: its weight bytes (a partial last chunk copied, zero-padded, into wbuf), its 4 groups' float16
 * scales (*s4) and zeros (*z4, NULL where the weight is symmetric), each group of 32 taking its wider group's scale
 * and zero; past the row's end a scale of 0. */
static inline const uint8_t *i4_chunk_at(i4_row_ptr rw, int64_t c, int64_t g_n, int gshift, uint8_t *wbuf,
                                         uint16_t *sbuf, uint8_t *zbuf, const uint16_t **s4, const uint8_t **z4) {
    const int64_t g0 = c * I4_CHUNK_GROUPS;
    const int whole = g0 + I4_CHUNK_GROUPS <= g_n;
    if (whole && gshift == 0) {
        *s4 = rw.s + g0;
        *z4 = rw.z ? rw.z + g0 : NULL;
        return rw.w + c * I4_CHUNK_WBYTES;
    }
    for (int i = 0; i < I4_CHUNK_GROUPS; i++) {
        const int64_t g = g0 + i;
        sbuf[i] = g < g_n ? rw.s[g >> gshift] : 0;
        zbuf[i] = g < g_n && rw.z ? rw.z[g >> gshift] : 8;
    }
    *s4 = sbuf;
    *z4 = rw.z ? zbuf : NULL;
    if (whole) return rw.w + c * I4_CHUNK_WBYTES;
    memset(wbuf, 0, I4_CHUNK_WBYTES);
    memcpy(wbuf, rw.w + g0 * 16, (size_t)(g_n - g0) * 16);
    return wbuf;
}

static inline int32_t i4_load4(const uint8_t *z) {
    int32_t v;
    memcpy(&v, z, 4);
    return v;
}

#define TILE_CASES4(CALL) \
    switch (m) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; default: CALL(4); break; }
#define TILE_CASES8(CALL) \
    switch (m) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
                 case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

/* The kernels, once per instruction set (int4_rows.h): i4_block, i4_pair and their parts, suffixed _avx2 and _avx512
 * (with VNNI). */
#include "vec_avx2.h"
#include "int4_rows.h"
#include "vec_end.h"
#include "vec_avx512.h"
#include "int4_rows.h"
#include "vec_end.h"

static void i4_block(int64_t variant, const i4_mat *w, const uint8_t *xp, int64_t xs, float *y, int64_t rows,
                     int64_t n, int64_t r0, int64_t r1) {
    (variant == I4_AVX512_VNNI ? i4_block_avx512 : i4_block_avx2)(w, xp, xs, y, rows, n, r0, r1);
}

/* Weight rows [r0, r1) times one prepared row xp into y[r0 .. r1) (= alpha * product (+ y where add)), read as two
 * sequential streams, the range's two halves side by side (as gemv_f32.c's one-row products: one stream a thread
 * leaves memory bandwidth unused). */
static void i4_one_row(int64_t variant, const i4_mat *w, const uint8_t *xp, float *y, int64_t r0, int64_t r1,
                       float alpha, int add) {
    const int64_t half = (r1 - r0 + 1) / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t ra = r0 + i, rb = r0 + half + i < r1 ? r0 + half + i : ra;  /* an odd range's last row: twice */
        float va, vb;
        (variant == I4_AVX512_VNNI ? i4_pair_avx512 : i4_pair_avx2)(i4_row_at(w, ra), i4_row_at(w, rb), w->g_n,
                                                                   w->gshift, xp, &va, &vb);
        y[ra] = alpha * va + (add ? y[ra] : 0.0f);
        if (rb != ra) y[rb] = alpha * vb + (add ? y[rb] : 0.0f);
    }
}

/* Inside a parallel region: this thread's share of the n weight rows (symmetric groups of 32) times one prepared row
 * xp, into y [n] (y = alpha * product (+ y where add)). No barrier. */
void mla_i4_share(int64_t variant, const uint8_t *w, const uint16_t *scales, const uint8_t *xp, float *y, int64_t n,
                  int64_t k, float alpha, int add) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const i4_mat mat = {w, scales, NULL, i4_groups(k), 0};
    i4_one_row(variant, &mat, xp, y, n * t / nt, n * (t + 1) / nt, alpha, add);
}

/* Inside a parallel region: this thread's share of the rows of a grouped int4 matrix (its int4 table, mla_cpu.h)
 * times one prepared row xp, into y [n] (y = alpha * product (+ y where add)): mla_gemm_i4_groups's one row, the
 * same bits. No barrier. */
void mla_i4g_share(int64_t variant, const uint8_t *w, const int64_t *table, const uint8_t *xp, float *y, float alpha,
                   int add) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), n = table[1], group = table[5];
    const i4_mat mat = {w, (const uint16_t *)(intptr_t)table[3], (const uint8_t *)(intptr_t)table[4],
                        i4_groups(table[2]), group == 128 ? 2 : group == 64 ? 1 : 0};
    i4_one_row(variant, &mat, xp, y, n * t / nt, n * (t + 1) / nt, alpha, add);
}

/* Y [rows, n] = X [rows, k] W^T in float32, W as above with a float16 scale (bit patterns) per group of `group`
 * values (32, 64 or 128; k a multiple of it where it is over 32) and zeros [n, groups] in [0, 16] (NULL: 8). */
void mla_gemm_i4_groups(const uint8_t *w, const uint16_t *scales, const uint8_t *zeros, int64_t group, const float *x,
                        float *y, int64_t rows, int64_t n, int64_t k, int64_t threads, int64_t variant) {
    const int64_t g_n = i4_groups(k), xs = mla_q8_row_bytes(k);
    const i4_mat mat = {w, scales, zeros, g_n, group == 128 ? 2 : group == 64 ? 1 : 0};
    int64_t block = I4_BLOCK_BYTES / (g_n * 16);
    const int64_t balanced = n / (4 * threads);  /* at least about four blocks a thread */
    block = block < balanced ? block : balanced;
    block = block < 1 ? 1 : block;
    const int64_t blocks = (n + block - 1) / block;
    uint8_t *xp = (uint8_t *)alloc_lines((size_t)(rows * xs));
    if (!xp) abort();  /* ops/cpu_kernels.cpp bounds the rows */
    if (rows == 1) {
        q8_prepare_row(x, k, xp);
        #pragma omp parallel num_threads((int)threads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            i4_one_row(variant, &mat, xp, y, n * t / nt, n * (t + 1) / nt, 1.0f, 0);
        }
        free(xp);
        return;
    }
    #pragma omp parallel num_threads((int)threads)
    {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < rows; j++) q8_prepare_row(x + j * k, k, xp + j * xs);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = b * block, r1 = r0 + block < n ? r0 + block : n;
            i4_block(variant, &mat, xp, xs, y, rows, n, r0, r1);
        }
    }
    free(xp);
}

/* mla_gemm_i4_groups for symmetric groups of 32 (ggml's Q4_0 numbers). */
void mla_gemm_i4(const uint8_t *w, const uint16_t *scales, const float *x, float *y, int64_t rows, int64_t n,
                 int64_t k, int64_t threads, int64_t variant) {
    mla_gemm_i4_groups(w, scales, NULL, 32, x, y, rows, n, k, threads, variant);
}
