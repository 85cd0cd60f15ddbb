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
 * Each row is read in place, its values unpacked in registers (ggml_rows.h). A 32-value block gets its exact integer
 * dot product with the input row, scaled in float32 once: float(sum) x (ws x the group's activation scale). A K-quant
 * super-block's integer sum, its integer sub-block scales and offsets applied, is exact in int32 and scaled once:
 * float(sum) x (d x the super-block's activation scale), plus the minimums' term the same way.
 *
 * Activations are rounded once per call to int8, as gemv_int4.c rounds them: a = round(x 127 / amax) to nearest
 * even, scale amax / 127 (a group holding infinity or NaN gets a NaN scale, so its products come out NaN), in two
 * forms: one float32 scale per group of 32 values (read by the 32-value types) and one per group of 256, a
 * super-block (read by the K-quants, as ggml's own Q8_K: then a super-block's whole integer sum, scales applied,
 * is exact in int32 and meets one float scale). A prepared row of kp values (k rounded up to 256, the padding zero)
 * holds
 *
 *     a  [kp] int8        the values rounded in groups of 32
 *     g  [kp / 32] f32    each group's scale
 *     h  [kp / 16] int16  each run of 16 values' sum (the offsets' and minimums' terms)
 *
 * and then, from GG_K_FORM(kp), the same three for groups of 256 (g: kp / 256 scales).
 *
 * Each thread takes blocks of weight rows (GG_BLOCK_BYTES, so that a block stays in L2) and passes over them once
 * per tile of GG_TILE input rows: a prefill chunk's rows read the weight from memory once, and the unpacked values of
 * a block or super-block serve every row of the tile. With AVX-512 + VNNI, a Q8_0 or Q5_0 call of at least 12 input
 * rows (GG_R8_MIN_SMALL) or a K-quant call of at least 24 (GG_R8_MIN_ROWS: below these, packing the rows costs what
 * it saves) instead unpacks and interleaves
 * its weight rows eight at a time into a buffer (ggml_rows.h, gg_r8_call, gg_k_r8): one vector holds eight rows'
 * sums of a block or super-block, so no sum runs across lanes per block, and each row
 * gets the same integers and float operations in the same order: the same bits. On this 2-core Zen 4, [2816, 2048]
 * times 256 rows: Q8_0 1.7x, Q4_K 1.4x, Q6_K 1.35x the tile path's speed. A row is read GG_AHEAD bytes ahead of its
 * use: at 1024 a one-row Q5_0 product streamed 17.5 GB/s here, at 4096 21.5.
 *
 * Q4_K rows may also be repacked once, at load (mla_ggml_repack_q4_k, type GG_Q4_K_R8): eight rows interleaved a
 * super-block at a time with their scales unpacked to bytes, read as one stream by gg_q4r8_rows (ggml_rows.h) at any
 * count of input rows, in both variants, with the stored rows' bits: [2816, 2048] at one row, one thread, in cache,
 * 0.203 -> 0.089 ms on this Zen 4. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "mla_cpu.h"
#include "simd.h"

/* ggml's type numbers */
enum { GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q2_K = 10, GG_Q3_K = 11, GG_Q4_K = 12, GG_Q5_K = 13,
       GG_Q6_K = 14 };
/* Q4_K rows repacked at load eight at a time (mla_ggml_repack, ggml_rows.h's gg_q4r8_rows): a number of ours, apart
 * from ggml's */
enum { GG_Q4_K_R8 = MLA_GG_Q4_K_R8 };
#define GG_Q4R8_BYTES 1184      /* an eight-row super-block of GG_Q4_K_R8: 8 x 148 */
#define GG_GROUP 32             /* activation values per scale */
#define GG_TILE 8               /* input rows a pass over a block of weight rows */
#define GG_BLOCK_BYTES 65536    /* weight bytes of a block of rows */
#define GG_K_FORM(kp) ((kp) + (kp) / 4)  /* where a prepared row's second form (groups of 256) starts */
#ifndef GG_AHEAD
#define GG_AHEAD 4096          /* bytes a row is read ahead of its use (prefetched) */
#endif

typedef struct {
    int block, bytes;  /* values and bytes of a block */
} GgFormat;

static inline __attribute__((always_inline)) GgFormat gg_format(const int t) {
    const GgFormat f[] = {{32, 34}, {32, 20}, {32, 22}, {32, 24}, {256, 84}, {256, 110}, {256, 144}, {256, 176},
                          {256, 210}, {256, 148}, {0, 0}};
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
        case GG_Q4_K_R8: return f[9];
        default: return f[10];
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

/* Bytes of one prepared row of k values: two forms (the file's comment). */
int64_t mla_gg_prepared_bytes(int64_t k) {
    const int64_t kp = gg_padded(k);
    return GG_K_FORM(kp) + kp + kp / 64 + kp / 8;
}

/* The values x [g0, g0 + n) rounded to int8 with one scale (a NaN where a value is not finite, else amax / 127;
 * values to nearest even) at a, the scale at *scale, and each run of 16 rounded values' sum at h. */
static void gg_round_group(const float *x, int64_t k, int64_t g0, int n, int8_t *a, float *scale, int16_t *h) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        const float v = g0 + i < k ? x[g0 + i] : 0.0f;
        finite &= isfinite(v) != 0;
        amax = fabsf(v) > amax ? fabsf(v) : amax;
    }
    const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    *scale = !finite ? NAN : amax / 127.0f;
    for (int i = 0; i < n; i++) {  /* to nearest even (the default rounding mode) */
        const float q = finite && g0 + i < k ? nearbyintf(x[g0 + i] * inv) : 0.0f;  /* 0 x an infinite inv: 0 */
        a[i] = (int8_t)(q > 127.0f ? 127 : q < -127.0f ? -127 : q == q ? q : 0);
    }
    for (int l = 0; l < n / 16; l++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += a[16 * l + i];
        h[l] = (int16_t)sum;
    }
}

/* gg_round_group for a whole group inside the row (x: its n values, n a multiple of 16) with AVX2: the same
 * values (the largest magnitude is exact in any order, and each value is the same product rounded the same way). */
__attribute__((target("avx2,fma"))) static void gg_round_group_avx2(const float *x, int n, int8_t *a, float *scale,
                                                                    int16_t *h) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), zero = _mm256_setzero_ps();
    __m256 top = zero, odd = zero;
    for (int i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(_mm256_and_ps(v, magnitude), top);  /* a NaN lane keeps top, as the loop above */
        odd = _mm256_or_ps(odd, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_NEQ_UQ));  /* infinite or NaN */
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    const int finite = _mm256_movemask_ps(odd) == 0;
    *scale = !finite ? NAN : amax / 127.0f;
    if (!finite || amax == 0.0f) {
        memset(a, 0, (size_t)n);
        memset(h, 0, (size_t)n / 16 * sizeof(int16_t));
        return;
    }
    const __m256 inv = _mm256_set1_ps(127.0f / amax), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int i = 0; i < n; i += 16) {
        __m256i q[2];
        for (int u = 0; u < 2; u++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * u), inv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[u] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), _MM_SHUFFLE(3, 1, 2, 0));
        _mm_storeu_si128((__m128i *)(a + i), _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
        const __m256i s = _mm256_madd_epi16(w, _mm256_set1_epi16(1));  /* eight pair sums of the sixteen */
        const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        const __m128i u = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        h[i / 16] = (int16_t)_mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1))));
    }
}

