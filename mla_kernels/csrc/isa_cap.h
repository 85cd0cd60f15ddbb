/* The widest instruction set the kernels may choose in this process (ops/isa.cpp): every probe of a variant asks
 * mla_isa_allows(level) besides the CPU itself, so a process capped at AVX2 runs, and sums in the order of, the AVX2
 * variants on any CPU. Levels, widest last; the default is MLA_ISA_AMX (no cap). */
#ifndef MLA_ISA_CAP_H
#define MLA_ISA_CAP_H
#include <stdint.h>

enum IsaLevel { MLA_ISA_BASE = 0, MLA_ISA_AVX2 = 1, MLA_ISA_AVX512 = 2, MLA_ISA_AMX = 3 };

#ifdef __cplusplus
extern "C" {
#endif
/* 1 where the cap lets a variant of this level run (the CPU must still have it). */
int64_t mla_isa_allows(int64_t level);
#ifdef __cplusplus
}
#endif
#endif
