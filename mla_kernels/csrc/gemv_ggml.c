/* Products with weights in ggml's block types, read as a GGUF file stores them, for x86-64: an AVX2 variant and an
 * AVX-512 + VNNI one (ggml_rows.h, written once over the vector vocabulary), which give the same bits.
 *
 * Weight W [n, k]: each row k / B blocks of B values in the type's bytes, back to back (row_bytes = k / B x size):
 * Q8_0, Q4_1, Q5_0, Q5_1 (B = 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (B = 256), as ggml lays them out. Every type's
 * value is w = ws (u - offset) + wm: u a small unsigned integer (Q8_0: the signed int8 itself), ws a float scale and
 * wm a float minimum per run of 16 or 32 values (K-quants: the super-block's float16 scale times the sub-block's
 * integer scale), the offset a power of two or zero:
 *
 *     type   u bits  ws per   offset  wm
 *     Q8_0   8 (s)   32       0       -
 *     Q4_1   4       32       0       m
 *     Q5_0   5       32       16      -
 *     Q5_1   5       32       0       m
 *     Q2_K   2       16       0       -dmin m_sub
 *     Q3_K   3       16       4       -
 *     Q4_K   4       32       0       -dmin m_sub
 *     Q5_K   5       32       0       -dmin m_sub
 *     Q6_K   6       16       32      -
 *
 * The weight is decoded a unit at a time (256 values: eight blocks of the 32-value types, a super-block of the
 * K-quants) into u
 * bytes in value order with each 4-value lane's ws and wm as floats (gg_decode), and the unit's exact integer dot
 * products with the input rows are scaled in float32 (ggml_rows.h).
 *
 * Activations are rounded once per call to int8 with one float32 scale per group of 32 values, as gemv_int4.c rounds
 * them: a = round(x 127 / amax) to nearest even, scale amax / 127 (a group holding infinity or NaN gets a NaN scale,
 * so its products come out NaN). A prepared row of kp values (k rounded up to 256, the padding zero) holds
 *
 *     a  [kp] int8       the rounded values
 *     s  [kp / 4] int32  each lane's sum of its four values (the offsets' and minimums' terms)
 *     d  [kp / 4] f32    each lane's group scale
 *
 * Each thread takes blocks of weight rows (GG_BLOCK_BYTES, so that a block stays in L2) and passes over them once
 * per tile of GG_TILE input rows: a prefill chunk's rows read the weight from memory once. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"
#include "simd.h"

/* ggml's type numbers */
enum { GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q2_K = 10, GG_Q3_K = 11, GG_Q4_K = 12, GG_Q5_K = 13,
       GG_Q6_K = 14 };
#define GG_GROUP 32             /* activation values per scale */
#define GG_TILE 8               /* input rows a pass over a block of weight rows */
#define GG_BLOCK_BYTES 65536    /* weight bytes of a block of rows */

typedef struct {
    int block, bytes, unit;  /* values and bytes of a block; values of a decoded unit */
    int sgn, shift, mins;    /* signed u (Q8_0); log2 of the offset (0: none); minimums */
} GgFormat;

static inline __attribute__((always_inline)) GgFormat gg_fmt(int block, int bytes, int unit, int sgn, int shift,
                                                              int mins) {
    const GgFormat f = {block, bytes, unit, sgn, shift, mins};
    return f;
}

static inline __attribute__((always_inline)) GgFormat gg_format(const int t) {
    switch (t) {
        case GG_Q8_0: return gg_fmt(32, 34, 256, 1, 0, 0);
        case GG_Q4_1: return gg_fmt(32, 20, 256, 0, 0, 1);
        case GG_Q5_0: return gg_fmt(32, 22, 256, 0, 4, 0);
        case GG_Q5_1: return gg_fmt(32, 24, 256, 0, 0, 1);
        case GG_Q2_K: return gg_fmt(256, 84, 256, 0, 0, 1);
        case GG_Q3_K: return gg_fmt(256, 110, 256, 0, 2, 0);
        case GG_Q4_K: return gg_fmt(256, 144, 256, 0, 0, 1);
        case GG_Q5_K: return gg_fmt(256, 176, 256, 0, 0, 1);
        case GG_Q6_K: return gg_fmt(256, 210, 256, 0, 5, 0);
        default: return gg_fmt(0, 0, 0, 0, 0, 0);
    }
}