/* One row x [k] -> its prepared form at out (the file's comment): groups of 32, then of 256; whole groups inside
 * the row with AVX2 where the CPU has it (wherever these kernels run), the others by gg_round_group. */
static void gg_prepare_row(const float *x, int64_t k, uint8_t *out) {
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int64_t kp = gg_padded(k);
    uint8_t *k_form = out + GG_K_FORM(kp);
    for (int64_t g = 0; g < kp; g += GG_GROUP) {
        int8_t *a = (int8_t *)out + g;
        float *scale = (float *)(out + kp) + g / GG_GROUP;
        int16_t *h = (int16_t *)(out + kp + kp / 8) + g / 16;
        if (avx2 && g + GG_GROUP <= k) gg_round_group_avx2(x + g, GG_GROUP, a, scale, h);
        else gg_round_group(x, k, g, GG_GROUP, a, scale, h);
    }
    for (int64_t g = 0; g < kp; g += 256) {
        int8_t *a = (int8_t *)k_form + g;
        float *scale = (float *)(k_form + kp) + g / 256;
        int16_t *h = (int16_t *)(k_form + kp + kp / 64) + g / 16;
        if (avx2 && g + 256 <= k) gg_round_group_avx2(x + g, 256, a, scale, h);
        else gg_round_group(x, k, g, 256, a, scale, h);
    }
}

