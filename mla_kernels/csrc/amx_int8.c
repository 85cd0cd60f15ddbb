/* W8A8 products of several rows on AMX int8 tiles (Intel Sapphire Rapids and later): gemm_w8a8.c's product
 *
 *     y[j, c] = float(sum_i w[c, i] * xq[j, i]) * sx[j] * sw[c]
 *
 * with each integer sum formed by TDPBSSD (signed bytes times signed bytes, four to an int32, summed exactly). The
 * sums are the same integers as the AVX2 and AVX-512 VNNI variants', scaled by the same two multiplications in the same
 * order, so the same bits, and a row's result does not depend on the rows beside it.
 *
 * The weight is the tiles' first operand as stored, no copy: a tile is 16 weight rows by 64 bytes of K, loaded with the
 * row stride k. The input rows, rounded to int8 (gemm_w8a8.c), are the second operand, rearranged once per call into
 * the layout TDPBSSD reads ([row blocks of 16][K / 64][16 groups of four values][16 rows][4]). Each step of K loads
 * two weight tiles (32 weight rows) and two input tiles (32 rows), and accumulates four 16 x 16 int32 tiles; each
 * thread takes whole pairs of weight blocks, and while its first rows pass over one pair it prefetches the next
 * pair's (a weight streamed from memory: 48 rows of [2048, 1408] 0.36 -> 0.28 ms, bench_gemv.py, 2-core Xeon). K's
 * last k % 64 values are summed in scalar integers into the same sums.
 *
 * AMX needs the kernel's permission to use the tile state (Linux 5.16 and later: arch_prctl ARCH_REQ_XCOMP_PERM);
 * mla_amx_int8() asks for it once and answers 0 where the CPU, the kernel or the compiler cannot run these, or the
 * process is capped below AMX (isa_cap.h). */
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "mla_cpu.h"

#if defined(__x86_64__) && defined(__linux__) && (__GNUC__ >= 11 || defined(__clang__))
#include <immintrin.h>

#include "amx_tiles.h"
#include "simd.h"
#ifdef MLA_AMX_EMULATE
#include "amx_emulate.h"  /* the tile instructions in software: tests on CPUs without AMX */
#endif

#define AMX_I8_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))

int64_t mla_amx_int8(void) {
    static int known = -1;  /* emulated tiles: AVX-512 beside them */
    if (known < 0) known = amx_usable(MLA_CPU_AMX_INT8, MLA_CPU_AVX512 | MLA_CPU_VNNI);
    return known && mla_isa_allows(MLA_ISA_AMX);
}

/* rows xq [m, k] (int8 values held as int16) into TDPBSSD's second operand: for each block of 16 rows and each 64
 * values of K, 16 lines of 64 bytes, line g holding each row's values 4g .. 4g + 3 (rows past m: zeros); a row's 64
 * values narrowed to bytes at once, their 16 groups of four scattered down the lines */
AMX_I8_TARGET static void pack_rows(const int16_t *xq, int64_t m, int64_t k, int8_t *out) {
    const int64_t kt = k / 64;
    memset(out, 0, (size_t)((m + 15) / 16 * kt) * 1024);
    const __m512i lines = _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                                      6, 5, 4, 3, 2, 1, 0));
    for (int64_t j = 0; j < m; j++)
        for (int64_t kb = 0; kb < kt; kb++) {
            const int16_t *src = xq + j * k + kb * 64;
            const __m256i lo = _mm512_cvtepi16_epi8(_mm512_loadu_si512((const void *)src));
            const __m256i hi = _mm512_cvtepi16_epi8(_mm512_loadu_si512((const void *)(src + 32)));
            const __m512i bytes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_i32scatter_epi32(out + ((j / 16) * kt + kb) * 1024 + (j % 16) * 4, lines, bytes, 4);
        }
}

/* the tile shapes of one (weight block pair, row block pair): a and b weight rows (b may be 0), p and q input rows */
AMX_I8_TARGET static void configure(struct TileConfig *cfg, int a, int b, int p, int q) {
    const int b1 = b ? b : 1, q1 = q ? q : 1;  /* an unused tile keeps a legal shape */
    cfg->rows[0] = (uint8_t)a, cfg->colsb[0] = (uint16_t)(4 * p);   /* sums: weight block 0 x row block 0 */
    cfg->rows[1] = (uint8_t)b1, cfg->colsb[1] = (uint16_t)(4 * p);  /* weight block 1 x row block 0 */
    cfg->rows[2] = (uint8_t)a, cfg->colsb[2] = (uint16_t)(4 * q1);  /* weight block 0 x row block 1 */
    cfg->rows[3] = (uint8_t)b1, cfg->colsb[3] = (uint16_t)(4 * q1); /* weight block 1 x row block 1 */
    cfg->rows[4] = (uint8_t)a, cfg->colsb[4] = 64;                  /* weight rows */
    cfg->rows[5] = (uint8_t)b1, cfg->colsb[5] = 64;
    cfg->rows[6] = 16, cfg->colsb[6] = (uint16_t)(4 * p);           /* input rows */
    cfg->rows[7] = 16, cfg->colsb[7] = (uint16_t)(4 * q1);
    _tile_loadconfig(cfg);
}

/* y[j, c] = float(sum) * sx[j] * sw[c] for the sums of a tile, sums[r][i] for weight row c0 + r (r < rows) and
 * input row j0 + i (i < cols), K's last values (kv .. k) added in scalar integers first; each input row's outputs
 * written as one run of 16 (the sums read down a column), the same two multiplications in the same order */
