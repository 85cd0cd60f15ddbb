// The compiled CPU kernels (../mla_cpu.h) as typed torch operators, mla_kernels::<name>. Each operator takes the
// kernel's arguments with its buffers as tensors (mutated ones marked in the schema) and calls it on torch's thread
// pool; mla_kernels.cpu_gemv checks the shapes and dtypes before calling, and builds the layer and MLP tables (int64
// tensors of pointers and sizes) that the table-driven kernels read. Registered operators show under their names in
// the profiler and are checked by the dispatcher.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "../mla_cpu.h"

namespace {

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
T* ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<T*>(t->data_ptr()) : nullptr;
}

void gemv_f32(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t n, int64_t k, int64_t threads) {
  mla_gemv_f32(ptr<const float>(w), ptr<const float>(x), ptr<float>(y), n, k, threads);
}

void gemv_bf16(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t n, int64_t k, int64_t threads) {
  mla_gemv_bf16(ptr<const uint16_t>(w), ptr<const float>(x), ptr<float>(y), n, k, threads);
}

void gemv_i8(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& x, const at::Tensor& y, int64_t n,
             int64_t k, int64_t threads) {
  mla_gemv_i8(ptr<const int8_t>(w), ptr<const float>(scale), ptr<const float>(x), ptr<float>(y), n, k, threads);
}

void gemm_few_f32(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t m, int64_t n, int64_t k,
                  int64_t threads) {
  mla_gemm_few_f32(ptr<const float>(w), ptr<const float>(x), ptr<float>(y), m, n, k, threads);
}

void gemm_few_bf16(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t m, int64_t n, int64_t k,
                   int64_t threads) {
  mla_gemm_few_bf16(ptr<const uint16_t>(w), ptr<const float>(x), ptr<float>(y), m, n, k, threads);
}

void gemm_few_i8(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& x, const at::Tensor& y, int64_t m,
                 int64_t n, int64_t k, int64_t threads) {
  mla_gemm_few_i8(ptr<const int8_t>(w), ptr<const float>(scale), ptr<const float>(x), ptr<float>(y), m, n, k, threads);
}

void gemm_fp8(const at::Tensor& w, const at::Tensor& scale, int64_t bn, int64_t bk, const at::Tensor& x,
              const at::Tensor& y, int64_t m, int64_t n, int64_t k, int64_t threads) {
  mla_gemm_fp8(ptr<const uint8_t>(w), ptr<const float>(scale), bn, bk, ptr<const float>(x), ptr<float>(y), m, n, k,
               threads);
}

void gemm_i4(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& x, const at::Tensor& y, int64_t rows,
             int64_t n, int64_t k, int64_t threads, int64_t variant) {
  mla_gemm_i4(ptr<const uint8_t>(w), ptr<const uint16_t>(scales), ptr<const float>(x), ptr<float>(y), rows, n, k,
              threads, variant);
}

void i4_from_stored(const at::Tensor& src, const at::Tensor& dst, int64_t groups, int64_t threads) {
  mla_i4_from_stored(ptr<const uint8_t>(src), ptr<uint8_t>(dst), groups, threads);
}

void rms_norm_f32(const at::Tensor& x, int64_t ld, const at::Tensor& weight, const at::Tensor& y, int64_t m,
                  int64_t k, double eps) {
  mla_rms_norm_f32(ptr<const float>(x), ld, ptr<const float>(weight), ptr<float>(y), m, k, static_cast<float>(eps));
}

