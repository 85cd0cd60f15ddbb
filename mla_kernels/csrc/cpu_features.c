/* The one probe of the CPU's features (isa_cap.h's CpuFeature), made once per process, and whether a variant runs:
 * the CPU has its features and the instruction-set cap (ops/isa.cpp) allows its level. */
#include "isa_cap.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define HAS(name) __builtin_cpu_supports(name)
static int64_t probe(void) {
    __builtin_cpu_init();
    return (HAS("avx2") && HAS("fma") && HAS("f16c") && HAS("bmi2") ? MLA_CPU_AVX2 : 0) |
           (HAS("avx512f") && HAS("avx512bw") && HAS("avx512vl") && HAS("avx512dq") && HAS("avx512cd")
                ? MLA_CPU_AVX512 : 0) |
           (HAS("avx512vnni") ? MLA_CPU_VNNI : 0) | (HAS("avx512bf16") ? MLA_CPU_BF16 : 0) |
           (HAS("amx-tile") && HAS("amx-bf16") ? MLA_CPU_AMX : 0) |
           (HAS("amx-tile") && HAS("amx-int8") ? MLA_CPU_AMX_INT8 : 0);
}
#else
static int64_t probe(void) { return 0; }
#endif

int64_t mla_cpu_has(int64_t features) {
    static const int64_t found = probe();
    return (found & features) == features;
}

int64_t mla_isa_runs(int64_t features, int64_t level) { return mla_cpu_has(features) && mla_isa_allows(level); }
