// The compiled CPU kernels (../mla_cpu.h) as typed torch operators, mla_kernels::<name>.
//
// Each operator takes tensors, reads every size from them, refuses (ValueError) what its tensors do not hold (a
// dtype, a shape, a cache slot past the cache's rows), allocates its output and scratch, and runs the kernel on
// torch's thread pool. Callers hand over tensors and get tensors back; nothing is trusted.
//
// The table-driven kernels (a gated MLP or MoE row, the whole decoder layer) read int64 tables of pointers and sizes
// whose layout ../mla_cpu.h defines. They are held by custom classes (MlpTable, LayerTable, DecodeStep) built here
// from typed arguments, checked once when built; each keeps the tensors it points into alive, so a table can never
// outlive its weights, and no other file knows a layout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "../mla_cpu.h"

namespace {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

template <typename T>
T* ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
T* ptr(const OptTensor& t) {
  return t.has_value() ? ptr<T>(*t) : nullptr;
}

int64_t address(const Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())); }
int64_t address(const OptTensor& t) { return t.has_value() ? address(*t) : 0; }
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t threads() { return at::get_num_threads(); }

// t is a contiguous CPU tensor of this dtype and shape.
void expect(const Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(), op,
                    ": ", name, " must be a contiguous CPU ", dtype, " tensor ", shape, ", got ", t.scalar_type(),
                    " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

// A latent cache [S, width]: a contiguous CPU float32, bfloat16, float16, int8 or float8_e4m3fn matrix, the last two
// with their scales [S, 2] float32 (and only they); returns its CacheKind.
int64_t expect_cache(const Tensor& cache, const OptTensor& scales, int64_t width, const char* op) {
  const at::ScalarType t = cache.scalar_type();
  TORCH_CHECK_VALUE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kChar ||
                        t == at::kFloat8_e4m3fn,
                    op, ": cache must be a float32, bfloat16, float16, int8 or float8_e4m3fn tensor, got ", t);
  expect(cache, t, {cache.size(0), width}, op, "cache");
  const bool quantised = t == at::kChar || t == at::kFloat8_e4m3fn;
  TORCH_CHECK_VALUE(quantised == scales.has_value(), op, ": ", quantised ? "an int8 or float8_e4m3fn cache comes "
                    "with its scales [S, 2]" : "a float cache has no scales");
  if (scales) expect(*scales, at::kFloat, {cache.size(0), 2}, op, "scales");
  return t == at::kFloat ? C_F32 : t == at::kBFloat16 ? C_BF16 : t == at::kHalf ? C_F16 : t == at::kChar ? C_I8 : C_FP8;
}

// t is a CPU float32 tensor of these sizes whose last dimension is contiguous (other strides free).
void expect_rows(const Tensor& t, at::IntArrayRef shape, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.sizes() == shape &&
                        (t.size(-1) <= 1 || t.stride(-1) == 1),
                    op, ": ", name, " must be float32 CPU rows ", shape, " (last dimension contiguous), got ",
                    t.scalar_type(), " ", t.sizes(), " with strides ", t.strides());
}

// Every key slot a row reads (slots[t, :lens[t]], lens[t] in [1, slots.size(1)]) is a row of a cache of
// `cache_rows`; returns the largest.
int64_t expect_keys(const Tensor& slots, const Tensor& lens, int64_t t, int64_t cache_rows, const char* op) {
  TORCH_CHECK_VALUE(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 2 &&
                        slots.size(0) == t && (slots.size(1) <= 1 || slots.stride(1) == 1),
                    op, ": slots must be int64 CPU rows [", t, ", L], got ", slots.scalar_type(), " ", slots.sizes());
  expect(lens, at::kLong, {t}, op, "lens");
  const int64_t width = slots.size(1), stride = slots.stride(0);
  const int64_t* s = ptr<const int64_t>(slots);
  const int64_t* n = ptr<const int64_t>(lens);
  int64_t largest = -1;
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK_VALUE(n[r] >= 1 && n[r] <= width, op, ": row ", r, " reads ", n[r], " keys of ", width, " slots");
    const auto [lo, hi] = std::minmax_element(s + r * stride, s + r * stride + n[r]);
    TORCH_CHECK_VALUE(*lo >= 0 && *hi < cache_rows, op, ": row ", r, " reads cache slot ",
                      *lo < 0 ? *lo : *hi, ", the cache holds ", cache_rows);
    largest = std::max(largest, *hi);
  }
  return largest;
}

// -- products ------------------------------------------------------------------------------------------------------

// The products' variants, slowest first (bit i of mla_float_variants() / mla_i8_variants() / mla_i4_variants() /
// mla_w8a8_variants()): the few-row float products (float32, bfloat16, float16 weights), the int8 and int4 ones, and
// W8A8's, whose third takes AMX int8 tiles.
const char* const FLOAT_VARIANTS[] = {"avx2", "avx512"};
const char* const QUANT_VARIANTS[] = {"avx2", "avx512_vnni"};
const char* const W8A8_VARIANTS[] = {"avx2", "avx512_vnni", "amx"};

// Variant 1 of each family is AVX-512, variant 2 AMX: above a process capped below them (isa_cap.h).
bool above_cap(int64_t i) {
  return (i == 1 && !mla_isa_allows(MLA_ISA_AVX512)) || (i == 2 && !mla_isa_allows(MLA_ISA_AMX));
}

// "auto" (-1: the fastest this CPU runs) or the index of a variant the CPU runs, of `count` names.
int64_t variant_index(c10::string_view name, int64_t runs, const char* const* names, const char* op,
                      int64_t count = 2) {
  if (name == "auto") return -1;
  for (int64_t i = 0; i < count; ++i) {
    if (name == names[i]) {
      TORCH_CHECK_VALUE(runs >> i & 1, op, ": this ",
                        above_cap(i) ? (i == 1 ? "process (capped at AVX2 by MLA_CPU_ISA)"
                                               : "process (capped below AMX by MLA_CPU_ISA)")
                                     : "CPU",
                        " cannot run the ", names[i], " variant");
      return i;
    }
  }
  std::string known = names[0];
  for (int64_t i = 1; i < count; ++i) known += std::string(", ") + names[i];
  TORCH_CHECK_VALUE(false, op, ": unknown variant '", name, "' (auto, ", known, ")");
  return -1;
}

// The fastest of the variants `runs` holds: the last.
int64_t fastest(int64_t runs) { return runs >> 2 & 1 ? 2 : runs >> 1 & 1 ? 1 : 0; }

bool quantized(at::ScalarType w) { return w == at::kChar || w == at::kByte || w == at::kFloat8_e4m3fn; }

// oneDNN's product of rows x and a weight, plain or in its blocked layout (torch's mkldnn::_linear_pointwise).
Tensor onednn_linear(const Tensor& x, const Tensor& w, const OptTensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<
      Tensor(const Tensor&, const Tensor&, const OptTensor&, c10::string_view, c10::List<c10::optional<at::Scalar>>,
             c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>({c10::nullopt}), "");
}

constexpr int64_t WIDEN_ELEMENTS = 4 << 20;  // a widened product converts about this many weights at a time

// x [..., K]: rows of any floating-point dtype on the CPU (a product computes them in float32), else a ValueError
// naming op.
void check_rows(const Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() >= 1 && at::isFloatingType(x.scalar_type()),
                    op, ": x must be floating-point CPU rows, got ", x.scalar_type(), " ", x.sizes());
}

// A product's float32 output for rows x [..., K]: [..., n].
Tensor rows_out(const Tensor& x, int64_t n) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return at::empty(shape, x.options().dtype(at::kFloat));
}

// x [..., K] (any float dtype, computed in float32) times W [N, K]ᵀ -> float32 [..., N], for every weight format:
// float32, bfloat16 or float16 (1 to MLA_FEW_ROWS rows; half weights read at two bytes and widened exactly); int8
// with float32 row scales [N] (rows rounded to int16); float8_e4m3fn with float32 block scales [ceil(N / bn),
// ceil(K / bk)] and block = [bn, bk] (past MLA_QUANT_ROWS rows oneDNN's float32 product of the weight widened a
// block of rows at a time); group-wise int4: uint8 nibbles [N, Kp / 2] with float16 scales [N, Kp / 32]
// (Kp: K rounded up to 32; rows rounded to int8 per group of 32). Quantized formats take any number of rows,
// MLA_QUANT_ROWS a kernel call. Within a variant a row's result does not depend on the other rows; the int8 and int4
// variants give the same bits, the float ones each sum in their own order ("auto": AVX-512 for float32 weights from
// four rows on, where the CPU has it).
Tensor linear(const Tensor& x, const Tensor& w, const OptTensor& scales, at::IntArrayRef block,
              c10::string_view variant) {
  const char* op = "linear";
  const at::ScalarType dtype = w.scalar_type();
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(),
                    "linear: the weight must be a contiguous CPU matrix, got ", w.sizes());
  check_rows(x, op);
  const int64_t n = w.size(0), k = x.size(-1), rows = k ? x.numel() / k : 0;
  TORCH_CHECK_VALUE(k >= 1 && rows >= 1 && (quantized(dtype) || rows <= MLA_FEW_ROWS), "linear: 1 to ",
                    MLA_FEW_ROWS, " rows with a ", dtype, " weight, got x ", x.sizes());
  TORCH_CHECK_VALUE(scales.has_value() == quantized(dtype), "linear: int8, FP8 and int4 weights come with scales, ",
                    "the others without (weight ", dtype, ")");
  TORCH_CHECK_VALUE(block.empty() == (dtype != at::kFloat8_e4m3fn), "linear: FP8 weights (and only they) take their ",
                    "block [bn, bk]");
  const int64_t width = dtype == at::kByte ? cdiv(k, 32) * 16 : k;  // int4: two values a byte, K padded to 32
  TORCH_CHECK_VALUE(w.size(1) == width, "linear: rows of ", k, " values do not fit a ", dtype, " weight ", w.sizes());
  const Tensor xs = x.to(at::kFloat).contiguous();
  Tensor y = rows_out(x, n);
  const float* xp = ptr<const float>(xs);
  float* yp = ptr<float>(y);
  // quantized weights: MLA_QUANT_ROWS rows a call (each row's result is the same in any call)
  auto chunks = [&](auto&& call) {
    for (int64_t r0 = 0; r0 < rows; r0 += MLA_QUANT_ROWS)
      call(xp + r0 * k, yp + r0 * n, std::min<int64_t>(MLA_QUANT_ROWS, rows - r0));
  };
  switch (dtype) {
    case at::kFloat: {
      expect(w, dtype, {n, k}, op, "the weight");
      const int64_t v = variant_index(variant, mla_float_variants(), FLOAT_VARIANTS, op);
      rows == 1 && v < 0 ? mla_gemv_f32(ptr<const float>(w), xp, yp, n, k, threads())
                         : mla_gemm_few_f32(ptr<const float>(w), xp, yp, rows, n, k, threads(), v);
      break;
    }
    case at::kBFloat16:
    case at::kHalf: {
      expect(w, dtype, {n, k}, op, "the weight");
      const int64_t kind = dtype == at::kBFloat16 ? W_BF16 : W_F16;
      const int64_t v = variant_index(variant, mla_float_variants(), FLOAT_VARIANTS, op);
      rows == 1 && v < 0 ? mla_gemv_half(ptr<const uint16_t>(w), kind, xp, yp, n, k, threads())
                         : mla_gemm_few_half(ptr<const uint16_t>(w), kind, xp, yp, rows, n, k, threads(), v);
      break;
    }
    case at::kChar: {
      expect(w, dtype, {n, k}, op, "the weight");
      expect(*scales, at::kFloat, {n}, op, "the row scales");
      const int64_t v = variant_index(variant, mla_i8_variants(), QUANT_VARIANTS, op);
      if (rows == 1 && v < 0) {
        mla_gemv_i8(ptr<const int8_t>(w), ptr<const float>(scales), xp, yp, n, k, threads());
        break;
      }
      chunks([&](const float* xc, float* yc, int64_t m) {
        mla_gemm_few_i8(ptr<const int8_t>(w), ptr<const float>(scales), xc, yc, m, n, k, threads(), v);
      });
      break;
    }
    case at::kFloat8_e4m3fn: {
      TORCH_CHECK_VALUE(block.size() == 2 && block[0] >= 1 && block[1] >= 1, "linear: an FP8 block is [bn, bk], got ",
                        block);
      expect(w, dtype, {n, k}, op, "the weight");
      expect(*scales, at::kFloat, {cdiv(n, block[0]), cdiv(k, block[1])}, op, "the block scales");
      if (rows > MLA_QUANT_ROWS) {  // many rows: the weight widened a block of rows at a time, oneDNN's product
        const int64_t bn = block[0], bk = block[1], step = std::max<int64_t>(1, WIDEN_ELEMENTS / k / bn) * bn;
        const Tensor x2 = xs.reshape({rows, k});
        for (int64_t r0 = 0; r0 < n; r0 += step) {
          const int64_t len = std::min(step, n - r0);
          const Tensor s = scales->narrow(0, r0 / bn, cdiv(len, bn)).repeat_interleave(bn, 0).narrow(0, 0, len);
          const Tensor wf = w.narrow(0, r0, len).to(at::kFloat).mul_(s.repeat_interleave(bk, 1).narrow(1, 0, k));
          y.view({rows, n}).narrow(1, r0, len).copy_(onednn_linear(x2, wf, c10::nullopt));
        }
        break;
      }
      chunks([&](const float* xc, float* yc, int64_t m) {
        mla_gemm_fp8(ptr<const uint8_t>(w), ptr<const float>(scales), block[0], block[1], xc, yc, m, n, k, threads());
      });
      break;
    }
    case at::kByte: {
      const int64_t kp = cdiv(k, 32) * 32;
      expect(w, dtype, {n, kp / 2}, op, "the int4 nibbles");
      expect(*scales, at::kHalf, {n, kp / 32}, op, "the int4 group scales");
      const int64_t runs = mla_i4_variants();
      TORCH_CHECK_VALUE(runs != 0, "linear: no int4 variant runs on this CPU");
      const int64_t v = variant_index(variant, runs, QUANT_VARIANTS, op);
      chunks([&](const float* xc, float* yc, int64_t m) {
        mla_gemm_i4(ptr<const uint8_t>(w), ptr<const uint16_t>(scales), xc, yc, m, n, k, threads(),
                    v < 0 ? fastest(runs) : v);
      });
      break;
    }
    default:
      TORCH_CHECK_VALUE(false, "linear: weights are float32, bfloat16, float16, int8, float8_e4m3fn or packed int4 ",
                        "(uint8), got ", dtype);
  }
  return y;
}