void absorbed_decode(const at::Tensor& q_n, int64_t qn_t, int64_t qn_h, const at::Tensor& q_r, int64_t qr_t,
                     int64_t qr_h, const at::Tensor& w_uk, const at::Tensor& w_uv_t, const at::Tensor& cache,
                     const at::Tensor& slots, int64_t slot_stride, const at::Tensor& lens, double scale,
                     const at::Tensor& out, const at::Tensor& scratch, int64_t scratch_stride, int64_t rows,
                     int64_t heads, int64_t d_n, int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads) {
  auto kernel = w_uk.scalar_type() == at::kBFloat16 ? &mla_absorbed_decode_bf16w : &mla_absorbed_decode_f32;
  kernel(ptr<const float>(q_n), qn_t, qn_h, ptr<const float>(q_r), qr_t, qr_h, w_uk.data_ptr(), w_uv_t.data_ptr(),
         ptr<const float>(cache), ptr<const int64_t>(slots), slot_stride, ptr<const int64_t>(lens),
         static_cast<float>(scale), ptr<float>(out), ptr<float>(scratch), scratch_stride, rows, heads, d_n, d_r, d_c,
         d_v, threads);
}

void rope_store(const at::Tensor& latent, int64_t lat_ld, const at::Tensor& norm, double eps, const at::Tensor& q,
                int64_t q_t, int64_t q_h, int64_t heads, int64_t d_n, const at::Tensor& cos, const at::Tensor& sin,
                int64_t cs_ld, const at::Tensor& cache, const at::Tensor& slots, int64_t rows, int64_t d_c,
                int64_t d_r, int64_t interleave) {
  mla_rope_store_f32(ptr<const float>(latent), lat_ld, ptr<const float>(norm), static_cast<float>(eps), ptr<float>(q),
                     q_t, q_h, heads, d_n, ptr<const float>(cos), ptr<const float>(sin), cs_ld, ptr<float>(cache),
                     ptr<const int64_t>(slots), rows, d_c, d_r, interleave);
}

void gated_mlps(const at::Tensor& x, const at::Tensor& y, int64_t d, const at::Tensor& table, at::IntArrayRef ids,
                at::ArrayRef<double> weights, const at::Tensor& scratch, int64_t threads) {
  TORCH_CHECK(ids.size() == weights.size(), "gated_mlps: one weight per MLP id");
  const std::vector<float> w(weights.begin(), weights.end());
  mla_gated_mlps(ptr<const float>(x), ptr<float>(y), d, ptr<const int64_t>(table), ids.data(), w.data(),
                 static_cast<int64_t>(ids.size()), ptr<float>(scratch), threads);
}

void moe_row(const at::Tensor& x, const at::Tensor& y, int64_t d, const at::Tensor& router, const at::Tensor& route,
             const c10::optional<at::Tensor>& bias, double scaling, const at::Tensor& table, int64_t first,
             int64_t count, int64_t shared, const at::Tensor& scratch, int64_t max_inter, int64_t threads) {
  mla_moe_row(ptr<const float>(x), ptr<float>(y), d, ptr<const float>(router), ptr<const int64_t>(route),
              ptr<const float>(bias), static_cast<float>(scaling), ptr<const int64_t>(table), first, count, shared,
              ptr<float>(scratch), max_inter, threads);
}

int64_t decoder_layer_scratch(const at::Tensor& layer, const at::Tensor& step) {
  return mla_decoder_layer_scratch(ptr<const int64_t>(layer), ptr<const int64_t>(step));
}

int64_t decoder_layer(const at::Tensor& layer, const at::Tensor& step, const at::Tensor& x, const at::Tensor& cache,
                      const at::Tensor& scratch) {
  return mla_decoder_layer(ptr<const int64_t>(layer), ptr<const int64_t>(step), ptr<float>(x), ptr<float>(cache),
                           ptr<float>(scratch));
}

