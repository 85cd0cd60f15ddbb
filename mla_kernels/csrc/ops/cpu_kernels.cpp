// The compiled CPU kernels (../mla_cpu.h) as typed torch operators, mla_kernels::<name>. Each operator takes the
// kernel's arguments with its buffers as tensors (mutated ones marked in the schema) and calls it on torch's thread
// pool. The products and the norm refuse sizes their tensors do not hold; the attention, the latent side and the
// table-driven kernels trust mla_kernels.cpu_gemv, which checks every shape before calling them. The table-driven kernels (gated MLPs, the
// MoE row, the whole decoder layer) read int64 tables of pointers and sizes whose layout ../mla_cpu.h defines; the
// builders here (mlp_table, layer_table, step_table) fill them from typed arguments, so no other file knows the
// layout. The tables point into the tensors they were built from: the caller keeps those alive. Registered
// operators show under their names in the profiler and are checked by the dispatcher.

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

// A product's buffers hold what its sizes say: a contiguous CPU tensor of the dtype with at least that many elements
// (a call with sizes beyond its tensors is refused, never read past them).
void check(const at::Tensor& t, at::ScalarType dtype, int64_t elements, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() >= elements,
                    op, ": ", name, " must be a contiguous CPU ", dtype, " tensor of at least ", elements,
                    " values, got ", t.scalar_type(), " ", t.sizes());
}

void check_product(const char* op, const at::Tensor& x, const at::Tensor& y, int64_t m, int64_t n, int64_t k) {
  TORCH_CHECK_VALUE(m >= 1 && n >= 0 && k >= 0, op, ": sizes m ", m, ", n ", n, ", k ", k);
  check(x, at::kFloat, m * k, op, "x");
  check(y, at::kFloat, m * n, op, "y");
}

int64_t i4_padded(int64_t k) { return (k + 31) / 32 * 32; }

void gemv_f32(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t n, int64_t k, int64_t threads) {
  check_product("gemv_f32", x, y, 1, n, k);
  check(w, at::kFloat, n * k, "gemv_f32", "w");
  mla_gemv_f32(ptr<const float>(w), ptr<const float>(x), ptr<float>(y), n, k, threads);
}

void gemv_bf16(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t n, int64_t k, int64_t threads) {
  check_product("gemv_bf16", x, y, 1, n, k);
  check(w, at::kBFloat16, n * k, "gemv_bf16", "w");
  mla_gemv_bf16(ptr<const uint16_t>(w), ptr<const float>(x), ptr<float>(y), n, k, threads);
}

void gemv_i8(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& x, const at::Tensor& y, int64_t n,
             int64_t k, int64_t threads) {
  check_product("gemv_i8", x, y, 1, n, k);
  check(w, at::kChar, n * k, "gemv_i8", "w");
  check(scale, at::kFloat, n, "gemv_i8", "scale");
  mla_gemv_i8(ptr<const int8_t>(w), ptr<const float>(scale), ptr<const float>(x), ptr<float>(y), n, k, threads);
}

void gemm_few_f32(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t m, int64_t n, int64_t k,
                  int64_t threads) {
  check_product("gemm_few_f32", x, y, m, n, k);
  check(w, at::kFloat, n * k, "gemm_few_f32", "w");
  mla_gemm_few_f32(ptr<const float>(w), ptr<const float>(x), ptr<float>(y), m, n, k, threads);
}

void gemm_few_bf16(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, int64_t m, int64_t n, int64_t k,
                   int64_t threads) {
  check_product("gemm_few_bf16", x, y, m, n, k);
  check(w, at::kBFloat16, n * k, "gemm_few_bf16", "w");
  mla_gemm_few_bf16(ptr<const uint16_t>(w), ptr<const float>(x), ptr<float>(y), m, n, k, threads);
}

void gemm_few_i8(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& x, const at::Tensor& y, int64_t m,
                 int64_t n, int64_t k, int64_t threads) {
  check_product("gemm_few_i8", x, y, m, n, k);
  check(w, at::kChar, n * k, "gemm_few_i8", "w");
  check(scale, at::kFloat, n, "gemm_few_i8", "scale");
  mla_gemm_few_i8(ptr<const int8_t>(w), ptr<const float>(scale), ptr<const float>(x), ptr<float>(y), m, n, k, threads);
}

void gemm_fp8(const at::Tensor& w, const at::Tensor& scale, int64_t bn, int64_t bk, const at::Tensor& x,
              const at::Tensor& y, int64_t m, int64_t n, int64_t k, int64_t threads) {
  check_product("gemm_fp8", x, y, m, n, k);
  TORCH_CHECK_VALUE(bn >= 1 && bk >= 1, "gemm_fp8: blocks of ", bn, " x ", bk);
  check(w, at::kFloat8_e4m3fn, n * k, "gemm_fp8", "w");
  check(scale, at::kFloat, ((n + bn - 1) / bn) * ((k + bk - 1) / bk), "gemm_fp8", "scale");
  mla_gemm_fp8(ptr<const uint8_t>(w), ptr<const float>(scale), bn, bk, ptr<const float>(x), ptr<float>(y), m, n, k,
               threads);
}