AMX_I8_TARGET static void finish(int32_t sums[16][16], const int8_t *w, const float *sw, const int16_t *xq,
                                 const float *sx, float *y, int64_t c0, int rows, int64_t j0, int cols, int64_t n,
                                 int64_t k, int64_t kv) {
    if (kv < k)
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < cols; i++)
                for (int64_t e = kv; e < k; e++) sums[r][i] += (int32_t)w[(c0 + r) * k + e] * xq[(j0 + i) * k + e];
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    const __m512i down = _mm512_mullo_epi32(_mm512_set1_epi32(16), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                                     6, 5, 4, 3, 2, 1, 0));
    const __m512 scale = _mm512_maskz_loadu_ps(keep, sw + c0);
    for (int i = 0; i < cols; i++) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_i32gather_epi32(down, &sums[0][i], 4));
        _mm512_mask_storeu_ps(y + (j0 + i) * n + c0, keep,
                              _mm512_mul_ps(_mm512_mul_ps(s, _mm512_set1_ps(sx[j0 + i])), scale));
    }
}

AMX_I8_TARGET static void tiles_i8(const int8_t *w, const float *sw, const int8_t *xb, const int16_t *xq,
                                   const float *sx, float *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
    const int64_t kt = k / 64, kv = kt * 64, blocks = (n + 15) / 16, groups = (blocks + 1) / 2;
    #pragma omp parallel num_threads((int)(groups > 1 ? threads : 1))
    {
        const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = id * groups / nt, g1 = (id + 1) * groups / nt;
        struct TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        int64_t shape = -1;
        int32_t sums[4][16][16];
        for (int64_t g = g0; g < g1; g++) {
            const int64_t c0 = 32 * g;
            const int a = n - c0 < 16 ? (int)(n - c0) : 16;
            const int b = n - c0 - 16 <= 0 ? 0 : n - c0 - 16 < 16 ? (int)(n - c0 - 16) : 16;
            const int8_t *w0 = w + c0 * k, *w1 = w0 + 16 * k;
            for (int64_t j0 = 0; j0 < m; j0 += 32) {
                const int p = m - j0 < 16 ? (int)(m - j0) : 16;
                const int q = m - j0 - 16 <= 0 ? 0 : m - j0 - 16 < 16 ? (int)(m - j0 - 16) : 16;
                const int64_t now = ((int64_t)a << 24) | ((int64_t)b << 16) | (p << 8) | q;
                if (now != shape) {
                    configure(&cfg, a, b, p, q);
                    shape = now;
                }
                const int8_t *x0 = xb + (j0 / 16) * kt * 1024, *x1 = x0 + kt * 1024;
                _tile_zero(0);
                if (b) _tile_zero(1);
                if (q) _tile_zero(2);
                if (b && q) _tile_zero(3);
                /* the first pass over a pair of weight blocks also asks for the next pair's rows (the tiles read
                 * them as 32 short strides, which the hardware prefetchers do not follow), as many lines a step */
                const int8_t *ahead = j0 == 0 && g + 1 < g1 ? w0 + 32 * k : NULL;
                const int ahead_rows = ahead ? (int)(n - c0 - 32 < 32 ? n - c0 - 32 : 32) : 0;
                for (int64_t kb = 0; kb < kt; kb++) {
                    for (int r = 0; r < ahead_rows; r++)  /* the pair's rows are one run of memory: in order */
                        _mm_prefetch((const char *)(ahead + (kb * ahead_rows + r) * 64), _MM_HINT_T1);
                    _tile_loadd(4, w0 + kb * 64, k);
                    _tile_loadd(6, x0 + kb * 1024, 64);
                    _tile_dpbssd(0, 4, 6);
                    if (b) {
                        _tile_loadd(5, w1 + kb * 64, k);
                        _tile_dpbssd(1, 5, 6);
                    }
                    if (q) {
                        _tile_loadd(7, x1 + kb * 1024, 64);
                        _tile_dpbssd(2, 4, 7);
                        if (b) _tile_dpbssd(3, 5, 7);
                    }
                }
                _tile_stored(0, sums[0], 64);
                if (b) _tile_stored(1, sums[1], 64);
                if (q) _tile_stored(2, sums[2], 64);
                if (b && q) _tile_stored(3, sums[3], 64);
                for (int t = 0; t < 4; t++)
                    finish(sums[t], w, sw, xq, sx, y, c0 + 16 * (t & 1), t & 1 ? b : a, j0 + 16 * (t >> 1),
                           t >> 1 ? q : p, n, k, kv);
            }
        }
        _tile_release();
    }
}

void mla_amx_w8a8(const int8_t *w, const float *sw, const int16_t *xq, const float *sx, float *y, int64_t m, int64_t n,
                  int64_t k, int64_t threads) {
    int8_t *xb = (int8_t *)alloc_lines((size_t)(((m + 15) / 16) * (k / 64) * 1024 + 64));
    if (!xb) abort();
    pack_rows(xq, m, k, xb);
    tiles_i8(w, sw, xb, xq, sx, y, m, n, k, threads);
    free(xb);
}

#else  /* no AMX intrinsics: never usable, never called */

int64_t mla_amx_int8(void) { return 0; }
void mla_amx_w8a8(const int8_t *w, const float *sw, const int16_t *xq, const float *sx, float *y, int64_t m, int64_t n,
                  int64_t k, int64_t threads) { abort(); }

#endif