void mla_gg_prepare(const float *x, int64_t k, uint8_t *out) { gg_prepare_row(x, k, out); }

typedef void (*GgRun)(const GgCall *, int64_t, int64_t);

static GgRun gg_run(int64_t variant) { return variant == GG_AVX512_VNNI ? gg_rows_avx512 : gg_rows_avx2; }

/* Part p of a parts table (mla_cpu.h, GG_PARTS) as a call over the prepared rows xp (stride xs) of m rows, its
 * outputs at columns [first, first + its rows) of y [m, n]. */
static GgCall gg_part_call(const int64_t *parts, int64_t p, int64_t first, const uint8_t *xp, int64_t xs, float *y,
                           int64_t m) {
    const int64_t *f = parts + GG_HEAD + p * GG_PART_FIELDS, n = parts[1], k = parts[2];
    const GgCall c = {(const uint8_t *)(intptr_t)f[1], xp, y + first, f[0], f[2], xs, m, n, k, gg_padded(k)};
    return c;
}

/* A list of products run in one loop: call c's weight rows [0, rows[c]) in blocks of block[c] rows (as
 * mla_gemm_gg_parts cuts them), numbered [starts[c], starts[c + 1]) in list order. */
typedef struct {
    GgCall *calls;
    int64_t *block, *rows, *starts, count;
} GgList;

static GgList gg_list(int64_t capacity) {
    GgList l = {(GgCall *)malloc((size_t)capacity * sizeof(GgCall)),
                (int64_t *)malloc((size_t)capacity * 2 * sizeof(int64_t)), NULL,
                (int64_t *)calloc((size_t)capacity + 1, sizeof(int64_t)), 0};
    if (!l.calls || !l.block || !l.starts) abort();
    l.rows = l.block + capacity;
    return l;
}

static void gg_list_free(GgList *l) {
    free(l->calls);
    free(l->block);
    free(l->starts);
}

/* Append the parts of W (a parts table) times the m prepared rows at xp (stride xs), into y [m, n]. */
static void gg_list_add(GgList *l, const int64_t *parts, const uint8_t *xp, int64_t xs, float *y, int64_t m,
                        int64_t threads) {
    for (int64_t p = 0, first = 0; p < parts[0]; p++) {
        const int64_t *f = parts + GG_HEAD + p * GG_PART_FIELDS, c = l->count++;
        const int64_t fit = GG_BLOCK_BYTES / mla_ggml_row_bytes(f[0], parts[2]), balanced = f[3] / (4 * threads);
        const int64_t block = fit < balanced ? fit : balanced, unit = f[0] == GG_Q4_K_R8 ? 8 : 1;
        l->block[c] = block < unit ? unit : block / unit * unit;  /* a repacked part in whole eight-row groups */
        l->rows[c] = f[3];
        l->calls[c] = gg_part_call(parts, p, first, xp, xs, y, m);
        l->starts[c + 1] = l->starts[c] + (f[3] + l->block[c] - 1) / l->block[c];
        first += f[3];
    }
}

static inline void gg_list_block(const GgList *l, int64_t b, GgRun run) {
    int64_t c = 0;
    while (b >= l->starts[c + 1]) c++;
    const int64_t r0 = (b - l->starts[c]) * l->block[c], r1 = r0 + l->block[c];
    run(&l->calls[c], r0, r1 < l->rows[c] ? r1 : l->rows[c]);
}