/* A decoded unit: u in value order, the scale and minimum of each lane of 4 values. */
typedef struct {
    uint8_t u[256];
    float ws[64], wm[64];
} GgUnit;

/* A call: the weight, the prepared rows and the output. */
typedef struct {
    const uint8_t *w, *xp;
    float *y;
    int64_t type, row_stride, xstride, m, n, k, kp;
} GgCall;

static inline float gg_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256i gg_load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void gg_store32(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* lanes [l, l + count) of a unit's ws or wm: v */
static inline __attribute__((always_inline)) void gg_fill(float *lanes, int count, float v) {
    for (int i = 0; i < count; i++) lanes[i] = v;
}

/* 32 bytes b: (b >> shift) & mask, bytewise */
static inline __attribute__((always_inline)) __m256i gg_bits(__m256i b, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

/* 16 nibble bytes (value j low, j + 16 high) plus a fifth bit from qh (bit j of the 32-bit word) where five: u[0..32),
 * built in a register and stored once */
static inline __attribute__((always_inline)) void gg_nibbles32(const uint8_t *qs, const uint8_t *qh, uint8_t *u) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
    if (qh) {  /* byte j takes byte j / 8 of the word, keeps bit j % 8, and becomes 16 where it is set */
        int32_t h;
        memcpy(&h, qh, 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(h), _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                   0x0202020202020202LL, 0x0303030303030303LL));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    gg_store32(u, v);
}

/* One 32-value block of Q8_0, Q4_1, Q5_0 or Q5_1 at p into the unit's values [32 i, 32 i + 32). */
static inline __attribute__((always_inline)) void gg_small(const int t, const uint8_t *p, GgUnit *o, int i) {
    uint8_t *u = o->u + 32 * i;
    float *ws = o->ws + 8 * i, *wm = o->wm + 8 * i;
    gg_fill(ws, 8, gg_f16(p));
    if (t == GG_Q8_0) memcpy(u, p + 2, 32);
    else if (t == GG_Q5_0) gg_nibbles32(p + 6, p + 2, u);
    else gg_nibbles32(p + (t == GG_Q4_1 ? 4 : 8), t == GG_Q5_1 ? p + 4 : NULL, u);
    if (t == GG_Q4_1 || t == GG_Q5_1) gg_fill(wm, 8, gg_f16(p + 2));
}

/* Q4_K / Q5_K's sub-block j scale and minimum from their 12 bytes q (6 bits each). */
static inline void gg_scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K (qh NULL) or Q5_K: value 64 c + l (l < 32) is the low nibble of qs[32 c + l], 64 c + 32 + l its high nibble,
 * with bit 2c or 2c + 1 of qh[l] as the fifth bit; sub-block v / 32. */
static inline __attribute__((always_inline)) void gg_q45_k(const uint8_t *p, const uint8_t *qh, const uint8_t *qs,
                                                          GgUnit *o) {
    const float d = gg_f16(p), dmin = gg_f16(p + 2);
    const __m256i h = qh ? gg_load32(qh) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i b = gg_load32(qs + 32 * c);
        __m256i lo = gg_bits(b, 0, 0x0f), hi = gg_bits(b, 4, 0x0f);
        if (qh) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(gg_bits(h, 2 * c, 1), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(gg_bits(h, 2 * c + 1, 1), 4));
        }
        gg_store32(o->u + 64 * c, lo);
        gg_store32(o->u + 64 * c + 32, hi);
    }
    for (int j = 0; j < 8; j++) {
        int sc, m;
        gg_scale_min_k4(j, p + 4, &sc, &m);
        gg_fill(o->ws + 8 * j, 8, d * (float)sc);
        gg_fill(o->wm + 8 * j, 8, -dmin * (float)m);
    }
}

/* Q6_K: in each half n of 128 values, value 32 t + l (l < 32) takes the nibble t / 2 of ql[64 n + 32 (t % 2) + l]
 * and bits 2t, 2t + 1 of qh[32 n + l]; sub-block v / 16 with its int8 scale. */