// x [..., K] (any float dtype, computed in float32) times a group-wise int4 W [N, K]ᵀ -> float32 [..., N]: uint8 nibbles
// [N, Kp / 2] (Kp: K rounded up to 32), float16 scales [N, Kp / group] for group 32, 64 or 128 (K a multiple of the
// group where it is over 32) and, for asymmetric groups, uint8 zero points [N, Kp / group] in [0, 16] (none: 8).
// linear's int4 product with these layouts; the same bits as linear where group is 32 and the zeros are 8.
Tensor linear_int4(const Tensor& x, const Tensor& w, const Tensor& scales, const OptTensor& zeros, int64_t group,
                   c10::string_view variant) {
  const char* op = "linear_int4";
  TORCH_CHECK_VALUE(group == 32 || group == 64 || group == 128, op, ": groups of 32, 64 or 128 values, got ", group);
  check_rows(x, op);
  const int64_t n = w.dim() == 2 ? w.size(0) : 0, k = x.size(-1), rows = k ? x.numel() / k : 0;
  TORCH_CHECK_VALUE(k >= 1 && rows >= 1, op, ": x holds no rows, got ", x.sizes());
  TORCH_CHECK_VALUE(group == 32 || k % group == 0, op, ": rows of ", k, " values are not whole groups of ", group);
  const int64_t kp = cdiv(k, 32) * 32;
  expect(w, at::kByte, {n, kp / 2}, op, "the int4 nibbles");
  expect(scales, at::kHalf, {n, cdiv(kp, group)}, op, "the int4 group scales");
  if (zeros) expect(*zeros, at::kByte, {n, cdiv(kp, group)}, op, "the int4 zero points");
  const int64_t runs = mla_i4_variants();
  TORCH_CHECK_VALUE(runs != 0, op, ": no int4 variant runs on this CPU");
  const int64_t v = variant_index(variant, runs, QUANT_VARIANTS, op);
  const Tensor xs = x.to(at::kFloat).contiguous();
  Tensor y = rows_out(x, n);
  const uint8_t* zp = zeros ? ptr<const uint8_t>(*zeros) : nullptr;
  for (int64_t r0 = 0; r0 < rows; r0 += MLA_QUANT_ROWS)
    mla_gemm_i4_groups(ptr<const uint8_t>(w), ptr<const uint16_t>(scales), zp, group, ptr<const float>(xs) + r0 * k,
                       ptr<float>(y) + r0 * n, std::min<int64_t>(MLA_QUANT_ROWS, rows - r0), n, k, threads(),
                       v < 0 ? fastest(runs) : v);
  return y;
}

// A part of a ggml matrix in type `type`, `rows` rows from row `first` with row stride `stride`: a repacked Q4_K
// part (MLA_GG_Q4_K_R8) is whole groups of eight rows from a multiple of 8, back to back.
bool gg_part_whole(int64_t type, int64_t first, int64_t rows, int64_t stride, int64_t row_bytes) {
  return type != MLA_GG_Q4_K_R8 || (first % 8 == 0 && rows % 8 == 0 && stride == row_bytes);
}

// x [..., K] (any float dtype, computed in float32) times W [N, K]ᵀ -> float32 [..., N], W in a ggml block type as a
// GGUF file stores it: uint8 [N, K / B x size] (rows may lie apart) for type (ggml's number) Q8_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
// Q5_K or Q6_K (../gemv_ggml.c); rows rounded to int8 per group of 32. Any number of rows, MLA_QUANT_ROWS a kernel
// call; the variants give the same bits, and a row's result does not depend on the other rows.
Tensor ggml_linear(const Tensor& x, const Tensor& w, int64_t type, c10::string_view variant) {
  const char* op = "ggml_linear";
  check_rows(x, op);
  const int64_t n = w.dim() == 2 ? w.size(0) : 0, k = x.size(-1), rows = k ? x.numel() / k : 0;
  const int64_t row_bytes = mla_ggml_row_bytes(type, k);
  TORCH_CHECK_VALUE(row_bytes > 0, op, ": no kernel reads ggml type ", type, " in rows of ", k, " values");
  // rows back to back or apart (a rank's columns of a mapped file: each row's bytes contiguous)
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.size(1) == row_bytes &&
                        w.stride(1) == 1 && w.stride(0) >= row_bytes,
                    op, ": the weight's blocks must be CPU uint8 rows [N, ", row_bytes, "] (each row contiguous), got ",
                    w.scalar_type(), " ", w.sizes(), " with strides ", w.strides());
  TORCH_CHECK_VALUE(n >= 1 && rows >= 1, op, ": empty operands, x ", x.sizes(), " and weight ", w.sizes());
  TORCH_CHECK_VALUE(gg_part_whole(type, 0, n, w.stride(0), row_bytes), op,
                    ": a repacked Q4_K weight is whole groups of 8 rows, back to back; got ", w.sizes());
  const int64_t runs = mla_ggml_variants();
  TORCH_CHECK_VALUE(runs != 0, op, ": no variant runs on this CPU");
  const int64_t v = variant_index(variant, runs, QUANT_VARIANTS, op);
  const Tensor xs = x.to(at::kFloat).contiguous();
  Tensor y = rows_out(x, n);
  for (int64_t r0 = 0; r0 < rows; r0 += MLA_QUANT_ROWS)
    mla_gemm_ggml(type, ptr<const uint8_t>(w), w.stride(0), ptr<const float>(xs) + r0 * k, ptr<float>(y) + r0 * n,
                  std::min<int64_t>(MLA_QUANT_ROWS, rows - r0), n, k, threads(), v < 0 ? fastest(runs) : v);
  return y;
}

// The parts table (../mla_cpu.h, GG_HEAD) of a matrix [sum of the parts' rows, k] stacked from parts in ggml block
// types (types[i]: ggml's number), each as ggml_linear takes its weight. The table holds the parts' addresses: whoever
// holds it keeps the parts.
Tensor ggml_parts(at::TensorList parts, at::IntArrayRef types, int64_t k) {
  const char* op = "ggml_parts";
  const int64_t np = static_cast<int64_t>(parts.size());
  TORCH_CHECK_VALUE(np >= 1 && np <= GG_MAX_PARTS && static_cast<int64_t>(types.size()) == np, op,
                    ": 1 to ", GG_MAX_PARTS, " parts, one type each; got ", np, " parts and ", types.size(), " types");
  Tensor table = at::empty({GG_HEAD + np * GG_PART_FIELDS}, at::kLong);
  int64_t* t = table.data_ptr<int64_t>();
  int64_t n = 0;
  for (int64_t p = 0; p < np; ++p) {
    const Tensor& w = parts[p];
    const int64_t row_bytes = mla_ggml_row_bytes(types[p], k);
    TORCH_CHECK_VALUE(row_bytes > 0, op, ": no kernel reads ggml type ", types[p], " in rows of ", k, " values");
    TORCH_CHECK_VALUE(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.size(0) >= 1 &&
                          w.size(1) == row_bytes && w.stride(1) == 1 && w.stride(0) >= row_bytes,
                      op, ": part ", p, " must be CPU uint8 rows [N, ", row_bytes, "] (each row contiguous), got ",
                      w.scalar_type(), " ", w.sizes(), " with strides ", w.strides());
    TORCH_CHECK_VALUE(gg_part_whole(types[p], n, w.size(0), w.stride(0), row_bytes), op, ": part ", p,
                      " (repacked Q4_K) must be whole groups of 8 rows from a multiple of 8, back to back");
    int64_t* f = t + GG_HEAD + p * GG_PART_FIELDS;
    f[0] = types[p];
    f[1] = address(w);
    f[2] = w.stride(0);
    f[3] = w.size(0);
    n += w.size(0);
  }
  t[0] = np;
  t[1] = n;
  t[2] = k;
  return table;
}