int64_t i8_variants() { return mla_i8_variants(); }
void i8_select(int64_t variant) { mla_i8_select(variant); }
int64_t i4_variants() { return mla_i4_variants(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(mla_kernels, m) {
  m.def("gemv_f32(Tensor w, Tensor x, Tensor(a!) y, int n, int k, int threads) -> ()");
  m.def("gemv_bf16(Tensor w, Tensor x, Tensor(a!) y, int n, int k, int threads) -> ()");
  m.def("gemv_i8(Tensor w, Tensor scale, Tensor x, Tensor(a!) y, int n, int k, int threads) -> ()");
  m.def("gemm_few_f32(Tensor w, Tensor x, Tensor(a!) y, int m, int n, int k, int threads) -> ()");
  m.def("gemm_few_bf16(Tensor w, Tensor x, Tensor(a!) y, int m, int n, int k, int threads) -> ()");
  m.def("gemm_few_i8(Tensor w, Tensor scale, Tensor x, Tensor(a!) y, int m, int n, int k, int threads) -> ()");
  m.def("gemm_fp8(Tensor w, Tensor scale, int bn, int bk, Tensor x, Tensor(a!) y, int m, int n, int k, "
        "int threads) -> ()");
  m.def("gemm_i4(Tensor w, Tensor scales, Tensor x, Tensor(a!) y, int rows, int n, int k, int threads, "
        "int variant) -> ()");
  m.def("i4_from_stored(Tensor src, Tensor(a!) dst, int groups, int threads) -> ()");
  m.def("rms_norm_f32(Tensor x, int ld, Tensor weight, Tensor(a!) y, int m, int k, float eps) -> ()");
  m.def("absorbed_decode(Tensor q_n, int qn_t, int qn_h, Tensor q_r, int qr_t, int qr_h, Tensor w_uk, "
        "Tensor w_uv_t, Tensor cache, Tensor slots, int slot_stride, Tensor lens, float scale, Tensor(a!) out, "
        "Tensor(b!) scratch, int scratch_stride, int rows, int heads, int d_n, int d_r, int d_c, int d_v, "
        "int threads) -> ()");
  m.def("rope_store(Tensor latent, int lat_ld, Tensor norm, float eps, Tensor(a!) q, int q_t, int q_h, int heads, "
        "int d_n, Tensor cos, Tensor sin, int cs_ld, Tensor(b!) cache, Tensor slots, int rows, int d_c, int d_r, "
        "int interleave) -> ()");
  m.def("gated_mlps(Tensor x, Tensor(a!) y, int d, Tensor table, int[] ids, float[] weights, Tensor(b!) scratch, "
        "int threads) -> ()");
  m.def("moe_row(Tensor x, Tensor(a!) y, int d, Tensor router, Tensor route, Tensor? bias, float scaling, "
        "Tensor table, int first, int count, int shared, Tensor(b!) scratch, int max_inter, int threads) -> ()");
  m.def("decoder_layer_scratch(Tensor layer, Tensor step) -> int");
  m.def("decoder_layer(Tensor layer, Tensor step, Tensor(a!) x, Tensor(b!) cache, Tensor(c!) scratch) -> int");
  m.def("i8_variants() -> int", &i8_variants);
  m.def("i8_select(int variant) -> ()", &i8_select);
  m.def("i4_variants() -> int", &i4_variants);
}

TORCH_LIBRARY_IMPL(mla_kernels, CPU, m) {
  m.impl("gemv_f32", &gemv_f32);
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_i8", &gemv_i8);
  m.impl("gemm_few_f32", &gemm_few_f32);
  m.impl("gemm_few_bf16", &gemm_few_bf16);
  m.impl("gemm_few_i8", &gemm_few_i8);
  m.impl("gemm_fp8", &gemm_fp8);
  m.impl("gemm_i4", &gemm_i4);
  m.impl("i4_from_stored", &i4_from_stored);
  m.impl("rms_norm_f32", &rms_norm_f32);
  m.impl("absorbed_decode", &absorbed_decode);
  m.impl("rope_store", &rope_store);
  m.impl("gated_mlps", &gated_mlps);
  m.impl("moe_row", &moe_row);
  m.impl("decoder_layer_scratch", &decoder_layer_scratch);
  m.impl("decoder_layer", &decoder_layer);
}