static inline __attribute__((always_inline)) void gg_q6_k(const uint8_t *p, GgUnit *o) {
    const float d = gg_f16(p + 208);
    for (int n = 0; n < 2; n++) {
        const __m256i h = gg_load32(p + 128 + 32 * n);
        const __m256i l0 = gg_load32(p + 64 * n), l1 = gg_load32(p + 64 * n + 32);
        const __m256i low[4] = {gg_bits(l0, 0, 0x0f), gg_bits(l1, 0, 0x0f), gg_bits(l0, 4, 0x0f), gg_bits(l1, 4, 0x0f)};
        for (int t = 0; t < 4; t++)
            gg_store32(o->u + 128 * n + 32 * t, _mm256_or_si256(low[t], _mm256_slli_epi16(gg_bits(h, 2 * t, 3), 4)));
    }
    for (int i = 0; i < 16; i++) gg_fill(o->ws + 4 * i, 4, d * (float)(int8_t)p[192 + i]);
}

/* Q2_K (hm NULL) or Q3_K: in each half n of 128 values, value 32 j + l takes bits 2j, 2j + 1 of qs[32 n + l] (Q3_K:
 * plus 4 where bit 4n + j of hm[l] is set); sub-block v / 16. */
static inline __attribute__((always_inline)) void gg_q23_k(const uint8_t *qs, const uint8_t *hm, GgUnit *o) {
    const __m256i h = hm ? gg_load32(hm) : _mm256_setzero_si256();
    for (int n = 0; n < 2; n++) {
        const __m256i b = gg_load32(qs + 32 * n);
        for (int j = 0; j < 4; j++) {
            __m256i v = gg_bits(b, 2 * j, 3);
            if (hm) v = _mm256_or_si256(v, _mm256_slli_epi16(gg_bits(h, 4 * n + j, 1), 2));
            gg_store32(o->u + 128 * n + 32 * j, v);
        }
    }
}

static inline __attribute__((always_inline)) void gg_q2_k(const uint8_t *p, GgUnit *o) {
    const float d = gg_f16(p + 80), dmin = gg_f16(p + 82);
    gg_q23_k(p + 16, NULL, o);
    for (int i = 0; i < 16; i++) {
        gg_fill(o->ws + 4 * i, 4, d * (float)(p[i] & 0x0f));
        gg_fill(o->wm + 4 * i, 4, -dmin * (float)(p[i] >> 4));
    }
}

/* Q3_K's 16 6-bit scales: the low 4 bits from bytes 0..7 (low nibbles, then high), the top 2 from bytes 8..11. */
static inline __attribute__((always_inline)) void gg_q3_k(const uint8_t *p, GgUnit *o) {
    const float d = gg_f16(p + 108);
    const uint8_t *sc = p + 96;
    gg_q23_k(p + 32, p, o);
    for (int i = 0; i < 16; i++) {
        const int low = i < 8 ? sc[i] & 0x0f : sc[i - 8] >> 4, high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        gg_fill(o->ws + 4 * i, 4, d * (float)((low | high << 4) - 32));
    }
}

/* The unit of type t at p (`blocks` blocks of it present: a row of the 32-value types whose count of blocks is not a
 * multiple of 8 ends in a partial unit, its missing values zero) into o. */
static inline __attribute__((always_inline)) void gg_decode(const int t, const uint8_t *p, int64_t blocks, GgUnit *o) {
    switch (t) {
        case GG_Q2_K: gg_q2_k(p, o); return;
        case GG_Q3_K: gg_q3_k(p, o); return;
        case GG_Q4_K: gg_q45_k(p, NULL, p + 16, o); return;
        case GG_Q5_K: gg_q45_k(p, p + 16, p + 48, o); return;
        case GG_Q6_K: gg_q6_k(p, o); return;
        default: {
            const GgFormat f = gg_format(t);
            if (blocks >= 8) {
                for (int i = 0; i < 8; i++) gg_small(t, p + i * f.bytes, o, i);
                return;
            }
            for (int i = 0; i < 8; i++) {
                if (i < blocks) {
                    gg_small(t, p + i * f.bytes, o, i);
                } else {
                    memset(o->u + 32 * i, 0, 32);
                    gg_fill(o->ws + 8 * i, 8, 0.0f);
                    gg_fill(o->wm + 8 * i, 8, 0.0f);
                }
            }
        }
    }
}