// Q4_K rows w [N, K / 256 x 144] (N a multiple of 8, each row contiguous) repacked for the kernels: uint8
// [N, K / 256 x 148] in type MLA_GG_Q4_K_R8 (../gemv_ggml.c), the same values eight rows interleaved.
Tensor ggml_repack(const Tensor& w, int64_t k) {
  const char* op = "ggml_repack";
  const int64_t q4_k = 12;  // ggml's number for Q4_K
  const int64_t from = mla_ggml_row_bytes(q4_k, k), to = mla_ggml_row_bytes(MLA_GG_Q4_K_R8, k);
  TORCH_CHECK_VALUE(from > 0, op, ": Q4_K rows of ", k, " values are not whole super-blocks of 256");
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.size(0) % 8 == 0 &&
                        w.size(0) >= 8 && w.size(1) == from && w.stride(1) == 1 && w.stride(0) >= from,
                    op, ": Q4_K rows must be CPU uint8 [N, ", from, "], N a multiple of 8, each row contiguous; got ",
                    w.scalar_type(), " ", w.sizes(), " with strides ", w.strides());
  Tensor out = at::empty({w.size(0), to}, at::kByte);
  mla_ggml_repack_q4_k(ptr<const uint8_t>(w), w.stride(0), w.size(0), k, ptr<uint8_t>(out), threads());
  return out;
}

// The FP4 table (../mla_cpu.h, FP4_FIELDS) of an FP4 matrix w [N, K / 2] as fp4_linear takes it (its K a whole number
// of groups: no padding): the scales operand of the tables' W_FP4 operand (w, this table). The table holds the
// scales' addresses: whoever holds it keeps them.
Tensor fp4_table(const Tensor& w, const Tensor& scales, const OptTensor& global) {
  const char* op = "fp4_table";
  const bool mx = scales.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE(mx || scales.scalar_type() == at::kFloat8_e4m3fn, op, ": scales are uint8 (MXFP4) or ",
                    "float8_e4m3fn (NVFP4), got ", scales.scalar_type());
  TORCH_CHECK_VALUE(mx != global.has_value(), op, ": NVFP4 scales (and only they) come with global scales [N]");
  const int64_t group = mx ? 32 : 16, n = w.dim() == 2 ? w.size(0) : 0, k = w.dim() == 2 ? 2 * w.size(1) : 0;
  TORCH_CHECK_VALUE(n >= 1 && k >= group && k % group == 0, op, ": the packed weight must be uint8 [N, K / 2] of ",
                    "whole groups of ", group, ", got ", w.scalar_type(), " ", w.sizes());
  expect(w, at::kByte, {n, k / 2}, op, "the packed weight");
  expect(scales, scales.scalar_type(), {n, k / group}, op, "the group scales");
  if (global) expect(*global, at::kFloat, {n}, op, "the global scales");
  Tensor table = at::empty({FP4_FIELDS}, at::kLong);
  int64_t* t = table.data_ptr<int64_t>();
  t[0] = mx ? FP4_MX : FP4_NV;
  t[1] = n;
  t[2] = k;
  t[3] = address(scales);
  t[4] = address(global);
  return table;
}

// The int4 table (../mla_cpu.h, I4G_FIELDS) of a grouped int4 matrix as linear_int4 takes it (nibbles w [N, Kp / 2],
// float16 scales and, for asymmetric groups, uint8 zero points [N, Kp / group], K values a row): the scales operand
// of the tables' W_I4G operand (w, this table). The table holds the scales' and zeros' addresses: whoever holds it
// keeps them.
Tensor int4_table(const Tensor& w, const Tensor& scales, const OptTensor& zeros, int64_t group, int64_t k) {
  const char* op = "int4_table";
  TORCH_CHECK_VALUE(group == 32 || group == 64 || group == 128, op, ": groups of 32, 64 or 128 values, got ", group);
  TORCH_CHECK_VALUE(k >= 1 && (group == 32 || k % group == 0), op, ": rows of ", k, " values are not whole groups of ",
                    group);
  const int64_t n = w.dim() == 2 ? w.size(0) : 0, kp = cdiv(k, 32) * 32;
  TORCH_CHECK_VALUE(n >= 1, op, ": the nibbles must be uint8 [N, ", kp / 2, "], got ", w.sizes());
  expect(w, at::kByte, {n, kp / 2}, op, "the int4 nibbles");
  expect(scales, at::kHalf, {n, cdiv(kp, group)}, op, "the int4 group scales");
  if (zeros) expect(*zeros, at::kByte, {n, cdiv(kp, group)}, op, "the int4 zero points");
  Tensor table = at::empty({I4G_FIELDS}, at::kLong);
  int64_t* t = table.data_ptr<int64_t>();
  t[0] = W_I4G;
  t[1] = n;
  t[2] = k;
  t[3] = address(scales);
  t[4] = address(zeros);
  t[5] = group;
  return table;
}

// compressed-tensors' pack-quantized int4 bytes [N, K / 2] (low nibble first) -> the nibble order linear reads.
Tensor int4_from_stored(const Tensor& stored) {
  TORCH_CHECK_VALUE(stored.device().is_cpu() && stored.scalar_type() == at::kByte && stored.dim() == 2 &&
                        stored.size(1) % 16 == 0,
                    "int4_from_stored: uint8 CPU bytes [N, K / 2] with K a multiple of 32, got ",
                    stored.scalar_type(), " ", stored.sizes());
  const Tensor src = stored.contiguous();
  Tensor out = at::empty_like(src);
  mla_i4_from_stored(ptr<const uint8_t>(src), ptr<uint8_t>(out), src.numel() / 16, threads());
  return out;
}

// A bfloat16 weight [N, K] (N a multiple of 16, K of 32) repacked for amx_linear: [N / 16, K / 32, 16, 32].
Tensor amx_pack(const Tensor& w) {
  const char* op = "amx_pack";
  TORCH_CHECK_VALUE(mla_amx_bf16(), op, ": this CPU (or its kernel) runs no AMX bfloat16 products");
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 2 && w.size(0) % 16 == 0 && w.size(1) % 32 == 0 &&
                        w.size(0) > 0 && w.size(1) > 0,
                    op, ": a CPU matrix [N, K] with N a multiple of 16 and K of 32, got ", w.sizes());
  const int64_t n = w.size(0), k = w.size(1);
  expect(w, at::kBFloat16, {n, k}, op, "the weight");
  Tensor packed = at::empty({n / 16, k / 32, 16, 32}, w.options());
  mla_amx_pack_bf16(ptr<const uint16_t>(w), ptr<uint16_t>(packed), n, k);
  return packed;
}

// x · Wᵀ in float32 for rows x [..., K] (float32, rounded to bfloat16, or bfloat16; the last dimension contiguous)
// and W packed by amx_pack.
Tensor amx_linear(const Tensor& x, const Tensor& packed) {
  const char* op = "amx_linear";
  TORCH_CHECK_VALUE(mla_amx_bf16(), op, ": this CPU (or its kernel) runs no AMX bfloat16 products");
  TORCH_CHECK_VALUE(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32, op,
                    ": the weight as amx_pack gives it, [N / 16, K / 32, 16, 32], got ", packed.sizes());
  const int64_t n = packed.size(0) * 16, k = packed.size(1) * 32;
  expect(packed, at::kBFloat16, {n / 16, k / 32, 16, 32}, op, "the packed weight");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    op, ": float32 or bfloat16 CPU rows of ", k, " values, got ", x.scalar_type(), " ", x.sizes());
  const Tensor rows = x.reshape({-1, k});
  const Tensor xs = rows.stride(1) == 1 && (rows.size(0) == 1 || rows.stride(0) >= k) ? rows : rows.contiguous();
  const int64_t m = xs.size(0), ld = m > 1 ? xs.stride(0) : k;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  Tensor y = at::empty(shape, x.options().dtype(at::kFloat));
  if (m == 0) return y;
  const bool f32 = xs.scalar_type() == at::kFloat;
  mla_amx_linear_bf16(f32 ? ptr<const float>(xs) : nullptr, f32 ? nullptr : ptr<const uint16_t>(xs), ld,
                      ptr<const uint16_t>(packed), ptr<float>(y), m, n, k, threads());
  return y;
}

// x [..., K] · Wᵀ (+ bias) in x's dtype for a float32, bfloat16 or float16 weight prepared once
// (mla_runtime.layers.cpu_gemm.PackedWeight): the count of rows m picks the product. m <= rows[0]: linear above on
// the plain weight; m <= rows[1]: ATen's; m <= rows[2]: amx_linear on `tiles`; more: oneDNN's (ATen's where `onednn`
// is false) on `operand`, the weight prepared for many rows (its blocked layout, or a float32 copy), the rows
// computed in its dtype, one float32 row on the plain weight; with no operand, on the plain weight in x's dtype,
// widened a block of rows at a time where its dtype differs. Bias is added in the wider of the two dtypes.
Tensor dense_linear(const Tensor& x, const Tensor& plain, const OptTensor& operand, const OptTensor& tiles,
                    const OptTensor& bias, at::IntArrayRef rows, bool onednn) {
  TORCH_CHECK_VALUE(rows.size() == 3, "dense_linear: rows are [kernel, aten, tiles], got ", rows);
  TORCH_CHECK_VALUE(plain.dim() == 2 && x.dim() >= 1 && x.size(-1) == plain.size(1) && at::isFloatingType(
                        x.scalar_type()), "dense_linear: rows [..., ", plain.size(-1), "] for a weight ",
                    plain.sizes(), ", got ", x.scalar_type(), " ", x.sizes());
  const int64_t k = x.size(-1), m = k ? x.numel() / k : 0;
  const at::ScalarType out = x.scalar_type();
  auto wide = [&](Tensor y) { return (bias ? y.add_(*bias) : y).to(out); };  // a float32 result
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = plain.size(0);
  if (m == 0) return at::empty(shape, x.options());
  if (m <= rows[0]) return wide(linear(x, plain, c10::nullopt, {}, "auto"));
  if (m <= rows[1]) return at::linear(x, plain, bias);
  if (tiles && m <= rows[2]) return wide(amx_linear(x, *tiles));
  const bool one_row = m == 1 && plain.scalar_type() == at::kFloat && out == at::kFloat;
  const Tensor& w = operand && !one_row ? *operand : plain;
  const at::ScalarType c = operand ? w.scalar_type() : out, sum = at::promote_types(c, out);
  auto product = [&](const Tensor& a, const Tensor& b, const OptTensor& bb) {
    return onednn ? onednn_linear(a, b, bb) : at::linear(a, b, bb);
  };
  if (c == w.scalar_type() && c == out) return product(x, w, bias);
  const Tensor xs = x.to(c);
  Tensor y;
  if (c == w.scalar_type()) {
    y = product(xs, w, c10::nullopt);
  } else {  // the plain weight widened a block of output rows at a time: bounded temporaries
    y = at::empty(shape, xs.options());
    const int64_t step = std::max<int64_t>(1, WIDEN_ELEMENTS / k);
    for (int64_t r0 = 0; r0 < w.size(0); r0 += step) {
      const int64_t len = std::min(step, w.size(0) - r0);
      y.narrow(-1, r0, len).copy_(product(xs, w.narrow(0, r0, len).to(c), c10::nullopt));
    }
  }
  y = y.to(sum);
  return (bias ? y.add_(bias->to(sum)) : y).to(out);
}

// F.rms_norm(x, (K,), weight, eps) for float32 rows x [..., K] (last dimension contiguous) on one thread.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t k = weight.numel();
  expect(weight, at::kFloat, {k}, "rms_norm", "weight");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, "rms_norm: x must be rows of ", k, " values, got ", x.sizes());
  const Tensor rows = x.dim() == 2 ? x : x.reshape({-1, k});
  expect_rows(rows, {rows.size(0), k}, "rms_norm", "x");
  Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t ld = rows.size(0) > 1 ? rows.stride(0) : k;
  mla_rms_norm_f32(ptr<const float>(rows), ld, ptr<const float>(weight), ptr<float>(y), rows.size(0), k,
                   static_cast<float>(eps));
  return y;
}