/* Inside a parallel region: every block of the list; the loop's barrier ends it. Where every call has the same rows
 * the blocks cost alike and are dealt in list order (each thread a stretch of consecutive blocks: one stream of
 * weights); else a thread takes the next block when it is done with one. */
static void gg_list_run(const GgList *l, GgRun run) {
    int even = 1;
    for (int64_t c = 1; c < l->count; c++) even &= l->calls[c].m == l->calls[0].m;
    if (even) {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < l->starts[l->count]; b++) gg_list_block(l, b, run);
    } else {
        #pragma omp for schedule(dynamic)
        for (int64_t b = 0; b < l->starts[l->count]; b++) gg_list_block(l, b, run);
    }
}

/* Y [rows, n] = X [rows, k] W^T in float32 for W a parts table (mla_cpu.h): the rows prepared once, then each part's
 * weight rows in blocks (about GG_BLOCK_BYTES, at least about four a thread), every block over every input row. */
void mla_gemm_gg_parts(const int64_t *parts, const float *x, float *y, int64_t rows, int64_t threads,
                       int64_t variant) {
    const int64_t k = parts[2], xs = mla_gg_prepared_bytes(k);
    uint8_t *xp = (uint8_t *)alloc_lines((size_t)(rows * xs));
    if (!xp || parts[0] > GG_MAX_PARTS) abort();  /* ops/cpu_kernels.cpp bounds the rows and the parts */
    GgList list = gg_list(parts[0]);
    gg_list_add(&list, parts, xp, xs, y, rows, threads);
    const GgRun run = gg_run(variant);
    #pragma omp parallel num_threads((int)threads)
    {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < rows; j++) gg_prepare_row(x + j * k, k, xp + j * xs);
        gg_list_run(&list, run);
    }
    gg_list_free(&list);
    free(xp);
}

/* Y [rows, n] = X [rows, k] W^T in float32, W [n, row_bytes] in ggml type `type` (the file's comment), row r at
 * w + r w_stride: a table of one part. */
void mla_gemm_ggml(int64_t type, const uint8_t *w, int64_t w_stride, const float *x, float *y, int64_t rows,
                   int64_t n, int64_t k, int64_t threads, int64_t variant) {
    if (!mla_ggml_row_bytes(type, k)) abort();  /* ops/cpu_kernels.cpp checks the type and the row */
    const int64_t parts[GG_HEAD + GG_PART_FIELDS] = {1, n, k, type, (int64_t)(intptr_t)w, w_stride, n};
    mla_gemm_gg_parts(parts, x, y, rows, threads, variant);
}

/* The 6-bit scales and minimums of a Q4_K super-block's 12 bytes q: j < 4 the low 6 bits of q[j] and q[j + 4];
 * j >= 4 the low and the high nibble of q[j + 4] over the top 2 bits of q[j - 4] and q[j]. */
static void gg_q4_k_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (uint8_t)((q[j + 8] & 15) | (q[j] >> 6) << 4);
        mn[j + 4] = (uint8_t)((q[j + 8] >> 4) | (q[j + 4] >> 6) << 4);
    }
}

/* Fault in the pages of [p, p + bytes) before they are first written, in one call (MADV_POPULATE_WRITE, Linux 5.14;
 * elsewhere, or on an older kernel, a no-op), under transparent huge pages where the kernel grants them: a load's
 * repacked matrices, gigabytes, otherwise take a fault every 4 KiB (here 1.0 -> 2.2-2.7 GB/s repacked). The pages'
 * contents do not change. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static void gg_fault_in(void *p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21, page = 4096, at = (uintptr_t)p, end = at + (uintptr_t)bytes;
    const uintptr_t a = (at + huge - 1) & ~(huge - 1), b = end & ~(huge - 1);
    if (b > a) madvise((void *)a, b - a, MADV_HUGEPAGE);
    madvise((void *)(at & ~(page - 1)), ((end + page - 1) & ~(page - 1)) - (at & ~(page - 1)), MADV_POPULATE_WRITE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* Row i (of eight) of a Q4_K super-block p into the eight-row super-block o of GG_Q4_K_R8 (ggml_rows.h's
 * gg_q4r8_rows gives the layout): each group's 16 nibble bytes (values v and v + 16) made once and dealt four bytes
 * to each of the group's four vectors, then its scales, minimums, d and dmin. */
