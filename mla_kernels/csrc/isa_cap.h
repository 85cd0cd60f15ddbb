/* The one probe of the CPU's features (ops/isa.cpp: mla_cpu_has, probed once) and the widest instruction set the
 * kernels may choose in this process: every variant runs where mla_isa_runs(features, level) says so, the CPU having
 * its features and the cap allowing its level, so a process capped at AVX2 runs, and sums in the order of, the AVX2
 * variants on any CPU. Levels, widest last; the default is MLA_ISA_AMX (no cap). */
#ifndef MLA_ISA_CAP_H
#define MLA_ISA_CAP_H
#include <stdint.h>

enum IsaLevel { MLA_ISA_BASE = 0, MLA_ISA_AVX2 = 1, MLA_ISA_AVX512 = 2, MLA_ISA_AMX = 3 };
/* Features, as bits: AVX2 with FMA, F16C and BMI2 (x86-64-v3); AVX-512 F, BW, VL, DQ and CD (x86-64-v4); and on top of
 * it VNNI, BF16 (dot products and conversions), the AMX tiles with their bfloat16 products, and with their int8 ones. */
enum CpuFeature {
    MLA_CPU_AVX2 = 1, MLA_CPU_AVX512 = 2, MLA_CPU_VNNI = 4, MLA_CPU_BF16 = 8, MLA_CPU_AMX = 16, MLA_CPU_AMX_INT8 = 32
};

#ifdef __cplusplus
extern "C" {
#endif
/* 1 where the cap lets a variant of this level run (the CPU must still have it). */
int64_t mla_isa_allows(int64_t level);
/* 1 where this CPU has every feature of `features` (CpuFeature bits; none on another architecture). */
int64_t mla_cpu_has(int64_t features);
/* 1 where a variant needing `features` at `level` runs in this process: mla_cpu_has and mla_isa_allows. */
int64_t mla_isa_runs(int64_t features, int64_t level);
#ifdef __cplusplus
}
#endif
#endif