// -- attention -----------------------------------------------------------------------------------------------------

// The absorbed factors' format (mla_cpu.h, FactorFormat), both checked: w_uk [H, d_n, d_c] and w_uv_t [H, d_c, d_v]
// float32, or both bfloat16, or both uint8 runs [H, k + k / 4, n] (k int8 rows of a head, then its float32 scales and
// offsets a run of FACTOR_RUN rows; k a multiple of FACTOR_RUN).
int64_t factor_format(const Tensor& w_uk, const Tensor& w_uv_t, int64_t heads, int64_t d_n, int64_t d_c, int64_t d_v,
                      const char* op) {
  const at::ScalarType wt = w_uk.scalar_type();
  TORCH_CHECK_VALUE(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kByte,
                    op, ": w_uk is float32, bfloat16 or uint8 runs, got ", wt);
  if (wt != at::kByte) {
    expect(w_uk, wt, {heads, d_n, d_c}, op, "w_uk");
    expect(w_uv_t, wt, {heads, d_c, d_v}, op, "w_uv_t");
    return wt == at::kBFloat16 ? FACTOR_BF16 : FACTOR_F32;
  }
  TORCH_CHECK_VALUE(d_n % FACTOR_RUN == 0 && d_c % FACTOR_RUN == 0, op, ": runs factors need d_n and d_c multiples of ",
                    FACTOR_RUN, ", got ", d_n, " and ", d_c);
  expect(w_uk, wt, {heads, d_n + d_n / 4, d_c}, op, "w_uk (runs)");
  expect(w_uv_t, wt, {heads, d_c + d_c / 4, d_v}, op, "w_uv_t (runs)");
  return FACTOR_RUNS;
}

constexpr int64_t DECODE_SCRATCH_BYTES = 64 << 20;  // the absorbed decode's scratch per call; more rows: more calls

// Threads for the absorbed decode of `heads` heads: torch's, or more so that no thread takes over MAX_GROUP heads.
int64_t decode_threads(int64_t heads) { return std::max(threads(), cdiv(heads, MLA_DECODE_MAX_GROUP)); }

// A layer's absorbed decode attention: q_n [T, H, d_n], rotated q_r [T, H, d_r] (float32; row and head strides free),
// w_uk [H, d_n, d_c], w_uv_t [H, d_c, d_v] (factor_format), cache [S, d_c + d_r] latent rows (float32,
// bfloat16, float16, or int8 / float8_e4m3fn with their scales [S, 2]), slots [T, L] int64 (row t reads cache[slots[t, :lens[t]]]), lens [T] int64 -> out [T, H, d_v] float32.
Tensor absorbed_decode(const Tensor& q_n, const Tensor& q_r, const Tensor& w_uk, const Tensor& w_uv_t,
                       const Tensor& cache, const Tensor& slots, const Tensor& lens, double scale,
                       c10::string_view variant, const OptTensor& scales) {
  const char* op = "absorbed_decode";
  const int64_t v = variant_index(variant, mla_float_variants(), FLOAT_VARIANTS, op);
  TORCH_CHECK_VALUE(q_n.dim() == 3 && q_r.dim() == 3 && w_uk.dim() == 3 && w_uv_t.dim() == 3 && cache.dim() == 2,
                    "absorbed_decode: q_n, q_r [T, H, d], w_uk, w_uv_t [H, *, *] and cache [S, d_c + d_r]");
  const int64_t rows = q_n.size(0), heads = q_n.size(1), d_n = q_n.size(2), d_r = q_r.size(2);
  const int64_t d_c = w_uk.size(2), d_v = w_uv_t.size(2);
  expect_rows(q_n, {rows, heads, d_n}, op, "q_n");
  expect_rows(q_r, {rows, heads, d_r}, op, "q_r");
  const int64_t wf = factor_format(w_uk, w_uv_t, heads, d_n, d_c, d_v, op);
  const int64_t kind = expect_cache(cache, scales, d_c + d_r, op);
  expect_keys(slots, lens, rows, cache.size(0), op);
  const int64_t nt = decode_threads(heads), per_row = cdiv(heads, nt) * 2 * d_c;
  const int64_t step = std::max<int64_t>(1, DECODE_SCRATCH_BYTES / (4 * nt * std::max<int64_t>(per_row, 1)));
  const auto floats = q_n.options().dtype(at::kFloat);
  Tensor out = at::empty({rows, heads, d_v}, floats);
  auto kernel = wf == FACTOR_RUNS   ? &mla_absorbed_decode_runs
                : wf == FACTOR_BF16 ? &mla_absorbed_decode_bf16w
                                    : &mla_absorbed_decode_f32;
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const int64_t m = std::min(step, rows - r0), stride = mla_decode_scratch(m, heads, d_c, slots.size(1), nt);
    Tensor scratch = at::empty({nt, stride}, floats);
    kernel(ptr<const float>(q_n) + r0 * q_n.stride(0), q_n.stride(0), q_n.stride(1),
           ptr<const float>(q_r) + r0 * q_r.stride(0), q_r.stride(0), q_r.stride(1), w_uk.data_ptr(),
           w_uv_t.data_ptr(), cache.data_ptr(), ptr<const float>(scales),
           ptr<const int64_t>(slots) + r0 * slots.stride(0),
           slots.stride(0), ptr<const int64_t>(lens) + r0, static_cast<float>(scale),
           ptr<float>(out) + r0 * heads * d_v, ptr<float>(scratch), stride, m, heads, d_n, d_r, d_c, d_v, nt, kind, v);
  }
  return out;
}

// Rows x [S, H, d] (float32, bfloat16 or float16; any strides, the last dimension contiguous) as float32, head by
// head: heads_out [H, S, d] (rows = true) or, transposed, [H, d, S + pad] with the pad columns zeroed. One pass over x
// per head, threads over the heads; a transposed head goes sixteen rows at a time, so that each row of the output
// gets sixteen consecutive values from rows of x still in L1. (torch's copy_ made two passes and took 3-4x as long:
// 0.74 ms for 1,024 bfloat16 rows of 16 heads where this takes about 0.2.)
template <typename T>
void widen_heads(const Tensor& x, const Tensor& out, bool transposed, int64_t pad) {
  const int64_t s = x.size(0), h = x.size(1), d = x.size(2), st = x.stride(0), sh = x.stride(1);
  const T* src = ptr<const T>(x);
  float* dst = ptr<float>(out);
  at::parallel_for(0, h, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t head = h0; head < h1; ++head) {
      const T* xh = src + head * sh;
      if (!transposed) {
        float* oh = dst + head * s * d;
        for (int64_t t = 0; t < s; ++t)
          for (int64_t c = 0; c < d; ++c) oh[t * d + c] = static_cast<float>(xh[t * st + c]);
        continue;
      }
      const int64_t ld = s + pad;
      float* oh = dst + head * d * ld;
      for (int64_t t0 = 0; t0 < s; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, s - t0);
        for (int64_t c = 0; c < d; ++c)
          for (int64_t t = 0; t < n; ++t) oh[c * ld + t0 + t] = static_cast<float>(xh[(t0 + t) * st + c]);
      }
      for (int64_t c = 0; c < d; ++c) std::fill(oh + c * ld + s, oh + (c + 1) * ld, 0.0f);
    }
  });
}

// widen_heads for the dtype of rows [S, H, d] (float32, bfloat16 or float16), into a new float32 tensor
Tensor heads_as_float(const Tensor& rows, bool transposed, int64_t pad) {
  const Tensor x = rows.size(2) <= 1 || rows.stride(2) == 1 ? rows : rows.contiguous();
  const int64_t s = x.size(0), h = x.size(1), d = x.size(2);
  Tensor out = at::empty(transposed ? at::IntArrayRef({h, d, s + pad}) : at::IntArrayRef({h, s, d}),
                         x.options().dtype(at::kFloat));
  switch (x.scalar_type()) {
    case at::kFloat: widen_heads<float>(x, out, transposed, pad); break;
    case at::kBFloat16: widen_heads<c10::BFloat16>(x, out, transposed, pad); break;
    case at::kHalf: widen_heads<c10::Half>(x, out, transposed, pad); break;
    default: TORCH_CHECK_VALUE(false, "prefill_attention: float32, bfloat16 or float16 rows, got ", x.scalar_type());
  }
  return out;
}

