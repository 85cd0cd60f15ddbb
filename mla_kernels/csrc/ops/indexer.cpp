// The lightning indexer's scores over the paged indexer-key cache, as a typed torch operator:
//
//   mla_kernels::indexer_scores(q [T, H, D] f32, weights [T, H] f32, cache [N, B, D], scales [N, B, G]?,
//                               block_tables [R, M] i32, req_indices [T], key_lens [T], max_len) -> [T, max_len] f32
//
//   score[t, j] = sum_h weights[t, h] * relu(q[t, h] . k_j)   for j < key_lens[t], -inf past it
//
// k_j is read where the block table puts it (block_tables[req_indices[t], j / B], slot j % B) and widened to
// float32 on the fly: float32, bfloat16 and float16 keys, or float8_e4m3fn keys times their per-128 scale. Only
// positions below a row's key_len are read, so unused slots and pages may hold anything.
//
// Work is split into (row, tile of positions) pieces over torch's thread pool. A piece copies its tile of keys
// into a transposed float32 block [D][tile] and accumulates four heads at a time against it: for each of the D values,
// one tile-wide load and four multiply-adds with broadcast query values. The tile function is compiled for
// x86-64-v4 (AVX-512, tiles of 32 positions), x86-64-v3 (AVX2 + FMA, tiles of 16) and the baseline; "auto" runs
// the widest the CPU executes, and mla_kernels::cpu_variants() lists them (tests run each one the CPU executes).
// With AVX512-BF16, bfloat16 keys meet a row's queries in VDPBF16PS dot products when every query value of the row
// is a bfloat16 value (a bfloat16 model's are): each product is then exact in float32, as on the float32 path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <algorithm>
#include <limits>
#include <vector>

#include "../isa_cap.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t SCALE_GROUP = 128;  // fp8 keys: values sharing one scale
constexpr int64_t MAX_D = 1024;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint16_t bits;
  std::memcpy(&bits, &x, 2);
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

// acc[j] = sum_h w[h] relu(q[h] . kt[:, j]) for one tile: q [H, D] row-major, kt [D, TILE]. Four heads at a time:
// with TILE a multiple of the vector width that is 4 * TILE / width independent accumulators (8 on AVX-512 with
// TILE 32, 8 on AVX2 with TILE 16), enough to keep two FMA pipes busy.
template <int64_t TILE>
inline __attribute__((always_inline)) void score_tile(const float* __restrict q, const float* __restrict w,
                                                      const float* __restrict kt, int64_t heads, int64_t d,
                                                      float* __restrict acc) {
  for (int64_t j = 0; j < TILE; ++j) acc[j] = 0.0f;
  int64_t h = 0;
  for (; h + 4 <= heads; h += 4) {
    const float* q0 = q + h * d;
    const float* q1 = q0 + d;
    const float* q2 = q1 + d;
    const float* q3 = q2 + d;
    float l0[TILE] = {}, l1[TILE] = {}, l2[TILE] = {}, l3[TILE] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float* k = kt + i * TILE;
      const float a0 = q0[i], a1 = q1[i], a2 = q2[i], a3 = q3[i];
      for (int64_t j = 0; j < TILE; ++j) {
        l0[j] += a0 * k[j];
        l1[j] += a1 * k[j];
        l2[j] += a2 * k[j];
        l3[j] += a3 * k[j];
      }
    }
    const float w0 = w[h], w1 = w[h + 1], w2 = w[h + 2], w3 = w[h + 3];
    for (int64_t j = 0; j < TILE; ++j) {
      acc[j] += w0 * (l0[j] > 0.0f ? l0[j] : 0.0f) + w1 * (l1[j] > 0.0f ? l1[j] : 0.0f) +
                w2 * (l2[j] > 0.0f ? l2[j] : 0.0f) + w3 * (l3[j] > 0.0f ? l3[j] : 0.0f);
    }
  }
  for (; h < heads; ++h) {
    const float* qh = q + h * d;
    float l[TILE] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float* k = kt + i * TILE;
      const float a = qh[i];
      for (int64_t j = 0; j < TILE; ++j) l[j] += a * k[j];
    }
    for (int64_t j = 0; j < TILE; ++j) acc[j] += w[h] * (l[j] > 0.0f ? l[j] : 0.0f);
  }
}

using TileFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, float*);
// bfloat16 keys against bfloat16-exact queries: qp [H, D / 2] and kt [D / 2, 32] pairs of bfloat16 (one uint32 each)
using PairTileFn = void (*)(const uint32_t*, const float*, const uint32_t*, int64_t, int64_t, float*);
constexpr int64_t PAIR_TILE = 32;