void gemm_i4(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& x, const at::Tensor& y, int64_t rows,
             int64_t n, int64_t k, int64_t threads, int64_t variant) {
  check_product("gemm_i4", x, y, rows, n, k);
  check(w, at::kByte, n * i4_padded(k) / 2, "gemm_i4", "w");
  check(scales, at::kHalf, n * i4_padded(k) / 32, "gemm_i4", "scales");
  TORCH_CHECK_VALUE(variant >= 0 && (mla_i4_variants() >> variant & 1), "gemm_i4: variant ", variant,
                    " does not run on this CPU");
  mla_gemm_i4(ptr<const uint8_t>(w), ptr<const uint16_t>(scales), ptr<const float>(x), ptr<float>(y), rows, n, k,
              threads, variant);
}

void i4_from_stored(const at::Tensor& src, const at::Tensor& dst, int64_t groups, int64_t threads) {
  check(src, at::kByte, 16 * groups, "i4_from_stored", "src");
  check(dst, at::kByte, 16 * groups, "i4_from_stored", "dst");
  mla_i4_from_stored(ptr<const uint8_t>(src), ptr<uint8_t>(dst), groups, threads);
}

void rms_norm_f32(const at::Tensor& x, int64_t ld, const at::Tensor& weight, const at::Tensor& y, int64_t m,
                  int64_t k, double eps) {
  TORCH_CHECK_VALUE(m >= 0 && k >= 0 && ld >= k, "rms_norm_f32: sizes m ", m, ", k ", k, ", row stride ", ld);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == m &&
                        x.size(1) == k && (m <= 1 || x.stride(0) == ld) && (k <= 1 || x.stride(1) == 1),
                    "rms_norm_f32: x must be float32 CPU rows [", m, ", ", k, "] ", ld, " apart, got ", x.sizes(),
                    " with strides ", x.strides());
  check(weight, at::kFloat, k, "rms_norm_f32", "weight");
  check(y, at::kFloat, m * k, "rms_norm_f32", "y");
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

// -- the tables of the table-driven kernels, built from typed arguments (their layouts: ../mla_cpu.h) ------------

int64_t address(const at::Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())); }

int64_t address(const c10::optional<at::Tensor>& t) { return t.has_value() ? address(*t) : 0; }

// A weight operand's three fields: its weight, its scales and its kind, from the weight's dtype.
void operand(int64_t* out, const at::Tensor& w, const c10::optional<at::Tensor>& scales, int64_t i4_variant,
             const char* name) {
  int64_t kind = 0;
  switch (w.scalar_type()) {
    case at::kFloat: kind = W_F32; break;
    case at::kBFloat16: kind = W_BF16; break;
    case at::kChar: kind = W_I8; break;
    case at::kByte: kind = W_I4 + i4_variant; break;
    default: TORCH_CHECK(false, name, ": weights are float32, bfloat16, int8 or packed int4, got ", w.scalar_type());
  }
  const bool scaled = kind == W_I8 || (kind >= W_I4 && kind != W_BF16);
  TORCH_CHECK(scaled == scales.has_value(), name, ": int8 and int4 weights come with their scales, the others without");
  out[0] = address(w);
  out[1] = address(scales);
  out[2] = kind;
}

// [n, MLP_FIELDS]: each gated MLP's gate_up [2 I, d] and down [d, I] operands and I.
at::Tensor mlp_table(at::TensorList gate_up, const c10::List<c10::optional<at::Tensor>>& gate_up_scales,
                     at::TensorList down, const c10::List<c10::optional<at::Tensor>>& down_scales, int64_t i4_variant) {
  const int64_t n = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(n >= 1 && down.size() == gate_up.size() && gate_up_scales.size() == gate_up.size() &&
                  down_scales.size() == gate_up.size(),
              "mlp_table: one gate_up, down and scales (or None) per MLP");
  at::Tensor table = at::zeros({n, MLP_FIELDS}, at::kLong);
  int64_t* row = table.data_ptr<int64_t>();
  for (int64_t e = 0; e < n; ++e, row += MLP_FIELDS) {
    operand(row, gate_up[e], gate_up_scales.get(e), i4_variant, "mlp_table: gate_up");
    operand(row + 3, down[e], down_scales.get(e), i4_variant, "mlp_table: down");
    row[6] = gate_up[e].size(0) / 2;
  }
  return table;
}