#include "vec_avx2.h"
#include "ggml_rows.h"
#include "vec_end.h"
#include "vec_avx512.h"
#include "ggml_rows.h"
#include "vec_end.h"

enum { GG_AVX2 = 0, GG_AVX512_VNNI = 1 };

int64_t mla_ggml_variants(void) {
    return (mla_isa_runs(MLA_CPU_AVX2, MLA_ISA_AVX2) << GG_AVX2) |
           (mla_isa_runs(MLA_CPU_AVX2 | MLA_CPU_AVX512 | MLA_CPU_VNNI, MLA_ISA_AVX512) << GG_AVX512_VNNI);
}

/* Bytes of a row of k values in type t (0: a type these kernels do not read, or k not a whole number of blocks). */
int64_t mla_ggml_row_bytes(int64_t type, int64_t k) {
    const GgFormat f = gg_format((int)type);
    return f.block && k > 0 && k % f.block == 0 ? k / f.block * f.bytes : 0;
}

static int64_t gg_padded(int64_t k) { return (k + 255) / 256 * 256; }  /* a whole number of units */

/* Bytes of one prepared row of k values. */
int64_t mla_gg_prepared_bytes(int64_t k) { return 3 * gg_padded(k); }

/* One row x [k] -> its prepared form at out (the file's comment). */
static void gg_prepare_row(const float *x, int64_t k, uint8_t *out) {
    const int64_t kp = gg_padded(k);
    int8_t *a = (int8_t *)out;
    int32_t *s = (int32_t *)(out + kp);
    float *d = (float *)(out + 2 * kp);
    for (int64_t g = 0; g < kp; g += GG_GROUP) {
        float v[GG_GROUP], amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < GG_GROUP; i++) {
            v[i] = g + i < k ? x[g + i] : 0.0f;
            finite &= isfinite(v[i]) != 0;
            amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        }
        const float scale = !finite ? NAN : amax / 127.0f, inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < GG_GROUP; i++) {  /* to nearest even (the default rounding mode) */
            const float q = finite ? nearbyintf(v[i] * inv) : 0.0f;  /* NaN only for 0 x an infinite inv: 0 */
            a[g + i] = (int8_t)(q > 127.0f ? 127 : q < -127.0f ? -127 : q == q ? q : 0);
        }
        for (int l = 0; l < GG_GROUP / 4; l++) {
            const int8_t *p = a + g + 4 * l;
            s[(g + 4 * l) / 4] = p[0] + p[1] + p[2] + p[3];
            d[(g + 4 * l) / 4] = scale;
        }
    }
}

/* Y [rows, n] = X [rows, k] W^T in float32, W [n, row_bytes] in ggml type `type` (the file's comment), row r at
 * w + r w_stride. */
void mla_gemm_ggml(int64_t type, const uint8_t *w, int64_t w_stride, const float *x, float *y, int64_t rows,
                   int64_t n, int64_t k, int64_t threads, int64_t variant) {
    const int64_t row_bytes = mla_ggml_row_bytes(type, k), xs = mla_gg_prepared_bytes(k);
    if (!row_bytes) abort();  /* ops/cpu_kernels.cpp checks the type and the row */
    uint8_t *xp = (uint8_t *)alloc_lines((size_t)(rows * xs));
    if (!xp) abort();  /* ops/cpu_kernels.cpp bounds the rows */
    const GgCall c = {w, xp, y, type, w_stride, xs, rows, n, k, gg_padded(k)};
    int64_t block = GG_BLOCK_BYTES / row_bytes;
    const int64_t balanced = n / (4 * threads);  /* at least about four blocks a thread */
    block = block < balanced ? block : balanced;
    block = block < 1 ? 1 : block;
    const int64_t blocks = (n + block - 1) / block;
    void (*run)(const GgCall *, int64_t, int64_t) = variant == GG_AVX512_VNNI ? gg_rows_avx512 : gg_rows_avx2;
    #pragma omp parallel num_threads((int)threads)
    {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < rows; j++) gg_prepare_row(x + j * k, k, xp + j * xs);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) run(&c, b * block, b * block + block < n ? b * block + block : n);
    }
    free(xp);
}