struct Variant {
  const char* name;
  int64_t tile;
  TileFn fn;
  bool runs;  // the CPU executes it
  int64_t level;  // its instruction-set level (isa_cap.h): it runs only where the process's cap allows it
  PairTileFn pairs = nullptr;  // bfloat16 dot products (AVX512-BF16), for bfloat16 keys and bfloat16-exact queries

  bool allowed() const { return runs && mla_isa_allows(level); }
};

#if defined(__x86_64__) && defined(__GNUC__)
#define MLA_TARGET(isa) __attribute__((target(isa)))
MLA_TARGET("arch=x86-64-v4")
void tile_avx512(const float* q, const float* w, const float* kt, int64_t heads, int64_t d, float* acc) {
  score_tile<32>(q, w, kt, heads, d, acc);
}
// 32 positions of bfloat16 keys with VDPBF16PS: each instruction adds, for 16 keys, the products of one pair of
// dimensions. A bfloat16 value times a bfloat16 value is exact in float32, so with queries that are bfloat16 values
// (a bfloat16 model's always are) this differs from the float32 path only in the order of the sums.
MLA_TARGET("arch=x86-64-v4,avx512bf16")
void tile_avx512_bf16(const uint32_t* qp, const float* w, const uint32_t* kt, int64_t heads, int64_t d2, float* acc) {
  for (int64_t j = 0; j < PAIR_TILE; ++j) acc[j] = 0.0f;
  const __m512 zero = _mm512_setzero_ps();
  int64_t h = 0;
  for (; h < heads; h += 4) {
    const int64_t nh = std::min<int64_t>(4, heads - h);
    __m512 lo[4] = {zero, zero, zero, zero}, hi[4] = {zero, zero, zero, zero};
    for (int64_t p = 0; p < d2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * PAIR_TILE);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * PAIR_TILE + 16);
      for (int64_t i = 0; i < nh; ++i) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[(h + i) * d2 + p]));
        lo[i] = _mm512_dpbf16_ps(lo[i], k0, qb);
        hi[i] = _mm512_dpbf16_ps(hi[i], k1, qb);
      }
    }
    __m512 a0 = _mm512_loadu_ps(acc), a1 = _mm512_loadu_ps(acc + 16);
    for (int64_t i = 0; i < nh; ++i) {
      const __m512 wi = _mm512_set1_ps(w[h + i]);
      a0 = _mm512_fmadd_ps(wi, _mm512_max_ps(lo[i], zero), a0);
      a1 = _mm512_fmadd_ps(wi, _mm512_max_ps(hi[i], zero), a1);
    }
    _mm512_storeu_ps(acc, a0);
    _mm512_storeu_ps(acc + 16, a1);
  }
}

MLA_TARGET("arch=x86-64-v3")
void tile_avx2(const float* q, const float* w, const float* kt, int64_t heads, int64_t d, float* acc) {
  score_tile<16>(q, w, kt, heads, d, acc);
}
#endif
void tile_generic(const float* q, const float* w, const float* kt, int64_t heads, int64_t d, float* acc) {
  score_tile<16>(q, w, kt, heads, d, acc);
}

// The variants, widest first: AVX-512 with BF16 dot products for bfloat16 keys (the rest as AVX-512), AVX-512
// (x86-64-v4: F, BW, CD, DQ, VL), AVX2 + FMA (x86-64-v3), and the build's baseline (AVX2 on x86-64, NEON on aarch64).
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = [] {
    std::vector<Variant> v;
#if defined(__x86_64__) && defined(__GNUC__)
    const bool v4 = mla_cpu_has(MLA_CPU_AVX512), v3 = mla_cpu_has(MLA_CPU_AVX2);
    const bool bf16 = mla_cpu_has(MLA_CPU_AVX512 | MLA_CPU_BF16);
    v.push_back({"avx512_bf16", 32, &tile_avx512, bf16, MLA_ISA_AVX512, &tile_avx512_bf16});
    v.push_back({"avx512", 32, &tile_avx512, v4, MLA_ISA_AVX512});
    v.push_back({"avx2", 16, &tile_avx2, v3, MLA_ISA_AVX2});
#endif
    v.push_back({"generic", 16, &tile_generic, true, MLA_ISA_BASE});
    return v;
  }();
  return all;
}

