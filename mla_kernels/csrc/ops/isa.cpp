// The instruction-set cap of the compiled kernels, as typed torch operators:
//
//   mla_kernels::set_max_isa(str isa)  "avx2", "avx512" (AVX-512 with VNNI and BF16 where present, no AMX tiles) or
//                                      "amx" (no cap, the default); set once when the library is loaded, before any
//                                      kernel runs (mla_kernels.cpu_ops reads $MLA_CPU_ISA)
//   mla_kernels::max_isa() -> str      the cap in force
//
// Every variant (the products', the attention's, the AMX tiles', the indexer's) runs where mla_isa_runs says so
// (../cpu_features.c: the one probe of the CPU, and this cap), so a capped process takes, on any CPU, the variants a
// CPU of that level takes, and computes the same bits.

#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "../isa_cap.h"

namespace {

const char* const NAMES[] = {"base", "avx2", "avx512", "amx"};
std::atomic<int64_t> cap{MLA_ISA_AMX};

void set_max_isa(c10::string_view name) {
  for (int64_t level = MLA_ISA_AVX2; level <= MLA_ISA_AMX; ++level) {
    if (name == NAMES[level]) {
      cap.store(level, std::memory_order_relaxed);
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "set_max_isa: unknown instruction set '", name, "' (avx2, avx512, amx)");
}

std::string max_isa() { return NAMES[cap.load(std::memory_order_relaxed)]; }

}  // namespace

extern "C" int64_t mla_isa_allows(int64_t level) { return level <= cap.load(std::memory_order_relaxed); }

TORCH_LIBRARY_FRAGMENT(mla_kernels, m) {
  m.def("set_max_isa(str isa) -> ()", &set_max_isa);
  m.def("max_isa() -> str", &max_isa);
}