// The prefill's up-projected attention, causal and bottom-right aligned, of the sequences cu_q / cu_k delimit (host
// lists, [B + 1], q_len <= k_len each): q_n [T, H, d_n], q_r [T, H, d_r], k_n [S, H, d_n], k_r [S, d_r] (one RoPE key
// per token), v [S, H, d_v], all float32, bfloat16 or float16 (widened exactly; the sums are float32), row and head
// strides free -> (out [T, H, d_v], lse [T, H]) float32.
std::tuple<Tensor, Tensor> prefill_attention(const Tensor& q_n, const Tensor& q_r, const Tensor& k_n,
                                             const Tensor& k_r, const Tensor& v, at::IntArrayRef cu_q,
                                             at::IntArrayRef cu_k, double scale, c10::string_view variant) {
  const char* op = "prefill_attention";
  const int64_t var = variant_index(variant, mla_float_variants(), FLOAT_VARIANTS, op);
  TORCH_CHECK_VALUE(q_n.dim() == 3 && q_r.dim() == 3 && k_n.dim() == 3 && k_r.dim() == 2 && v.dim() == 3,
                    "prefill_attention: q_n, q_r [T, H, d], k_n, v [S, H, d] and k_r [S, d_r]");
  const at::ScalarType dt = q_n.scalar_type();
  TORCH_CHECK_VALUE((dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) && q_r.scalar_type() == dt &&
                        k_n.scalar_type() == dt && k_r.scalar_type() == dt && v.scalar_type() == dt,
                    "prefill_attention: q_n, q_r, k_n, k_r and v are all float32, bfloat16 or float16, got ", dt, ", ",
                    q_r.scalar_type(), ", ", k_n.scalar_type(), ", ", k_r.scalar_type(), " and ", v.scalar_type());
  const int64_t rows = q_n.size(0), heads = q_n.size(1), d_n = q_n.size(2), d_r = q_r.size(2);
  const int64_t keys = k_n.size(0), d_v = v.size(2), nseq = static_cast<int64_t>(cu_q.size()) - 1;
  // float32 rows where they are half precision; the values of each head one after another (a task then reads its
  // head's in sequence, where in the up-projection's layout they lie a page apart each); the keys transposed, keys
  // along each row, with MLA_PREFILL_KEY_PAD zero columns past the last (scores go keys across the vector lanes)
  const auto floats = q_n.options().dtype(at::kFloat);
  const Tensor qn = q_n.to(at::kFloat), qr = q_r.to(at::kFloat);
  expect_rows(qn, {rows, heads, d_n}, op, "q_n");
  expect_rows(qr, {rows, heads, d_r}, op, "q_r");
  TORCH_CHECK_VALUE(k_n.sizes() == at::IntArrayRef({keys, heads, d_n}) && v.sizes() == at::IntArrayRef({keys, heads, d_v}) &&
                        k_r.sizes() == at::IntArrayRef({keys, d_r}),
                    "prefill_attention: k_n, k_r and v must be [S, ", heads, ", ", d_n, "], [S, ", d_r, "] and [S, ",
                    heads, ", *] for q_n ", q_n.sizes(), " and q_r ", q_r.sizes(), ", got ", k_n.sizes(), ", ",
                    k_r.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(nseq >= 0 && cu_k.size() == cu_q.size() && cu_q[0] == 0 && cu_k[0] == 0 &&
                        cu_q[nseq] == rows && cu_k[nseq] == keys,
                    "prefill_attention: cu_q and cu_k are [B + 1] from 0 to the ", rows, " rows and ", keys,
                    " keys, got ", cu_q, " and ", cu_k);
  int64_t longest = 0;
  for (int64_t b = 0; b < nseq; b++) {
    const int64_t q_len = cu_q[b + 1] - cu_q[b], k_len = cu_k[b + 1] - cu_k[b];
    TORCH_CHECK_VALUE(q_len >= 0 && q_len <= k_len, "prefill_attention: sequence ", b, " has ", q_len,
                      " rows and ", k_len, " keys (rows are the newest keys: 0 <= rows <= keys)");
    longest = std::max(longest, k_len);
  }
  const Tensor kt = heads_as_float(k_n, true, MLA_PREFILL_KEY_PAD);  // [H, d_n, S + pad]
  const Tensor krt = heads_as_float(k_r.unsqueeze(1), true, MLA_PREFILL_KEY_PAD);  // [1, d_r, S + pad]
  const Tensor vh = heads_as_float(v, false, 0);  // [H, S, d_v]
  Tensor out = at::empty({rows, heads, d_v}, floats), lse = at::empty({rows, heads}, floats);
  const int64_t nt = threads(), stride = MLA_PREFILL_ROWS * (longest + MLA_PREFILL_KEY_PAD);
  Tensor scratch = at::empty({nt, std::max<int64_t>(stride, 1)}, floats);
  std::vector<int64_t> cq(cu_q.begin(), cu_q.end()), ck(cu_k.begin(), cu_k.end());
  mla_prefill_attention_f32(ptr<const float>(qn), qn.stride(0), qn.stride(1), ptr<const float>(qr), qr.stride(0),
                            qr.stride(1), ptr<const float>(kt), kt.stride(0), kt.stride(1), ptr<const float>(krt),
                            krt.stride(1), ptr<const float>(vh), vh.stride(1), vh.stride(0), cq.data(), ck.data(), nseq,
                            static_cast<float>(scale), ptr<float>(out), ptr<float>(lse), ptr<float>(scratch), stride,
                            heads, d_n, d_r, d_v, nt, var);
  return {out, lse};
}

// The latent side of a float32 decode step, one thread: for each row t of latent [T, d_c + d_r] ([c ; k_r]),
// cache[slots[t]] = [RMSNorm(c) * norm ; RoPE(k_r)], and the RoPE part of each head of q [T, H, d_n + d_r] rotated
// in place. cos / sin [T, d_r / 2] (rows with a stride). A bfloat16 or float16 cache gets the rows rounded to nearest
// even, as torch rounds them; an int8 or float8_e4m3fn one each part quantised, its scale into scales [S, 2].
void rope_store(const Tensor& latent, const Tensor& norm, double eps, const Tensor& q, int64_t d_n, const Tensor& cos,
                const Tensor& sin, const Tensor& cache, const Tensor& slots, bool interleave, const OptTensor& scales) {
  const char* op = "rope_store";
  TORCH_CHECK_VALUE(latent.dim() == 2 && q.dim() == 3 && cache.dim() == 2, "rope_store: latent [T, d_c + d_r], ",
                    "q [T, H, d_n + d_r] and cache [S, d_c + d_r]");
  const int64_t rows = latent.size(0), width = latent.size(1), d_r = q.size(2) - d_n, d_c = width - d_r;
  TORCH_CHECK_VALUE(d_n >= 0 && d_r >= 2 && d_r % 2 == 0 && d_c >= 1, "rope_store: d_n ", d_n, " and q ", q.sizes(),
                    " against latent ", latent.sizes());
  expect_rows(latent, {rows, width}, op, "latent");
  expect_rows(q, {rows, q.size(1), d_n + d_r}, op, "q");
  expect(norm, at::kFloat, {d_c}, op, "norm");
  expect_rows(cos, {rows, d_r / 2}, op, "cos");
  expect_rows(sin, {rows, d_r / 2}, op, "sin");
  TORCH_CHECK_VALUE(rows <= 1 || sin.stride(0) == cos.stride(0), "rope_store: cos and sin rows lie alike");
  const int64_t kind = expect_cache(cache, scales, width, op);
  expect(slots, at::kLong, {rows}, op, "slots");
  const int64_t* s = ptr<const int64_t>(slots);
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK_VALUE(s[t] >= 0 && s[t] < cache.size(0), "rope_store: slot ", s[t], " of a cache of ", cache.size(0));
  mla_rope_store_f32(ptr<const float>(latent), latent.stride(0), ptr<const float>(norm), static_cast<float>(eps),
                     ptr<float>(q), q.stride(0), q.stride(1), q.size(1), d_n, ptr<const float>(cos),
                     ptr<const float>(sin), cos.stride(0), cache.data_ptr(), kind, ptr<float>(scales), s, rows, d_c,
                     d_r, interleave);
}

// -- the table-driven kernels ------------------------------------------------------------------------------------

const char* kind_name(int64_t kind) {
  return W_IS_GG(kind) ? "ggml" : W_IS_FP4(kind) ? "fp4" : W_IS_W8A8(kind) ? "w8a8" : W_IS_I4(kind) ? "int4"
       : W_IS_I4G(kind) ? "int4 groups"
       : kind == W_I8 ? "int8" : kind == W_BF16 ? "bfloat16" : kind == W_F16 ? "float16" : "float32";
}

// The rows of a table's weight operand: a ggml parts table's n, else the weight's first size.
int64_t operand_rows(const Tensor& w) {
  return w.scalar_type() == at::kLong && w.dim() == 1 && w.numel() >= GG_HEAD ? w.data_ptr<int64_t>()[1]
                                                                               : w.dim() == 2 ? w.size(0) : -1;
}

// A ggml parts table (ggml_parts) as an operand [n, k]: its structure checked again.
int64_t ggml_operand(const Tensor& w, const OptTensor& scales, int64_t n, int64_t k, const char* name) {
  const int64_t* t = w.data_ptr<int64_t>();
  const int64_t np = w.numel() >= GG_HEAD ? t[0] : 0, runs = mla_ggml_variants();
  TORCH_CHECK_VALUE(runs != 0, name, ": no ggml variant runs on this CPU");
  TORCH_CHECK_VALUE(np >= 1 && np <= GG_MAX_PARTS && w.numel() == GG_HEAD + np * GG_PART_FIELDS && t[1] == n &&
                        t[2] == k && !scales.has_value(),
                    name, ": a ggml operand is a parts table (mla_kernels::ggml_parts) of [", n, ", ", k,
                    "] with no scales");
  int64_t rows = 0;
  for (int64_t p = 0; p < np; ++p) {
    const int64_t* f = t + GG_HEAD + p * GG_PART_FIELDS;
    TORCH_CHECK_VALUE(mla_ggml_row_bytes(f[0], k) > 0 && f[2] >= mla_ggml_row_bytes(f[0], k) && f[3] >= 1 &&
                          gg_part_whole(f[0], rows, f[3], f[2], mla_ggml_row_bytes(f[0], k)),
                      name, ": part ", p, " of the ggml operand is not rows of ", k, " values in a type the kernels read");
    rows += f[3];
  }
  TORCH_CHECK_VALUE(rows == n, name, ": the ggml operand's parts hold ", rows, " rows, not ", n);
  return W_GG + fastest(runs);
}

// FP4 nibbles w with their FP4 table (fp4_table) as an operand [n, k]: the table checked again.
int64_t fp4_operand(const Tensor& w, const Tensor& table, int64_t n, int64_t k, const char* name) {
  expect(table, at::kLong, {FP4_FIELDS}, name, "the FP4 table (mla_kernels::fp4_table)");
  const int64_t* t = table.data_ptr<int64_t>();
  TORCH_CHECK_VALUE((t[0] == FP4_MX || t[0] == FP4_NV) && t[1] == n && t[2] == k && t[3] != 0 &&
                        (t[4] != 0) == (t[0] == FP4_NV),
                    name, ": the FP4 table is not one of a matrix [", n, ", ", k, "] (mla_kernels::fp4_table)");
  expect(w, at::kByte, {n, k / 2}, name, "the FP4 nibbles");
  return W_FP4 + fastest(mla_float_variants());  // fp4_linear's "auto"
}

// Grouped int4 nibbles w with their int4 table (int4_table) as an operand [n, k]: the table checked again.
int64_t i4g_operand(const Tensor& w, const Tensor& table, int64_t n, int64_t k, const char* name) {
  const int64_t* t = table.data_ptr<int64_t>(), runs = mla_i4_variants();
  TORCH_CHECK_VALUE(runs != 0, name, ": no int4 variant runs on this CPU");
  TORCH_CHECK_VALUE(t[0] == W_I4G && t[1] == n && t[2] == k && t[3] != 0 && (t[5] == 32 || t[5] == 64 || t[5] == 128),
                    name, ": the int4 table is not one of a matrix [", n, ", ", k, "] (mla_kernels::int4_table)");
  expect(w, at::kByte, {n, cdiv(k, 32) * 16}, name, "the int4 nibbles");
  return W_I4G + fastest(runs);  // linear_int4's "auto"
}

// An int8 weight's row scales: [n] for int8 (W_I8: rows rounded to int16), [n, 1] for W8A8 (W_W8A8: rows rounded to
// int8 per row, as w8a8_linear rounds them; W8A8 checkpoints store their scales so).
int64_t int8_kind(const Tensor& scales, int64_t n, const char* name) {
  if (scales.dim() != 2) {
    expect(scales, at::kFloat, {n}, name, "the row scales");
    return W_I8;
  }
  expect(scales, at::kFloat, {n, 1}, name, "the W8A8 row scales");
  return W_W8A8 + fastest(mla_w8a8_variants());  // w8a8_linear's "auto"
}

// A weight operand [n, k] of a table: its three fields (weight, scales, kind), from the weight's dtype, checked.
// uint8 weights are int4 nibbles with float16 group scales, or FP4 nibbles with their FP4 table (int64); int8
// weights are int8 or W8A8 by their scales' shape (int8_kind).
void operand(int64_t* out, const Tensor& w, const OptTensor& scales, int64_t n, int64_t k, const char* name) {
  const at::ScalarType dtype = w.scalar_type();
  int64_t kind = W_F32;
  if (dtype == at::kLong && w.dim() == 1) {
    kind = ggml_operand(w, scales, n, k, name);
  } else if (dtype == at::kByte && scales.has_value() && scales->scalar_type() == at::kLong &&
             scales->dim() == 1 && scales->numel() == I4G_FIELDS) {
    kind = i4g_operand(w, *scales, n, k, name);
  } else if (dtype == at::kByte && scales.has_value() && scales->scalar_type() == at::kLong) {
    kind = fp4_operand(w, *scales, n, k, name);
  } else if (dtype == at::kByte) {  // int4
    const int64_t kp = cdiv(k, 32) * 32, runs = mla_i4_variants();
    TORCH_CHECK_VALUE(runs != 0, name, ": no int4 variant runs on this CPU");
    expect(w, dtype, {n, kp / 2}, name, "the int4 nibbles");
    TORCH_CHECK_VALUE(scales.has_value(), name, ": int4 weights come with their scales");
    expect(*scales, at::kHalf, {n, kp / 32}, name, "the int4 group scales");
    kind = W_I4 + fastest(runs);
  } else {
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kChar, name,
                      ": a table's weights are float32, bfloat16, float16, int8, packed int4 or FP4, or ggml parts, ",
                      "got ", dtype);
    expect(w, dtype, {n, k}, name, "the weight");
    TORCH_CHECK_VALUE(scales.has_value() == (dtype == at::kChar), name, ": int8 weights (only) come with row scales");
    kind = dtype == at::kChar ? int8_kind(*scales, n, name)
         : dtype == at::kBFloat16 ? W_BF16 : dtype == at::kHalf ? W_F16 : W_F32;
  }
  out[0] = address(w);
  out[1] = address(scales);
  out[2] = kind;
}