const Variant& pick(const std::string& name) {
  for (const Variant& v : variants()) {
    if (name == "auto" ? v.allowed() : name == v.name) {
      TORCH_CHECK(v.runs, "indexer_scores: this CPU cannot run the ", v.name, " variant");
      TORCH_CHECK(v.allowed(), "indexer_scores: this process (capped by MLA_CPU_ISA) cannot run the ", v.name,
                  " variant");
      return v;
    }
  }
  TORCH_CHECK(false, "indexer_scores: unknown variant '", name, "' (see mla_kernels::cpu_variants)");
}

// The variants this library holds, each "name:runs", "name:cannot run here" or "name:above the ISA cap".
std::vector<std::string> cpu_variants() {
  std::vector<std::string> out;
  for (const Variant& v : variants())
    out.push_back(std::string(v.name) + (v.allowed() ? ":runs" : v.runs ? ":above the ISA cap" : ":cannot run here"));
  return out;
}

template <typename K>
void score_rows(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                const c10::optional<at::Tensor>& scales, const at::Tensor& block_tables, const int64_t* req,
                const int64_t* lens, at::Tensor& out, const Variant& variant) {
  const int64_t TILE = variant.tile;
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t num_blocks = cache.size(0), block_size = cache.size(1);
  const int64_t max_len = out.size(1), tiles = (max_len + TILE - 1) / TILE;
  const int64_t groups = scales.has_value() ? scales->size(2) : 0;
  const float* qp = q.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  const K* cp = cache.data_ptr<K>();
  const float* sp = scales.has_value() ? scales->data_ptr<float>() : nullptr;
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0), bt_width = block_tables.size(1);
  float* op = out.data_ptr<float>();

  // rows whose queries are all bfloat16 values take the variant's bfloat16 dot products (bfloat16 keys only)
  std::vector<uint32_t> qpairs;
  std::vector<char> paired(static_cast<size_t>(rows), 0);
  const int64_t d2 = (d + 1) / 2;
  if (std::is_same<K, c10::BFloat16>::value && variant.pairs != nullptr && TILE == PAIR_TILE) {
    qpairs.assign(static_cast<size_t>(rows * heads * d2), 0);
    for (int64_t t = 0; t < rows; ++t) {
      bool exact = true;
      for (int64_t i = 0; i < heads * d && exact; ++i) {
        uint32_t bits;
        std::memcpy(&bits, qp + t * heads * d + i, 4);
        exact = (bits & 0xffffu) == 0;
      }
      if (!exact) continue;
      paired[t] = 1;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < d; ++i) {
          uint32_t bits;
          std::memcpy(&bits, qp + (t * heads + h) * d + i, 4);
          qpairs[(t * heads + h) * d2 + i / 2] |= (bits >> 16) << (16 * (i % 2));
        }
    }
  }

  // the cache row holding position pos of block-table row r (checked: never read outside the cache)
  auto key_of = [&](int64_t t, int64_t pos) -> const K* {
    const int64_t col = pos / block_size;
    TORCH_CHECK(col < bt_width, "indexer_scores: key_len ", lens[t], " is beyond the block table's ", bt_width,
                " blocks");
    const int64_t blk = bt[req[t] * bt_stride + col];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "indexer_scores: block id ", blk, " of block-table row ", req[t],
                " is outside the cache's ", num_blocks, " blocks");
    return cp + (blk * block_size + pos % block_size) * d;
  };

  at::parallel_for(0, rows * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> ktp(static_cast<size_t>(d2 * PAIR_TILE));
    std::vector<float> kt(static_cast<size_t>(d * TILE));
    std::vector<float> acc(static_cast<size_t>(TILE));
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t t = piece / tiles, p0 = (piece % tiles) * TILE;
      const int64_t n = std::min(TILE, lens[t] - p0);
      if (n <= 0) continue;
      if (paired[t]) {  // bfloat16 keys copied as pairs along the dimension, [D / 2][32]
        std::fill(ktp.begin(), ktp.end(), 0u);
        for (int64_t j = 0; j < n; ++j) {
          const uint16_t* key = reinterpret_cast<const uint16_t*>(key_of(t, p0 + j));
          for (int64_t i = 0; i < d; ++i) ktp[(i / 2) * PAIR_TILE + j] |= static_cast<uint32_t>(key[i]) << (16 * (i % 2));
        }
        variant.pairs(qpairs.data() + t * heads * d2, wp + t * heads, ktp.data(), heads, d2, acc.data());
        std::memcpy(op + t * max_len + p0, acc.data(), static_cast<size_t>(n) * sizeof(float));
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        const K* key = key_of(t, p0 + j);
        const int64_t slot = (key - cp) / d;
        if (sp != nullptr) {
          const float* s = sp + slot * groups;
          for (int64_t i = 0; i < d; ++i) kt[i * TILE + j] = widen(key[i]) * s[i / SCALE_GROUP];
        } else {
          for (int64_t i = 0; i < d; ++i) kt[i * TILE + j] = widen(key[i]);
        }
      }
      for (int64_t j = n; j < TILE; ++j)
        for (int64_t i = 0; i < d; ++i) kt[i * TILE + j] = 0.0f;
      variant.fn(qp + t * heads * d, wp + t * heads, kt.data(), heads, d, acc.data());
      std::memcpy(op + t * max_len + p0, acc.data(), static_cast<size_t>(n) * sizeof(float));
    }
  });
}

