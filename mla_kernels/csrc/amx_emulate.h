/* The AMX tile instructions that amx_bf16.c and amx_int8.c use, in software, so that their products run on a CPU
 * without AMX: for tests only. Two ways in: the typed operators built with MLA_AMX_EMULATE defined (the two sources
 * include this header then, and mla_amx_bf16() answers from the CPU's AVX512-BF16 alone, mla_amx_int8() from AVX2:
 * mla_kernels.cpu_ops does so when $MLA_CPU_EMULATE_AMX is 1), or a test program that compiles amx_bf16.c with
 * -include of this header (it takes <immintrin.h> itself first, so amx_bf16.c's own inclusion is a no-op). Either way
 * the tile intrinsics become functions over eight 1 KB tiles per thread.
 *
 * Each instruction checks what the hardware faults on (a tile used before a configuration, a configuration other
 * than palette 1, a tile wider than 64 bytes or taller than 16 rows, the shapes of TDPBF16PS's and TDPBSSD's
 * operands) and aborts with a message instead. TDPBF16PS accumulates each pair of products into its float32 sum as the SDM's pseudocode
 * gives it, widening the bfloat16 values exactly; TDPBSSD sums each four products of signed bytes into its int32 sum
 * (wrapping as the hardware's int32 addition does). */
#ifndef MLA_AMX_EMULATE_H
#define MLA_AMX_EMULATE_H
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct EmuTiles {
    uint8_t data[8][16][64];  /* rows of 64 bytes */
    uint16_t colsb[8];
    uint8_t rows[8];
    int configured;
};
static thread_local EmuTiles emu_tiles;

[[noreturn]] static void emu_fault(const char *what, int t) {
    fprintf(stderr, "AMX emulation: %s (tile %d)\n", what, t);
    abort();
}

static void emu_check(int t) {
    if (!emu_tiles.configured) emu_fault("a tile used before LDTILECFG", t);
    if (t < 0 || t > 7 || emu_tiles.rows[t] == 0 || emu_tiles.rows[t] > 16 || emu_tiles.colsb[t] == 0 ||
        emu_tiles.colsb[t] > 64)
        emu_fault("a tile its configuration leaves empty or too large", t);
}

static void emu_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    if (c[0] != 1) emu_fault("a palette other than 1", -1);
    for (int t = 0; t < 8; t++) {
        memcpy(&emu_tiles.colsb[t], c + 16 + 2 * t, 2);
        emu_tiles.rows[t] = c[48 + t];
    }
    memset(emu_tiles.data, 0, sizeof emu_tiles.data);
    emu_tiles.configured = 1;
}

static void emu_zero(int t) {
    emu_check(t);
    memset(emu_tiles.data[t], 0, sizeof emu_tiles.data[t]);
}

static void emu_loadd(int t, const void *base, long stride) {
    emu_check(t);
    memset(emu_tiles.data[t], 0, sizeof emu_tiles.data[t]);
    for (int r = 0; r < emu_tiles.rows[t]; r++)
        memcpy(emu_tiles.data[t][r], (const char *)base + r * stride, emu_tiles.colsb[t]);
}

static void emu_stored(int t, void *base, long stride) {
    emu_check(t);
    for (int r = 0; r < emu_tiles.rows[t]; r++)
        memcpy((char *)base + r * stride, emu_tiles.data[t][r], emu_tiles.colsb[t]);
}

static float emu_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A tile product's operands: each configured, and their shapes as the hardware requires (c: M x N, a: M x K, b:
 * K / 4 x N in rows of 4-byte groups) */
static void emu_dot_operands(int c, int a, int b, const char *mismatch) {
    emu_check(c);
    emu_check(a);
    emu_check(b);
    if (emu_tiles.rows[c] != emu_tiles.rows[a] || emu_tiles.colsb[c] != emu_tiles.colsb[b] ||
        emu_tiles.colsb[a] != 4 * emu_tiles.rows[b])
        emu_fault(mismatch, c);
}

/* c[m][n] += a[m][2k] b[k][2n] + a[m][2k + 1] b[k][2n + 1] over k, in float32 */
static void emu_dpbf16ps(int c, int a, int b) {
    emu_dot_operands(c, a, b, "TDPBF16PS operands whose shapes do not match");
    for (int m = 0; m < emu_tiles.rows[c]; m++)
        for (int n = 0; n < emu_tiles.colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, emu_tiles.data[c][m] + 4 * n, 4);
            for (int k = 0; k < emu_tiles.colsb[a] / 4; k++) {
                acc += emu_bf16(emu_tiles.data[a][m] + 4 * k) * emu_bf16(emu_tiles.data[b][k] + 4 * n);
                acc += emu_bf16(emu_tiles.data[a][m] + 4 * k + 2) * emu_bf16(emu_tiles.data[b][k] + 4 * n + 2);
            }
            memcpy(emu_tiles.data[c][m] + 4 * n, &acc, 4);
        }
}

/* c[m][n] += sum over k of a[m][4k + i] b[k][4n + i], i < 4, signed bytes, in int32 */
static void emu_dpbssd(int c, int a, int b) {
    emu_dot_operands(c, a, b, "TDPBSSD operands whose shapes do not match");
    for (int m = 0; m < emu_tiles.rows[c]; m++)
        for (int n = 0; n < emu_tiles.colsb[c] / 4; n++) {
            uint32_t acc;
            memcpy(&acc, emu_tiles.data[c][m] + 4 * n, 4);
            for (int k = 0; k < emu_tiles.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    acc += (uint32_t)((int32_t)(int8_t)emu_tiles.data[a][m][4 * k + i] *
                                      (int32_t)(int8_t)emu_tiles.data[b][k][4 * n + i]);
            memcpy(emu_tiles.data[c][m] + 4 * n, &acc, 4);
        }
}

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) emu_loadconfig(config)
#define _tile_release() (emu_tiles.configured = 0)
#define _tile_zero(t) emu_zero(t)
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) emu_dpbf16ps(c, a, b)
#undef _tile_dpbssd
#define _tile_dpbssd(c, a, b) emu_dpbssd(c, a, b)
#endif