// Gated MLPs of width d (a MoE layer's experts and shared experts, or one dense MLP): row e of `table` holds MLP
// e's gate_up [2 I_e, d] and down [d, I_e] operands and I_e.
struct MlpTable : torch::CustomClassHolder {
  Tensor table;
  std::vector<Tensor> keep;
  int64_t hidden = 0, max_inter = 0;

  MlpTable(at::TensorList gate_up, const c10::List<OptTensor>& gate_up_scales, at::TensorList down,
           const c10::List<OptTensor>& down_scales) {
    const int64_t n = static_cast<int64_t>(gate_up.size());
    TORCH_CHECK_VALUE(n >= 1 && down.size() == gate_up.size() && gate_up_scales.size() == gate_up.size() &&
                          down_scales.size() == gate_up.size(),
                      "MlpTable: one gate_up, down and scales (or None) per MLP");
    hidden = operand_rows(down[0]);
    table = at::zeros({n, MLP_FIELDS}, at::kLong);
    int64_t* row = table.data_ptr<int64_t>();
    for (int64_t e = 0; e < n; ++e, row += MLP_FIELDS) {
      TORCH_CHECK_VALUE(operand_rows(gate_up[e]) > 0 && operand_rows(gate_up[e]) % 2 == 0 && operand_rows(down[e]) > 0,
                        "MlpTable: MLP ", e, " has gate_up ", gate_up[e].sizes(), " and down ", down[e].sizes());
      const int64_t inter = operand_rows(gate_up[e]) / 2;
      operand(row, gate_up[e], gate_up_scales.get(e), 2 * inter, hidden, "MlpTable: gate_up");
      operand(row + 3, down[e], down_scales.get(e), hidden, inter, "MlpTable: down");
      row[6] = inter;
      max_inter = std::max(max_inter, inter);
      keep.insert(keep.end(), {gate_up[e], down[e]});
      for (const OptTensor& s : {gate_up_scales.get(e), down_scales.get(e)})
        if (s.has_value()) keep.push_back(*s);
    }
  }
  int64_t size() const { return table.size(0); }

  // Each MLP's gate_up and down weight formats, in order.
  std::vector<std::string> kinds() const {
    std::vector<std::string> out;
    const int64_t* row = table.data_ptr<int64_t>();
    for (int64_t e = 0; e < size(); ++e, row += MLP_FIELDS)
      for (int64_t kind : {row[2], row[5]}) out.push_back(kind_name(kind));
    return out;
  }
};

using MlpRef = c10::intrusive_ptr<MlpTable>;

// One float32 row x [..., d] as a contiguous row, checked against the table's width.
Tensor table_row(const Tensor& x, const MlpTable& t, const char* op) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.numel() == t.hidden, op,
                    ": one float32 CPU row of ", t.hidden, " values, got ", x.scalar_type(), " ", x.sizes());
  return x.contiguous();
}

// sum_i weights[i] * mlp_{ids[i]}(x) for one float32 row x [..., d].
Tensor gated_mlps(const Tensor& x, const MlpRef& table, at::IntArrayRef ids, at::ArrayRef<double> weights) {
  const Tensor row = table_row(x, *table, "gated_mlps");
  TORCH_CHECK_VALUE(!ids.empty() && ids.size() == weights.size(), "gated_mlps: one weight per MLP id");
  for (int64_t id : ids)
    TORCH_CHECK_VALUE(id >= 0 && id < table->size(), "gated_mlps: MLP ", id, " of ", table->size());
  const std::vector<float> w(weights.begin(), weights.end());
  Tensor y = at::empty(x.sizes(), row.options());
  Tensor scratch = at::empty({3 * table->max_inter}, row.options());
  mla_gated_mlps(ptr<const float>(row), ptr<float>(y), table->hidden, ptr<const int64_t>(table->table), ids.data(),
                 w.data(), static_cast<int64_t>(ids.size()), ptr<float>(scratch), threads());
  return y;
}

// The MLPs ids over rows of x [t, d]: MLP i over the counts[i] rows rows[c_i .. c_i + counts[i]) of x (c_i the
// counts before it), its outputs [counts[i], d] stacked in that order, unweighted: what the whole-layer kernel's MLP
// of a step's rows computes (mla_mlps_rows: MLPs in ggml block types, or one row, in one parallel region). At most
// MLA_FEW_ROWS rows unless every MLP is in ggml block types.
Tensor mlps_rows(const Tensor& x, const MlpRef& table, at::IntArrayRef ids, at::IntArrayRef counts,
                 at::IntArrayRef rows) {
  const char* op = "mlps_rows";
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) >= 1 &&
                        x.size(1) == table->hidden,
                    op, ": float32 CPU rows [t, ", table->hidden, "], got ", x.scalar_type(), " ", x.sizes());
  const int64_t n = static_cast<int64_t>(ids.size()), t = x.size(0);
  TORCH_CHECK_VALUE(n >= 1 && n <= MLA_FEW_ROWS * MLA_MOE_MAX_TOPK + 1 && counts.size() == ids.size(), op,
                    ": 1 to ", MLA_FEW_ROWS * MLA_MOE_MAX_TOPK + 1, " MLP ids, one row count each; got ", n, " ids and ",
                    counts.size(), " counts");
  const int64_t* mlps = ptr<const int64_t>(table->table);
  std::vector<const int64_t*> starts;
  int64_t total = 0;
  bool ggml = true;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < table->size(), op, ": MLP ", ids[i], " of ", table->size());
    TORCH_CHECK_VALUE(counts[i] >= 1, op, ": MLP ", ids[i], " over ", counts[i], " rows");
    ggml = ggml && W_IS_GG(mlps[ids[i] * MLP_FIELDS + 2]) && W_IS_GG(mlps[ids[i] * MLP_FIELDS + 5]);
    starts.push_back(rows.data() + total);
    total += counts[i];
  }
  TORCH_CHECK_VALUE(ggml || t <= MLA_FEW_ROWS, op, ": 1 to ", MLA_FEW_ROWS,
                    " rows where an MLP is not in ggml block types, got ", t);
  TORCH_CHECK_VALUE(static_cast<int64_t>(rows.size()) == total, op, ": ", total, " row indices for the counts, got ",
                    rows.size());
  for (int64_t r : rows) TORCH_CHECK_VALUE(r >= 0 && r < t, op, ": row ", r, " of ", t);
  const Tensor xs = x.contiguous();
  Tensor out = at::empty({total, table->hidden}, xs.options());
  mla_mlps_rows(mlps, ids.data(), starts.data(), counts.data(), n, ptr<const float>(xs), t, table->hidden,
                ptr<float>(out), threads());
  return out;
}

// The routing settings of a MoE row: [scoring, method, n_group, topk_group, top_k, norm_topk_prob, n_experts, 0]
// (mla_kernels.cpu_tables.route_config builds them); the router [E, d] float32 and its correction bias [E] or None.
void expect_route(const Tensor& router, const Tensor& route, const OptTensor& bias, int64_t d, const char* op) {
  expect(route, at::kLong, {8}, op, "route");
  const int64_t* r = ptr<const int64_t>(route);
  const int64_t experts = r[6];
  TORCH_CHECK_VALUE(experts >= 1 && r[2] >= 1 && experts % r[2] == 0 && r[3] >= 1 && r[3] <= r[2] && r[4] >= 1 &&
                        r[4] <= std::min<int64_t>(experts, MLA_MOE_MAX_TOPK) && r[0] >= 0 && r[0] <= 1 && r[1] >= 0 &&
                        r[1] <= 2,
                    op, ": a routing the kernel does not run (", route, ")");
  expect(router, at::kFloat, {experts, d}, op, "router");
  if (bias.has_value()) expect(*bias, at::kFloat, {experts}, op, "route bias");
}

// A MoE layer for one float32 row x [..., d]: router logits, routing, then the chosen experts this table holds
// (global ids first .. first + count - 1 are its rows 0 .. count - 1) and the shared experts (row `shared`, or -1).
Tensor moe_row(const Tensor& x, const MlpRef& table, const Tensor& router, const Tensor& route, const OptTensor& bias,
               double scaling, int64_t first, int64_t count, int64_t shared) {
  const Tensor row = table_row(x, *table, "moe_row");
  expect_route(router, route, bias, table->hidden, "moe_row");
  TORCH_CHECK_VALUE(count >= 0 && count <= table->size() && shared >= -1 && shared < table->size() && first >= 0,
                    "moe_row: experts ", first, " + ", count, " and shared row ", shared, " of a table of ",
                    table->size());
  const int64_t experts = ptr<const int64_t>(route)[6], groups = ptr<const int64_t>(route)[2];
  Tensor y = at::empty(x.sizes(), row.options());
  Tensor scratch =
      at::empty({3 * table->max_inter + 5 * experts + groups + MLA_MOE_MAX_TOPK + 1}, row.options());
  mla_moe_row(ptr<const float>(row), ptr<float>(y), table->hidden, ptr<const float>(router), ptr<const int64_t>(route),
              ptr<const float>(bias), static_cast<float>(scaling), ptr<const int64_t>(table->table), first, count,
              shared, ptr<float>(scratch), table->max_inter, threads());
  return y;
}

// A decoder layer's weights (../mla_cpu.h, enum LayerField), checked against dims = [d, q_lora, heads, d_n, d_r, d_c,
// d_v]: with q_lora, qa is the stacked [q_a ; kv_a] projection, qb q_b and q_norm the q_a norm; without, qa is
// q_proj and kva kv_a. floats: the four norms' eps, the softmax scale and the routed scaling factor. mlp (or None:
// the caller runs the MLP) is the dense MLP (its row 0) or, with a router, the MoE layer's experts.
struct LayerTable : torch::CustomClassHolder {
  Tensor table;
  std::vector<Tensor> keep;
  MlpRef mlp;
  int64_t hidden = 0, heads = 0, d_c = 0;

