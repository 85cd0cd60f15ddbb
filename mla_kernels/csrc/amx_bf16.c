/* Products of a few dozen rows with bfloat16 weights on AMX tiles (Intel Sapphire Rapids and later).
 *
 * y [M, N] = x [M, K] . W^T in float32 for bfloat16 rows x (float32 rows are rounded to bfloat16 first, to nearest
 * even, as torch's conversion rounds) and a bfloat16 weight W [N, K] repacked once, at load, into AMX's operand layout
 * (mla_amx_pack_bf16): for each block of 16 output columns, its K in tiles of 32, each tile 16 rows of 16 column pairs
 * ([N / 16][K / 32][16][16][2]: a block's tiles lie one after another, so each thread streams its blocks front to
 * back). Each step of K loads two weight tiles (two blocks of 16 columns) and up to two tiles of 16 rows of x, and
 * accumulates four 16 x 16 float32 tiles; from 33 rows the rows go 32 at a time under each pair of blocks, the pair's
 * tiles read again from L2.
 *
 * Why: oneDNN's bfloat16 products of 8 to 128 rows stream a weight out of cache at 10-18 GB/s on a 2-core Xeon that
 * streams 31 GB/s; these stream it at 19-30 GB/s (bench/RESULTS.md). From a few hundred rows oneDNN's blocked
 * products are as fast or faster, and the callers take them there.
 *
 * AMX needs the kernel's permission to use the tile state (Linux 5.16 and later: arch_prctl ARCH_REQ_XCOMP_PERM);
 * mla_amx_bf16() asks for it once and answers 0 where the CPU, the kernel or the compiler cannot run these, or the
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

#define AMX_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

int64_t mla_amx_bf16(void) {
    static int known = -1;  /* emulated tiles: the rows are still rounded by AVX512-BF16 */
    if (known < 0) known = amx_usable(MLA_CPU_AVX512 | MLA_CPU_BF16 | MLA_CPU_AMX, MLA_CPU_AVX512 | MLA_CPU_BF16);
    return known && mla_isa_allows(MLA_ISA_AMX);
}

void mla_amx_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t kt = k / 32;
    #pragma omp parallel for collapse(2)
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t kb = 0; kb < kt; kb++) {
            uint16_t *tile = packed + (nb * kt + kb) * 512;
            for (int64_t r = 0; r < 16; r++)
                for (int64_t c = 0; c < 16; c++) {
                    const uint16_t *src = w + (nb * 16 + c) * k + kb * 32 + 2 * r;
                    tile[r * 32 + c * 2] = src[0];
                    tile[r * 32 + c * 2 + 1] = src[1];
                }
        }
}

/* rows x [m, k] (row stride ld) rounded to bfloat16 into out [m, k] */
AMX_TARGET static void round_rows(const float *x, int64_t ld, int64_t m, int64_t k, uint16_t *out) {
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * ld;
        uint16_t *dst = out + i * k;
        int64_t j = 0;
        for (; j + 16 <= k; j += 16)
            _mm256_storeu_si256((__m256i *)(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + j)));
        for (; j < k; j++) {
            uint32_t bits;
            memcpy(&bits, row + j, 4);
            dst[j] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
        }
    }
}

AMX_TARGET static void tiles(const uint16_t *x, const uint16_t *packed, float *y, int64_t m, int64_t n, int64_t k,
                             int64_t threads) {
    const int64_t kt = k / 32, blocks = n / 16, groups = (blocks + 1) / 2;
    #pragma omp parallel num_threads((int)threads)
    {
        const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = id * groups / nt, g1 = (id + 1) * groups / nt;
        struct TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
        cfg.rows[6] = cfg.rows[7] = 16;  /* tiles 0, 1: C of rows 0-15; 2, 3: rows 16-31; 4, 5: x; 6, 7: W */
        int64_t configured = -1;
        for (int64_t g = g0; g < g1; g++) {
            const int two = 2 * g + 1 < blocks;
            const uint16_t *b0 = packed + 2 * g * kt * 512, *b1 = b0 + kt * 512;
            for (int64_t r0 = 0; r0 < m; r0 += 32) {
                const int64_t rows = m - r0 < 32 ? m - r0 : 32;
                const int lo = rows < 16 ? (int)rows : 16, hi = (int)(rows - lo);
                if (rows != configured) {
                    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)lo;
                    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(hi ? hi : 1);
                    _tile_loadconfig(&cfg);
                    configured = rows;
                }
                const uint16_t *xr = x + r0 * k;
                float *yr = y + r0 * n + 32 * g;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < kt; kb++) {
                    _tile_loadd(4, xr + kb * 32, k * 2);
                    _tile_loadd(6, b0 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, b1 + kb * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (hi) {
                        _tile_loadd(5, xr + 16 * k + kb * 32, k * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, yr, n * 4);
                if (two) _tile_stored(1, yr + 16, n * 4);
                if (hi) {
                    _tile_stored(2, yr + 16 * n, n * 4);
                    if (two) _tile_stored(3, yr + 16 * n + 16, n * 4);
                }
            }
        }
        _tile_release();
    }
}

void mla_amx_linear_bf16(const float *xf, const uint16_t *xb, int64_t ld, const uint16_t *packed, float *y,
                         int64_t m, int64_t n, int64_t k, int64_t threads) {
    if (xf == NULL && ld == k) {
        tiles(xb, packed, y, m, n, k, threads);
        return;
    }
    /* the rows rounded (float32) or gathered (bfloat16 rows with another stride) into this thread's buffer, on cache
     * line boundaries: a tile row of 32 bfloat16 values is then one line */
    static thread_local uint16_t *buffer = NULL;
    static thread_local int64_t capacity = 0;
    if (capacity < m * k) {
        free(buffer);
        buffer = (uint16_t *)alloc_lines((size_t)(m * k) * 2);
        capacity = buffer ? m * k : 0;
        if (!buffer) abort();
    }
    if (xf != NULL)
        round_rows(xf, ld, m, k, buffer);
    else
        for (int64_t i = 0; i < m; i++) memcpy(buffer + i * k, xb + i * ld, (size_t)k * 2);
    tiles(buffer, packed, y, m, n, k, threads);
}

#else  /* no AMX intrinsics: never usable, never called */

int64_t mla_amx_bf16(void) { return 0; }
void mla_amx_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) { abort(); }
void mla_amx_linear_bf16(const float *xf, const uint16_t *xb, int64_t ld, const uint16_t *packed, float *y,
                         int64_t m, int64_t n, int64_t k, int64_t threads) { abort(); }

#endif