at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& cache,
                          const c10::optional<at::Tensor>& scales, const at::Tensor& block_tables,
                          const at::Tensor& req_indices, const at::Tensor& key_lens, int64_t max_len,
                          c10::string_view variant) {
  const Variant& v = pick(std::string(variant));
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "indexer_scores: q must be float32 [T, H, D]");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(d >= 1 && d <= MAX_D, "indexer_scores: key width ", d, " outside 1..", MAX_D);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 2 && weights.size(0) == rows &&
                  weights.size(1) == heads,
              "indexer_scores: weights must be float32 [T, H]");
  TORCH_CHECK(cache.dim() == 3 && cache.size(2) == d, "indexer_scores: cache must be [N, B, D] with D = q's");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt,
              "indexer_scores: block_tables must be int32 [R, M]");
  TORCH_CHECK(req_indices.numel() == rows && key_lens.numel() == rows,
              "indexer_scores: req_indices and key_lens need one value per query row");
  TORCH_CHECK(max_len >= 0, "indexer_scores: max_len must be >= 0");
  const bool fp8 = cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == scales.has_value(), "indexer_scores: scales go with a float8_e4m3fn cache, and only with it");
  if (fp8) {
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->dim() == 3 && scales->size(0) == cache.size(0) &&
                    scales->size(1) == cache.size(1) && scales->size(2) == (d + SCALE_GROUP - 1) / SCALE_GROUP,
                "indexer_scores: scales must be float32 [N, B, ceil(D / 128)]");
  }
  for (const at::Tensor* t : {&q, &weights, &cache, &block_tables, &req_indices, &key_lens})
    TORCH_CHECK(t->device().is_cpu(), "indexer_scores: CPU tensors only (CUDA takes the Triton kernel)");

  const at::Tensor qc = q.contiguous(), wc = weights.contiguous(), cc = cache.contiguous();
  const at::Tensor bt = block_tables.contiguous();
  const at::Tensor req = req_indices.to(at::kLong).contiguous(), lens = key_lens.to(at::kLong).contiguous();
  const int64_t* rp = req.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(rp[t] >= 0 && rp[t] < bt.size(0), "indexer_scores: req_indices[", t, "] = ", rp[t],
                " is not a block-table row");
    TORCH_CHECK(lp[t] >= 0 && lp[t] <= max_len, "indexer_scores: key_lens[", t, "] = ", lp[t], " outside 0..",
                max_len);
  }
  at::Tensor out = at::full({rows, max_len}, -std::numeric_limits<float>::infinity(), q.options());
  if (rows == 0 || max_len == 0) return out;
  const c10::optional<at::Tensor> sc = fp8 ? c10::optional<at::Tensor>(scales->contiguous()) : c10::nullopt;
  switch (cache.scalar_type()) {
    case at::kFloat: score_rows<float>(qc, wc, cc, sc, bt, rp, lp, out, v); break;
    case at::kBFloat16: score_rows<c10::BFloat16>(qc, wc, cc, sc, bt, rp, lp, out, v); break;
    case at::kHalf: score_rows<c10::Half>(qc, wc, cc, sc, bt, rp, lp, out, v); break;
    case at::kFloat8_e4m3fn: score_rows<c10::Float8_e4m3fn>(qc, wc, cc, sc, bt, rp, lp, out, v); break;
    default: TORCH_CHECK(false, "indexer_scores: unsupported cache dtype ", cache.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mla_kernels, m) {
  m.def("indexer_scores(Tensor q, Tensor weights, Tensor cache, Tensor? scales, Tensor block_tables, "
        "Tensor req_indices, Tensor key_lens, int max_len, str variant=\"auto\") -> Tensor");
  m.def("cpu_variants() -> str[]", &cpu_variants);
}

TORCH_LIBRARY_IMPL(mla_kernels, CPU, m) { m.impl("indexer_scores", &indexer_scores); }