  LayerTable(const Tensor& in_norm, const Tensor& post_norm, const OptTensor& q_norm, const Tensor& kv_norm,
             const Tensor& qa, const OptTensor& qa_scales, const OptTensor& kva, const OptTensor& kva_scales,
             const OptTensor& qb, const OptTensor& qb_scales, const Tensor& w_uk, const Tensor& w_uv_t,
             const Tensor& o, const OptTensor& o_scales, c10::optional<MlpRef> mlp_table,
             const OptTensor& router, const OptTensor& route, const OptTensor& route_bias, int64_t first,
             int64_t count, int64_t shared, at::IntArrayRef dims, bool interleave, at::ArrayRef<double> floats,
             bool one_path) {
    const char* op = "LayerTable";
    TORCH_CHECK_VALUE(dims.size() == 7 && floats.size() == 6, "LayerTable: dims are d, q_lora, heads, d_n, d_r, d_c, ",
                      "d_v; floats the four norms' eps, the softmax scale and the routed scaling factor");
    const int64_t d = dims[0], q_lora = dims[1], d_n = dims[3], d_r = dims[4], d_v = dims[6];
    hidden = d, heads = dims[2], d_c = dims[5];
    const int64_t qk = d_n + d_r;
    TORCH_CHECK_VALUE(kva.has_value() != (q_lora > 0) && qb.has_value() == (q_lora > 0) &&
                          q_norm.has_value() == (q_lora > 0),
                      "LayerTable: with q_lora the stacked q_a/kv_a, q_b and the q_a norm; without, q_proj and kv_a");
    table = at::zeros({L_FIELDS}, at::kLong);
    int64_t* L = table.data_ptr<int64_t>();
    auto norm = [&](int field, const Tensor& t, int64_t width, const char* name) {
      expect(t, at::kFloat, {width}, op, name);
      keep.push_back(t);
      L[field] = address(t);
    };
    norm(L_IN_NORM, in_norm, d, "in_norm");
    norm(L_POST_NORM, post_norm, d, "post_norm");
    if (q_norm.has_value()) norm(L_Q_NORM, *q_norm, q_lora, "q_norm");
    norm(L_KV_NORM, kv_norm, d_c, "kv_norm");
    auto weights = [&](int field, const Tensor& w, const OptTensor& s, int64_t n, int64_t k, const char* name) {
      operand(L + field, w, s, n, k, name);
      keep.push_back(w);
      if (s.has_value()) keep.push_back(*s);
    };
    weights(L_QA_W, qa, qa_scales, q_lora ? q_lora + d_c + d_r : heads * qk, d, "LayerTable: qa");
    if (kva.has_value()) weights(L_KVA_W, *kva, kva_scales, d_c + d_r, d, "LayerTable: kva");
    if (qb.has_value()) weights(L_QB_W, *qb, qb_scales, heads * qk, q_lora, "LayerTable: qb");
    weights(L_O_W, o, o_scales, d, heads * d_v, "LayerTable: o");
    L[L_W_FORMAT] = factor_format(w_uk, w_uv_t, heads, d_n, d_c, d_v, op);
    keep.insert(keep.end(), {w_uk, w_uv_t});
    L[L_W_UK] = address(w_uk);
    L[L_W_UV_T] = address(w_uv_t);
    if (mlp_table.has_value()) {
      mlp = *mlp_table;
      TORCH_CHECK_VALUE(mlp->hidden == d, "LayerTable: the MLP table's width ", mlp->hidden, " is not the layer's ", d);
      L[L_MLP_TABLE] = address(mlp->table);
      L[L_MAX_INTER] = mlp->max_inter;
    }
    L[L_SHARED] = -1;
    if (router.has_value()) {
      TORCH_CHECK_VALUE(mlp && route.has_value(), "LayerTable: a router comes with its routing and experts' table");
      expect_route(*router, *route, route_bias, d, op);
      TORCH_CHECK_VALUE(count >= 0 && count <= mlp->size() && shared >= -1 && shared < mlp->size() && first >= 0,
                        "LayerTable: experts ", count, " and shared row ", shared, " do not fit the MLP table");
      keep.insert(keep.end(), {*router, *route});
      if (route_bias.has_value()) keep.push_back(*route_bias);
      L[L_ROUTER] = address(router);
      L[L_ROUTE] = address(route);
      L[L_ROUTE_BIAS] = address(route_bias);
      L[L_FIRST] = first;
      L[L_COUNT] = count;
      L[L_SHARED] = shared;
    }
    const int fields[7] = {L_D, L_Q_LORA, L_HEADS, L_D_N, L_D_R, L_D_C, L_D_V};
    for (int i = 0; i < 7; ++i) L[fields[i]] = dims[i];
    L[L_INTERLEAVE] = interleave;
    L[L_ONE_PATH] = one_path;
    Tensor f = at::empty({6}, at::kFloat);
    for (int i = 0; i < 6; ++i) f.data_ptr<float>()[i] = static_cast<float>(floats[i]);
    keep.push_back(f);
    L[L_FLOATS] = address(f);
  }
  bool runs_mlp() const { return static_cast<bool>(mlp); }

  // The weight formats of the layer's products (q_a / q_proj, kv_a, q_b, o_proj, where present), then its MLPs'.
  std::vector<std::string> kinds() const {
    std::vector<std::string> out;
    const int64_t* L = table.data_ptr<int64_t>();
    for (int field : {L_QA_W, L_KVA_W, L_QB_W, L_O_W})
      if (L[field] != 0) out.push_back(kind_name(L[field + 2]));
    if (mlp)
      for (const std::string& k : mlp->kinds()) out.push_back(k);
    return out;
  }
};

// A decode step's rows (../mla_cpu.h, enum StepField) for layers of `heads` heads and latent width d_c: RoPE tables
// cos / sin [T, d_r / 2] (rows with a stride), each row's cache slot slots [T] and its keys' slots keys [T, L] with
// their counts lens [T] (int64). One scratch buffer serves every layer of the step.
struct DecodeStep : torch::CustomClassHolder {
  Tensor table, scratch;
  std::vector<Tensor> keep;
  int64_t rows = 0, heads = 0, d_c = 0, max_slot = -1;

  DecodeStep(const Tensor& cos, const Tensor& sin, const Tensor& slots, const Tensor& keys, const Tensor& lens,
             int64_t heads_, int64_t d_c_) {
    const char* op = "DecodeStep";
    rows = slots.numel(), heads = heads_, d_c = d_c_;
    TORCH_CHECK_VALUE(rows >= 1 && rows <= MLA_FEW_ROWS && heads >= 1 && d_c >= 1 && cos.dim() == 2, op, ": 1 to ",
                      MLA_FEW_ROWS, " rows, got ", rows);
    expect_rows(cos, {rows, cos.size(1)}, op, "cos");
    expect_rows(sin, cos.sizes(), op, "sin");
    TORCH_CHECK_VALUE(rows == 1 || sin.stride(0) == cos.stride(0), op, ": cos and sin rows lie alike");
    expect(slots, at::kLong, {rows}, op, "slots");
    max_slot = expect_keys(keys, lens, rows, INT64_MAX, op);
    const int64_t* s = ptr<const int64_t>(slots);
    for (int64_t t = 0; t < rows; ++t) {
      TORCH_CHECK_VALUE(s[t] >= 0, op, ": slot ", s[t]);
      max_slot = std::max(max_slot, s[t]);
    }
    keep = {cos, sin, slots, keys, lens};
    const int64_t nt = decode_threads(heads);
    table = at::zeros({S_FIELDS}, at::kLong);
    int64_t* S = table.data_ptr<int64_t>();
    S[S_ROWS] = rows;
    S[S_COS] = address(cos);
    S[S_SIN] = address(sin);
    S[S_CS_LD] = cos.stride(0);
    S[S_SLOTS] = address(slots);
    S[S_KEYS] = address(keys);
    S[S_KEY_STRIDE] = keys.stride(0);
    S[S_LENS] = address(lens);
    S[S_THREADS] = threads();
    S[S_DECODE_THREADS] = nt;
    S[S_DECODE_STRIDE] = mla_decode_scratch(rows, heads, d_c, keys.size(1), nt);
    scratch = at::empty({0}, at::kFloat);
  }
};

using LayerRef = c10::intrusive_ptr<LayerTable>;
using StepRef = c10::intrusive_ptr<DecodeStep>;

// One decoder layer over the step's rows: x [T, d] (contiguous float32) updated in place, the new latents written
// into cache (the layer's [S, d_c + d_r] rows of any CacheKind, with their scales where quantised). Returns True when
// the layer's MLP ran too, else the caller runs it on post_norm(x), left at the start of the step's scratch
// (decoder_layer_hidden).
bool decoder_layer(const LayerRef& layer, const StepRef& step, const Tensor& x, const Tensor& cache,
                   const OptTensor& scales) {
  const char* op = "decoder_layer";
  TORCH_CHECK_VALUE(layer->heads == step->heads && layer->d_c == step->d_c, op, ": a step of ", step->heads,
                    " heads and latent ", step->d_c, " for a layer of ", layer->heads, " and ", layer->d_c);
  expect(x, at::kFloat, {step->rows, layer->hidden}, op, "x");
  const int64_t width = layer->table.data_ptr<int64_t>()[L_D_C] + layer->table.data_ptr<int64_t>()[L_D_R];
  const int64_t kind = expect_cache(cache, scales, width, op);
  TORCH_CHECK_VALUE(step->max_slot < cache.size(0), op, ": the step reads cache slot ", step->max_slot,
                    ", the cache holds ", cache.size(0));
  const int64_t need = mla_decoder_layer_scratch(ptr<const int64_t>(layer->table), ptr<const int64_t>(step->table));
  if (step->scratch.numel() < need) step->scratch = at::empty({need}, at::kFloat);
  return mla_decoder_layer(ptr<const int64_t>(layer->table), ptr<const int64_t>(step->table), ptr<float>(x),
                           cache.data_ptr(), kind, ptr<float>(scales), ptr<float>(step->scratch)) != 0;
}

// After a decoder_layer call that left the MLP to the caller: RMSNorm(x) (post-attention), a view of the step's
// scratch [T, d], valid until the step's next call.
Tensor decoder_layer_hidden(const StepRef& step, int64_t d) {
  TORCH_CHECK_VALUE(step->scratch.numel() >= step->rows * d, "decoder_layer_hidden: no layer ran on this step");
  return step->scratch.narrow(0, 0, step->rows * d).view({step->rows, d});
}

// FP4 E2M1 weights w [N, Kp / 2] uint8 (../gemm_fp4.c; Kp: K rounded up to whole groups, the padding zeros): MXFP4
// with uint8 UE8M0 scales [N, Kp / 32], or NVFP4 with float8_e4m3fn scales [N, Kp / 16] and float32 global scales
// [N] (one per row); float32 rows [..., K], any number of them, MLA_QUANT_ROWS a pass; "auto" or a float variant.
Tensor fp4_linear(const Tensor& x, const Tensor& w, const Tensor& scales, const OptTensor& global,
                  c10::string_view variant) {
  const char* op = "fp4_linear";
  check_rows(x, op);
  const bool mx = scales.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE(mx || scales.scalar_type() == at::kFloat8_e4m3fn, op, ": scales are uint8 (MXFP4) or ",
                    "float8_e4m3fn (NVFP4), got ", scales.scalar_type());
  TORCH_CHECK_VALUE(mx != global.has_value(), op, ": NVFP4 scales (and only they) come with global scales [N]");
  const int64_t group = mx ? 32 : 16, n = w.dim() == 2 ? w.size(0) : 0, width = x.size(-1);
  const int64_t rows = width ? x.numel() / width : 0, k = cdiv(width, group) * group;  // K padded to whole groups
  TORCH_CHECK_VALUE(width >= 1, op, ": rows of at least one value, got x ", x.sizes());
  expect(w, at::kByte, {n, k / 2}, op, "the packed weight");
  expect(scales, scales.scalar_type(), {n, k / group}, op, "the group scales");
  if (global) expect(*global, at::kFloat, {n}, op, "the global scales");
  const int64_t v = variant_index(variant, mla_float_variants(), FLOAT_VARIANTS, op);
  Tensor xs = x.to(at::kFloat).reshape({rows, width});
  xs = (k == width ? xs : at::constant_pad_nd(xs, {0, k - width}, 0.0)).contiguous();  // zeros meet the padding
  Tensor y = rows_out(x, n);
  const float* xp = ptr<const float>(xs);
  float* yp = ptr<float>(y);
  for (int64_t r0 = 0; r0 < rows; r0 += MLA_QUANT_ROWS)
    mla_gemm_fp4(mx ? FP4_MX : FP4_NV, ptr<const uint8_t>(w), ptr<const uint8_t>(scales), ptr<const float>(global),
                 xp + r0 * k, yp + r0 * n, std::min<int64_t>(MLA_QUANT_ROWS, rows - r0), n, k, threads(), v);
  return y;
}