static void gg_q4r8_row(const uint8_t *p, int i, uint8_t *o) {
    const __m128i low = _mm_set1_epi8(0x0f), high = _mm_set1_epi8((char)0xf0);
    for (int c = 0; c < 4; c++) {  /* groups 2c (the low nibbles of qs[32 c ..]) and 2c + 1 (the high) */
        const __m128i a = _mm_loadu_si128((const __m128i *)(p + 16 + 32 * c));
        const __m128i z = _mm_loadu_si128((const __m128i *)(p + 32 + 32 * c));
        const __m128i row[2] = {_mm_or_si128(_mm_and_si128(a, low), _mm_slli_epi16(_mm_and_si128(z, low), 4)),
                                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_and_si128(z, high))};
        for (int h = 0; h < 2; h++) {
            uint32_t words[4];
            _mm_storeu_si128((__m128i *)words, row[h]);
            for (int q = 0; q < 4; q++) memcpy(o + 128 * (2 * c + h) + 32 * q + 4 * i, words + q, 4);
        }
    }
    uint8_t sc[8], mn[8];
    gg_q4_k_scales(p + 4, sc, mn);
    for (int g = 0; g < 8; g++) {
        o[1024 + 8 * g + i] = sc[g];
        o[1088 + 16 * (g / 2) + 2 * i + g % 2] = mn[g];
    }
    memcpy(o + 1152 + 2 * i, p, 2);
    memcpy(o + 1168 + 2 * i, p + 2, 2);
}

/* Q4_K rows into GG_Q4_K_R8: eight rows' super-block b at out + (group x k / 256 + b) x GG_Q4R8_BYTES. Each thread
 * faults in the pages of its own groups first. */
void mla_ggml_repack_q4_k(const uint8_t *w, int64_t w_stride, int64_t n, int64_t k, uint8_t *out, int64_t threads) {
    const int64_t nb = k / 256, groups = n / 8, bytes = nb * GG_Q4R8_BYTES;
    #pragma omp parallel num_threads((int)threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        gg_fault_in(out + g0 * bytes, (g1 - g0) * bytes);
        for (int64_t g = g0; g < g1; g++)
            for (int64_t b = 0; b < nb; b++)
                for (int i = 0; i < 8; i++)
                    gg_q4r8_row(w + (8 * g + i) * w_stride + b * 144, i, out + g * bytes + b * GG_Q4R8_BYTES);
    }
}

/* Inside a parallel region: this thread's share of the rows of y [n] = alpha (W x) (+ y when add) for one prepared
 * row xp, W a parts table; the same bits as mla_gemm_gg_parts's row. No barrier. */
#define GG_SHARE_ROWS 64
void mla_gg_share(int64_t variant, const int64_t *parts, const uint8_t *xp, float *y, float alpha, int add) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads(), n = parts[1];
    const int64_t r0 = n * t / nt / 8 * 8, r1 = t + 1 == nt ? n : n * (t + 1) / nt / 8 * 8;  /* whole groups of 8 */
    const GgRun run = gg_run(variant);
    float out[GG_SHARE_ROWS];
    for (int64_t p = 0, first = 0; p < parts[0]; first += parts[GG_HEAD + p * GG_PART_FIELDS + 3], p++) {
        const int64_t *f = parts + GG_HEAD + p * GG_PART_FIELDS;
        const int64_t a = r0 > first ? r0 : first, b = r1 < first + f[3] ? r1 : first + f[3];
        for (int64_t c0 = a; c0 < b; c0 += GG_SHARE_ROWS) {  /* a run of rows into out, then scaled into y */
            const int64_t len = b - c0 < GG_SHARE_ROWS ? b - c0 : GG_SHARE_ROWS;
            GgCall c = gg_part_call(parts, p, 0, xp, 0, out, 1);
            c.w += (c0 - first) * f[2];
            run(&c, 0, len);
            for (int64_t i = 0; i < len; i++) y[c0 + i] = alpha * out[i] + (add ? y[c0 + i] : 0.0f);
        }
    }
}


