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
 * Each row is read in place, its values unpacked in registers (ggml_rows.h): each run of 32 values that shares an
 * activation scale (a block of the 32-value types, a 32-value group of a super-block) gets its exact integer dot
 * product with the input row, the weight's integer sub-block scales applied in integer arithmetic, and each such sum
 * is scaled in float32 once: float(sum) x (ws x the activation scale), ws the block's or super-block's float16 scale.
 *
 * Activations are rounded once per call to int8 with one float32 scale per group of 32 values, as gemv_int4.c rounds
 * them: a = round(x 127 / amax) to nearest even, scale amax / 127 (a group holding infinity or NaN gets a NaN scale,
 * so its products come out NaN). A prepared row of kp values (k rounded up to 256, the padding zero) holds
 *
 *     a  [kp] int8        the rounded values
 *     g  [kp / 32] f32    each group's scale
 *     h  [kp / 16] int16  each run of 16 values' sum (the offsets' and minimums' terms)
 *
 * Each thread takes blocks of weight rows (GG_BLOCK_BYTES, so that a block stays in L2) and passes over them once
 * per tile of GG_TILE input rows: a prefill chunk's rows read the weight from memory once, and the unpacked values of
 * a block or super-block serve every row of the tile. */
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
    int block, bytes;  /* values and bytes of a block */
} GgFormat;

static inline __attribute__((always_inline)) GgFormat gg_format(const int t) {
    const GgFormat f[] = {{32, 34}, {32, 20}, {32, 22}, {32, 24}, {256, 84}, {256, 110}, {256, 144}, {256, 176},
                          {256, 210}, {0, 0}};
    switch (t) {
        case GG_Q8_0: return f[0];
        case GG_Q4_1: return f[1];
        case GG_Q5_0: return f[2];
        case GG_Q5_1: return f[3];
        case GG_Q2_K: return f[4];
        case GG_Q3_K: return f[5];
        case GG_Q4_K: return f[6];
        case GG_Q5_K: return f[7];
        case GG_Q6_K: return f[8];
        default: return f[9];
    }
}

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

/* 32 bytes b: (b >> shift) & mask, bytewise */
static inline __attribute__((always_inline)) __m256i gg_bits(__m256i b, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

/* 16 nibble bytes (value j low, j + 16 high) plus a fifth bit from qh (bit j of the 32-bit word) where five: u[0..32),
 * built in a register */
static inline __attribute__((always_inline)) __m256i gg_nib32(const uint8_t *qs, const uint8_t *qh) {
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
    return v;
}

static inline uint32_t gg_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
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

static int64_t gg_padded(int64_t k) { return (k + 255) / 256 * 256; }  /* a whole number of super-blocks */

/* Bytes of one prepared row of k values. */
int64_t mla_gg_prepared_bytes(int64_t k) { return gg_padded(k) + gg_padded(k) / 4; }

/* One row x [k] -> its prepared form at out (the file's comment). */
static void gg_prepare_row(const float *x, int64_t k, uint8_t *out) {
    const int64_t kp = gg_padded(k);
    int8_t *a = (int8_t *)out;
    float *gs = (float *)(out + kp);
    int16_t *h = (int16_t *)(out + kp + kp / 8);
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
        gs[g / GG_GROUP] = scale;
        for (int l = 0; l < GG_GROUP / 16; l++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += a[g + 16 * l + i];
            h[(g + 16 * l) / 16] = (int16_t)sum;
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
