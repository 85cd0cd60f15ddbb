/* What the AMX tile kernels (amx_bf16.c, amx_int8.c) share: ldtilecfg's configuration and whether this process may run
 * them. */
#ifndef MLA_AMX_TILES_H
#define MLA_AMX_TILES_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "isa_cap.h"

/* The tile configuration of ldtilecfg (palette 1): bytes per row and rows of each of the eight tiles. */
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* 1 where the CPU has `features` (CpuFeature bits) and the kernel lets this process use the tile state (Linux 5.16 and
 * later: arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); built with MLA_AMX_EMULATE (the tiles in software),
 * where it has `emulated`, what runs beside the tiles. The $MLA_CPU_ISA cap is the caller's to apply. */
static inline int amx_usable(int64_t features, int64_t emulated) {
#ifdef MLA_AMX_EMULATE
    (void)features;
    return (int)mla_cpu_has(emulated);
#else
    (void)emulated;
    return mla_cpu_has(features) && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                            18 /* XFEATURE_XTILEDATA */) == 0;
#endif
}
#endif