/* Gated MLPs over rows of h [t, d], every product in ggml block types of one variant, in one parallel region: MLP i
 * (the row ids[i] of table, MLP_FIELDS) over the counts[i] rows rows[i][..] of h, its outputs [counts[i], d] at
 * out + offset_i d, offset_i the counts before it (out [sum counts, d]). Each output is gated_rows' (mla_layer_f32.c):
 * down(silu(gate h) * up h), the same bits, as every product's row is computed alone. The h rows are prepared once;
 * all gate_up products are one loop of blocks, then the activations (each prepared for the down products), then all
 * down products: three barriers where a product each would take two, and each thread streams one stretch of
 * weights per loop. */
void mla_gg_mlps(int64_t variant, const int64_t *table, const int64_t *ids, const int64_t *const *rows,
                 const int64_t *counts, int64_t n, const float *h, int64_t t, int64_t d, float *out,
                 int64_t threads) {
    int64_t inter = 1, pairs[n + 1], parts = 0;
    pairs[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t *mlp = table + ids[i] * MLP_FIELDS;
        inter = mlp[6] > inter ? mlp[6] : inter;
        pairs[i + 1] = pairs[i] + counts[i];
        parts += ((const int64_t *)mlp[0])[0] + ((const int64_t *)mlp[3])[0];
    }
    const int64_t total = pairs[n], xs_d = mla_gg_prepared_bytes(d), xs_i = mla_gg_prepared_bytes(inter);
    uint8_t *xh = (uint8_t *)alloc_lines((size_t)((t + total) * xs_d + total * xs_i));
    float *gate_up = (float *)alloc_lines((size_t)(total * 3 * inter) * sizeof(float));
    if (!xh || !gate_up) abort();
    uint8_t *xin = xh + t * xs_d, *xa = xin + total * xs_d;  /* each pair's gathered h row; its activation row */
    GgList up = gg_list(parts), down = gg_list(parts);
    for (int64_t i = 0; i < n; i++) {
        const int64_t *mlp = table + ids[i] * MLP_FIELDS;
        gg_list_add(&up, (const int64_t *)mlp[0], xin + pairs[i] * xs_d, xs_d, gate_up + pairs[i] * 2 * inter,
                    counts[i], threads);
        gg_list_add(&down, (const int64_t *)mlp[3], xa + pairs[i] * xs_i, xs_i, out + pairs[i] * d, counts[i],
                    threads);
    }
    const GgRun run = gg_run(variant);
    #pragma omp parallel num_threads((int)threads)
    {
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < t; j++) gg_prepare_row(h + j * d, d, xh + j * xs_d);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < total; p++) {
            int64_t i = 0;
            while (p >= pairs[i + 1]) i++;
            memcpy(xin + p * xs_d, xh + rows[i][p - pairs[i]] * xs_d, (size_t)xs_d);
        }
        gg_list_run(&up, run);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < total; p++) {
            int64_t i = 0;
            while (p >= pairs[i + 1]) i++;
            const int64_t I = table[ids[i] * MLP_FIELDS + 6], j = p - pairs[i];
            const float *g = gate_up + pairs[i] * 2 * inter + j * 2 * I;
            float *act = gate_up + total * 2 * inter + p * inter;
            for (int64_t r = 0; r < I; r++) act[r] = g[r] / (1.0f + expf(-g[r])) * g[I + r];
            gg_prepare_row(act, I, xa + p * xs_i);
        }
        gg_list_run(&down, run);
    }
    gg_list_free(&up);
    gg_list_free(&down);
    free(xh);
    free(gate_up);
}
