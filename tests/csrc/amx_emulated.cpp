// csrc/amx_bf16.c's products on emulated tiles (amx_emulate.h), against float64 sums of the same bfloat16 values:
// prints one line per case and exits 1 at the first wrong one. Built and run by tests/test_fast_path.py.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "mla_cpu.h"

extern "C" int64_t mla_isa_allows(int64_t) { return 1; }  // ops/isa.cpp's cap: none here

static uint16_t to_bf16(float f) {  // to nearest even, as torch rounds
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static double widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// y [m, n] for rows x [m, k] of stride ld: float32 (rounded by the kernel) or bfloat16
static bool check(int64_t m, int64_t n, int64_t k, int64_t ld, bool f32, int threads, std::mt19937& gen) {
  std::normal_distribution<float> normal;
  std::vector<uint16_t> w(n * k), packed(n * k), xb(m * ld);
  std::vector<float> xf(m * ld), y(m * n, NAN), one(n, NAN);
  for (auto& v : w) v = to_bf16(normal(gen));
  for (int64_t i = 0; i < m * ld; i++) {
    xf[i] = normal(gen);
    xb[i] = to_bf16(xf[i]);
  }
  mla_amx_pack_bf16(w.data(), packed.data(), n, k);
  omp_set_num_threads(threads);
  mla_amx_linear_bf16(f32 ? xf.data() : nullptr, f32 ? nullptr : xb.data(), ld, packed.data(), y.data(), m, n, k,
                      threads);
  double worst = 0.0;
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double sum = 0.0, size = 0.0;
      for (int64_t c = 0; c < k; c++) {
        const double term = widen(xb[i * ld + c]) * widen(w[j * k + c]);  // the kernel rounds float32 rows alike
        sum += term;
        size += std::fabs(term);
      }
      const double err = std::fabs(y[i * n + j] - sum) / (size + 1e-30);
      if (!(err <= 2e-6)) {  // float32 sums of k terms, relative to the terms' magnitudes (and NaN: a row not written)
        std::printf("FAIL m=%ld n=%ld k=%ld ld=%ld %s: y[%ld][%ld] = %.9g, float64 %.9g\n", (long)m, (long)n, (long)k,
                    (long)ld, f32 ? "float32" : "bfloat16", (long)i, (long)j, y[i * n + j], sum);
        return false;
      }
      worst = std::fmax(worst, err);
    }
  // a row's result does not depend on the rows beside it: the last row alone gives the same bits
  const int64_t last = m - 1;
  mla_amx_linear_bf16(f32 ? xf.data() + last * ld : nullptr, f32 ? nullptr : xb.data() + last * ld, k,
                      packed.data(), one.data(), 1, n, k, threads);
  if (std::memcmp(one.data(), y.data() + last * n, n * 4) != 0) {
    std::printf("FAIL m=%ld n=%ld k=%ld: row %ld alone differs from the same row among %ld\n", (long)m, (long)n,
                (long)k, (long)last, (long)m);
    return false;
  }
  std::printf("ok m=%ld n=%ld k=%ld ld=%ld %s threads=%d: worst error %.2g of the terms' magnitudes\n", (long)m,
              (long)n, (long)k, (long)ld, f32 ? "float32" : "bfloat16", threads, worst);
  return true;
}

int main() {
#if !(defined(__x86_64__) && defined(__linux__) && (__GNUC__ >= 11 || defined(__clang__)))
  std::puts("unsupported: amx_bf16.c compiles its tiles only on x86-64 Linux with GCC 11+ or clang");
  return 3;
#endif
  std::mt19937 gen(5);
  struct Case {
    int64_t m, n, k, ld;
    bool f32;
    int threads;
  };
  const Case cases[] = {
      {1, 80, 96, 96, true, 1},       // one row; five blocks of 16 columns (the last pair has one)
      {9, 80, 96, 100, true, 2},      // float32 rows with a stride: rounded into the thread's buffer
      {16, 32, 64, 64, false, 1},     // one full row tile, bfloat16 rows read in place
      {17, 48, 96, 128, false, 2},    // 16 + 1 rows; bfloat16 rows gathered from a stride
      {31, 64, 32, 32, true, 2},      // 16 + 15 rows, K one tile
      {32, 80, 128, 128, false, 2},   // two full row tiles
      {33, 80, 96, 96, true, 2},      // past 32 rows: a second pass under each pair of blocks
      {128, 96, 256, 256, true, 2},   // the most rows the callers give the tiles (AMX_MAX_ROWS)
  };
  for (const Case& c : cases)
    if (!check(c.m, c.n, c.k, c.ld, c.f32, c.threads, gen)) return 1;
  return 0;
}