// [L_FIELDS]: a decoder layer's weights (../mla_cpu.h, enum LayerField); dims: d, q_lora, heads, d_n, d_r, d_c, d_v.
at::Tensor layer_table(const at::Tensor& in_norm, const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm,
                       const at::Tensor& kv_norm, const at::Tensor& qa, const c10::optional<at::Tensor>& qa_scales,
                       const c10::optional<at::Tensor>& kva, const c10::optional<at::Tensor>& kva_scales,
                       const c10::optional<at::Tensor>& qb, const c10::optional<at::Tensor>& qb_scales,
                       const at::Tensor& w_uk, const at::Tensor& w_uv_t, const at::Tensor& o,
                       const c10::optional<at::Tensor>& o_scales, const c10::optional<at::Tensor>& mlp,
                       int64_t max_inter, const c10::optional<at::Tensor>& router,
                       const c10::optional<at::Tensor>& route, const c10::optional<at::Tensor>& route_bias,
                       int64_t first, int64_t count, int64_t shared, at::IntArrayRef dims, bool interleave,
                       const at::Tensor& floats, int64_t i4_variant) {
  TORCH_CHECK(dims.size() == 7, "layer_table: dims are d, q_lora, heads, d_n, d_r, d_c, d_v");
  TORCH_CHECK(floats.scalar_type() == at::kFloat && floats.numel() == 6 && floats.is_contiguous(),
              "layer_table: floats are the four norms' eps, the softmax scale and the routed scaling factor");
  at::Tensor table = at::zeros({L_FIELDS}, at::kLong);
  int64_t* L = table.data_ptr<int64_t>();
  L[L_IN_NORM] = address(in_norm);
  L[L_POST_NORM] = address(post_norm);
  L[L_Q_NORM] = address(q_norm);
  L[L_KV_NORM] = address(kv_norm);
  operand(L + L_QA_W, qa, qa_scales, i4_variant, "layer_table: qa");
  if (kva.has_value()) operand(L + L_KVA_W, *kva, kva_scales, i4_variant, "layer_table: kva");
  if (qb.has_value()) operand(L + L_QB_W, *qb, qb_scales, i4_variant, "layer_table: qb");
  L[L_W_UK] = address(w_uk);
  L[L_W_UV_T] = address(w_uv_t);
  L[L_W_BF16] = w_uk.scalar_type() == at::kBFloat16;
  operand(L + L_O_W, o, o_scales, i4_variant, "layer_table: o");
  L[L_MLP_TABLE] = address(mlp);
  L[L_MAX_INTER] = max_inter;
  L[L_ROUTER] = address(router);
  L[L_ROUTE] = address(route);
  L[L_ROUTE_BIAS] = address(route_bias);
  L[L_FIRST] = first;
  L[L_COUNT] = count;
  L[L_SHARED] = shared;
  const int fields[7] = {L_D, L_Q_LORA, L_HEADS, L_D_N, L_D_R, L_D_C, L_D_V};
  for (int i = 0; i < 7; ++i) L[fields[i]] = dims[i];
  L[L_INTERLEAVE] = interleave;
  L[L_FLOATS] = address(floats);
  return table;
}

// [S_FIELDS]: a decode step's rows (../mla_cpu.h, enum StepField).
at::Tensor step_table(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& keys,
                      const at::Tensor& lens, int64_t threads, int64_t decode_threads, int64_t decode_stride) {
  at::Tensor table = at::zeros({S_FIELDS}, at::kLong);
  int64_t* S = table.data_ptr<int64_t>();
  S[S_ROWS] = slots.size(0);
  S[S_COS] = address(cos);
  S[S_SIN] = address(sin);
  S[S_CS_LD] = cos.stride(0);
  S[S_SLOTS] = address(slots);
  S[S_KEYS] = address(keys);
  S[S_KEY_STRIDE] = keys.stride(0);
  S[S_LENS] = address(lens);
  S[S_THREADS] = threads;
  S[S_DECODE_THREADS] = decode_threads;
  S[S_DECODE_STRIDE] = decode_stride;
  return table;
}

std::vector<int64_t> table_widths() { return {MLP_FIELDS, L_FIELDS, S_FIELDS}; }

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
  m.def("mlp_table(Tensor[] gate_up, Tensor?[] gate_up_scales, Tensor[] down, Tensor?[] down_scales, "
        "int i4_variant) -> Tensor");
  m.def("layer_table(Tensor in_norm, Tensor post_norm, Tensor? q_norm, Tensor kv_norm, Tensor qa, "
        "Tensor? qa_scales, Tensor? kva, Tensor? kva_scales, Tensor? qb, Tensor? qb_scales, Tensor w_uk, "
        "Tensor w_uv_t, Tensor o, Tensor? o_scales, Tensor? mlp, int max_inter, Tensor? router, Tensor? route, "
        "Tensor? route_bias, int first, int count, int shared, int[] dims, bool interleave, Tensor floats, "
        "int i4_variant) -> Tensor");
  m.def("step_table(Tensor cos, Tensor sin, Tensor slots, Tensor keys, Tensor lens, int threads, "
        "int decode_threads, int decode_stride) -> Tensor");
  m.def("table_widths() -> int[]", &table_widths);  // the builders' table widths (shape functions read them)
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
  m.impl("mlp_table", &mlp_table);
  m.impl("layer_table", &layer_table);
  m.impl("step_table", &step_table);
}