// W8A8: x [..., K] rows rounded to int8 per row on the fly (../gemm_w8a8.c), int8 weight w [N, K] with float32 row
// scales [N]; any number of rows, MLA_QUANT_ROWS a pass; "auto" or a variant of the int8 family. row_amax (float32,
// one a row): the amax each row is rounded with, in place of its own (a tensor-parallel rank's slice of K).
Tensor w8a8_linear(const Tensor& x, const Tensor& w, const Tensor& scales, c10::string_view variant,
                   const OptTensor& row_amax) {
  const char* op = "w8a8_linear";
  check_rows(x, op);
  const int64_t n = w.dim() == 2 ? w.size(0) : 0, k = x.size(-1), rows = k ? x.numel() / k : 0;
  expect(w, at::kChar, {n, k}, op, "the weight");
  expect(scales, at::kFloat, {n}, op, "the row scales");
  if (row_amax) expect(*row_amax, at::kFloat, {rows}, op, "the rows' amax");
  TORCH_CHECK_VALUE(k >= 1, op, ": rows of at least one value, got x ", x.sizes());
  const int64_t v = variant_index(variant, mla_w8a8_variants(), W8A8_VARIANTS, op, 3);
  const Tensor xs = x.to(at::kFloat).contiguous();
  Tensor y = rows_out(x, n);
  const float* xp = ptr<const float>(xs);
  const float* ap = row_amax ? ptr<const float>(*row_amax) : nullptr;
  float* yp = ptr<float>(y);
  for (int64_t r0 = 0; r0 < rows; r0 += MLA_QUANT_ROWS)
    mla_gemm_w8a8(ptr<const int8_t>(w), ptr<const float>(scales), xp + r0 * k, ap ? ap + r0 : nullptr, yp + r0 * n,
                  std::min<int64_t>(MLA_QUANT_ROWS, rows - r0), n, k, threads(), v);
  return y;
}

// -- what this library holds -----------------------------------------------------------------------------------

// The products' variants, each "<family>.<name>:runs", "...:cannot run here" or "...:above the ISA cap" (float,
// int8, int4, ggml, w8a8).
std::vector<std::string> product_variants() {
  std::vector<std::string> out;
  const int64_t masks[5] = {mla_float_variants(), mla_i8_variants(), mla_i4_variants(), mla_ggml_variants(),
                            mla_w8a8_variants()};
  const char* families[5] = {"float", "int8", "int4", "ggml", "w8a8"};
  const char* const* names[5] = {FLOAT_VARIANTS, QUANT_VARIANTS, QUANT_VARIANTS, QUANT_VARIANTS, W8A8_VARIANTS};
  for (int f = 0; f < 5; ++f)
    for (int64_t i = 0; i < (f == 4 ? 3 : 2); ++i)
      out.push_back(std::string(families[f]) + "." + names[f][i] +
                    (masks[f] >> i & 1 ? ":runs" : above_cap(i) ? ":above the ISA cap" : ":cannot run here"));
  return out;
}

c10::Dict<std::string, int64_t> limits() {
  c10::Dict<std::string, int64_t> out;
  out.insert("few_rows", MLA_FEW_ROWS);
  out.insert("quant_rows", MLA_QUANT_ROWS);
  out.insert("moe_max_topk", MLA_MOE_MAX_TOPK);
  out.insert("amx_bf16", mla_amx_bf16());
  out.insert("amx_int8", mla_amx_int8());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mla_kernels, m) {
  m.class_<MlpTable>("MlpTable").def("size", &MlpTable::size).def("kinds", &MlpTable::kinds);
  m.class_<LayerTable>("LayerTable").def("runs_mlp", &LayerTable::runs_mlp).def("kinds", &LayerTable::kinds);
  m.class_<DecodeStep>("DecodeStep");
  m.def("linear(Tensor x, Tensor w, Tensor? scales=None, int[] block=[], str variant=\"auto\") -> Tensor");
  m.def("dense_linear(Tensor x, Tensor plain, Tensor? operand, Tensor? tiles, Tensor? bias, int[] rows, bool onednn) "
        "-> Tensor");
  m.def("linear_int4(Tensor x, Tensor w, Tensor scales, Tensor? zeros=None, int group=32, str variant=\"auto\") -> "
        "Tensor");
  m.def("fp4_linear(Tensor x, Tensor w, Tensor scales, Tensor? global_scales=None, str variant=\"auto\") -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor w, Tensor scales, str variant=\"auto\", Tensor? row_amax=None) -> Tensor");
  m.def("int4_from_stored(Tensor stored) -> Tensor");
  m.def("ggml_linear(Tensor x, Tensor w, int type, str variant=\"auto\") -> Tensor");
  m.def("ggml_parts(Tensor[] parts, int[] types, int k) -> Tensor");
  m.def("ggml_repack(Tensor w, int k) -> Tensor");
  m.def("fp4_table(Tensor w, Tensor scales, Tensor? global_scales=None) -> Tensor");
  m.def("int4_table(Tensor w, Tensor scales, Tensor? zeros, int group, int k) -> Tensor");
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("absorbed_decode(Tensor q_n, Tensor q_r, Tensor w_uk, Tensor w_uv_t, Tensor cache, Tensor slots, "
        "Tensor lens, float scale, str variant=\"auto\", Tensor? scales=None) -> Tensor");
  m.def("prefill_attention(Tensor q_n, Tensor q_r, Tensor k_n, Tensor k_r, Tensor v, int[] cu_q, int[] cu_k, "
        "float scale, str variant=\"auto\") -> (Tensor, Tensor)");
  m.def("rope_store(Tensor latent, Tensor norm, float eps, Tensor(a!) q, int d_n, Tensor cos, Tensor sin, "
        "Tensor(b!) cache, Tensor slots, bool interleave, Tensor(c!)? scales=None) -> ()");
  m.def("mlp_table(Tensor[] gate_up, Tensor?[] gate_up_scales, Tensor[] down, Tensor?[] down_scales) -> "
        "__torch__.torch.classes.mla_kernels.MlpTable",
        [](at::TensorList gu, const c10::List<OptTensor>& gus, at::TensorList dn, const c10::List<OptTensor>& dns) {
          return c10::make_intrusive<MlpTable>(gu, gus, dn, dns);
        });
  m.def("gated_mlps(Tensor x, __torch__.torch.classes.mla_kernels.MlpTable table, int[] ids, float[] weights) -> "
        "Tensor",
        &gated_mlps);
  m.def("mlps_rows(Tensor x, __torch__.torch.classes.mla_kernels.MlpTable table, int[] ids, int[] counts, "
        "int[] rows) -> Tensor",
        &mlps_rows);
  m.def("moe_row(Tensor x, __torch__.torch.classes.mla_kernels.MlpTable table, Tensor router, Tensor route, "
        "Tensor? bias, float scaling, int first, int count, int shared) -> Tensor",
        &moe_row);
  m.def("layer_table(Tensor in_norm, Tensor post_norm, Tensor? q_norm, Tensor kv_norm, Tensor qa, Tensor? qa_scales, "
        "Tensor? kva, Tensor? kva_scales, Tensor? qb, Tensor? qb_scales, Tensor w_uk, Tensor w_uv_t, Tensor o, "
        "Tensor? o_scales, __torch__.torch.classes.mla_kernels.MlpTable? mlp, Tensor? router, Tensor? route, "
        "Tensor? route_bias, int first, int count, int shared, int[] dims, bool interleave, float[] floats, "
        "bool one_path=False) -> "
        "__torch__.torch.classes.mla_kernels.LayerTable",
        [](const Tensor& in_norm, const Tensor& post_norm, const OptTensor& q_norm, const Tensor& kv_norm,
           const Tensor& qa, const OptTensor& qa_s, const OptTensor& kva, const OptTensor& kva_s, const OptTensor& qb,
           const OptTensor& qb_s, const Tensor& w_uk, const Tensor& w_uv_t, const Tensor& o, const OptTensor& o_s,
           c10::optional<MlpRef> mlp, const OptTensor& router, const OptTensor& route, const OptTensor& bias,
           int64_t first, int64_t count, int64_t shared, at::IntArrayRef dims, bool interleave,
           at::ArrayRef<double> floats, bool one_path) {
          return c10::make_intrusive<LayerTable>(in_norm, post_norm, q_norm, kv_norm, qa, qa_s, kva, kva_s, qb, qb_s,
                                                 w_uk, w_uv_t, o, o_s, std::move(mlp), router, route, bias, first,
                                                 count, shared, dims, interleave, floats, one_path);
        });
  m.def("decode_step(Tensor cos, Tensor sin, Tensor slots, Tensor keys, Tensor lens, int heads, int d_c) -> "
        "__torch__.torch.classes.mla_kernels.DecodeStep",
        [](const Tensor& cos, const Tensor& sin, const Tensor& slots, const Tensor& keys, const Tensor& lens,
           int64_t heads, int64_t d_c) { return c10::make_intrusive<DecodeStep>(cos, sin, slots, keys, lens, heads, d_c); });
  m.def("decoder_layer(__torch__.torch.classes.mla_kernels.LayerTable layer, "
        "__torch__.torch.classes.mla_kernels.DecodeStep step, Tensor(a!) x, Tensor(b!) cache, "
        "Tensor(c!)? scales=None) -> bool",
        &decoder_layer);
  m.def("decoder_layer_hidden(__torch__.torch.classes.mla_kernels.DecodeStep step, int d) -> Tensor",
        &decoder_layer_hidden);
  m.def("product_variants() -> str[]", &product_variants);
  m.def("limits() -> Dict(str, int)", &limits);
}

TORCH_LIBRARY_IMPL(mla_kernels, CPU, m) {
  m.impl("linear", &linear);
  m.impl("dense_linear", &dense_linear);
  m.impl("linear_int4", &linear_int4);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("fp4_linear", &fp4_linear);
  m.impl("int4_from_stored", &int4_from_stored);
  m.impl("ggml_linear", &ggml_linear);
  m.impl("ggml_parts", &ggml_parts);
  m.impl("ggml_repack", &ggml_repack);
  m.impl("fp4_table", &fp4_table);
  m.impl("int4_table", &int4_table);
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("absorbed_decode", &absorbed_decode);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rope_store", &rope_store);
}

// oneDNN's blocked layout of a weight (dense_linear's operand) is an MkldnnCPU tensor.
TORCH_LIBRARY_IMPL(mla_kernels, MkldnnCPU, m) { m.impl("dense_linear", &dense_linear); }
