// The linear-attention layers' gated delta rule (layers/kda.py) as typed torch operators, every architecture:
//
//   mla_kernels::delta_rule_step(q, k, g [B, H, d_k] f32, v [B, H, d_v] f32, beta [B, H] f32,
//                                state [N, H, d_k, d_v] f32 (updated in place), slots [B] i64,
//                                str variant="auto") -> o [B, H, d_v] f32
//       one token of B sequences, sequence b's state in state[slots[b]] (layers/delta_rule.recurrent_step with q, k
//       prepared and g the log forget gate, <= 0); the state slots are read and written where they lie, so no
//       gather or scatter of the states
//   mla_kernels::delta_rule_prefill(q, k, g [T, H, d_k] f32, v [T, H, d_v] f32, beta [T, H] f32,
//                                   state [N, H, d_k, d_v] f32 (updated in place), slots [S] i64, cu [S + 1] i64,
//                                   str variant="auto", int block=16) -> o [T, H, d_v] f32
//       the tokens cu[s] .. cu[s + 1] of sequence s (a prompt or a prefill chunk), in order, from its state
//       state[slots[s]] (the caller zeroes a fresh sequence's slot), in the chunked (WY) form of
//       layers/delta_rule.chunked, `block` tokens a block (1 .. 64): a triangular solve and products over the block
//       (../delta_rule.h, wy_block) in place of a loop over its tokens; block=0 runs the one-token update token after
//       token instead (delta_rule_step's, for comparison). Each (sequence, head) pair is a piece of work with its
//       state in cache; the same outputs and state as layers/delta_rule.chunked to float32 rounding
//   mla_kernels::short_conv_step(x [B, C] f32, conv [N, C, K - 1] f32 (updated in place), weight [C, K] f32,
//                                slots [B] i64) -> [B, C] f32
//       the causal depthwise convolution of one new input per sequence over its window [conv[slots[b]] ; x[b]],
//       silu applied; the window's last K - 1 inputs written back to conv[slots[b]]
//   mla_kernels::delta_rule_variants() -> str[]   "name:runs", "name:above the ISA cap" or "name:cannot run here"
//
// The rule (../delta_rule.h: the one-token update and the WY block) is written once over the vector vocabulary and
// compiled for AVX-512 (x86-64), AVX2 + FMA (x86-64) and the portable one-lane vocabulary (../vec_scalar.h, any
// architecture); "auto" runs the widest the CPU executes under MLA_CPU_ISA's cap (../isa_cap.h, the one probe
// ../cpu_features.c). Each (sequence, head) pair is one piece of work over torch's thread pool. The convolution is
// C++ over the channels (four taps a channel: no vector of its own).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../isa_cap.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MAX_DK = 1024;    // key channels of a head (the decay's stack buffer)
constexpr int64_t MAX_BLOCK = 64;   // tokens a block of the chunked form may take

using HeadFn = void (*)(float*, const float*, const float*, const float*, const float*, float, float*, float*,
                        int64_t, int64_t);

// One block of the chunked form (../delta_rule.h, wy_block): c tokens, their rows padded with zeros to cr (a multiple
// of 4), the key channels to dkp (of 16), the state columns to dvp (of 32), the pairs' columns to cw (of 16). q, k, g
// copied into qs, ks, gs [cr, dkp]; v and beta read in place (token t at v + t v_stride, beta + t beta_stride); the
// state S [dkp, dvp]; the rest scratch (WyScratch), the outputs left in o [cr, dvp].
struct WyBlock {
  int64_t c, cr, cw, dk, dv, dkp, dvp;
  const float *v, *beta;
  int64_t v_stride, beta_stride;
  float *S, *qs, *ks, *gs, *kd, *qd, *kl, *e, *egc, *wt, *a, *b, *u, *o;
};

using BlockFn = void (*)(const WyBlock&);

#include "../vec_scalar.h"
#include "../delta_rule.h"
#include "../vec_end.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "../vec_exp.h"
#include "../vec_avx2.h"
#include "../delta_rule.h"
#include "../vec_end.h"
#include "../vec_avx512.h"
#include "../delta_rule.h"
#include "../vec_end.h"
#endif

struct Variant {
  const char* name;
  HeadFn fn;
  BlockFn block;
  bool runs;      // the CPU executes it
  int64_t level;  // its instruction-set level: it runs only where the process's cap allows it
  bool allowed() const { return runs && mla_isa_allows(level); }
};

// widest first
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = [] {
    std::vector<Variant> v;
#if defined(__x86_64__) && defined(__GNUC__)
    v.push_back({"avx512", &delta_head_avx512, &wy_block_avx512, mla_cpu_has(MLA_CPU_AVX512) != 0,
                  MLA_ISA_AVX512});
    v.push_back({"avx2", &delta_head_avx2, &wy_block_avx2, mla_cpu_has(MLA_CPU_AVX2) != 0, MLA_ISA_AVX2});
#endif
    v.push_back({"generic", &delta_head_generic, &wy_block_generic, true, MLA_ISA_BASE});
    return v;
  }();
  return all;
}

const Variant& pick(const std::string& name) {
  for (const Variant& v : variants()) {
    if (name == "auto" ? v.allowed() : name == v.name) {
      TORCH_CHECK_VALUE(v.runs, "delta_rule_step: this CPU cannot run the ", v.name, " variant");
      TORCH_CHECK_VALUE(v.allowed(), "delta_rule_step: this process (capped by MLA_CPU_ISA) cannot run the ", v.name,
                        " variant");
      return v;
    }
  }
  TORCH_CHECK_VALUE(false, "delta_rule_step: unknown variant '", name, "' (see mla_kernels::delta_rule_variants)");
}

std::vector<std::string> delta_rule_variants() {
  std::vector<std::string> out;
  for (const Variant& v : variants())
    out.push_back(std::string(v.name) + (v.allowed() ? ":runs" : v.runs ? ":above the ISA cap" : ":cannot run here"));
  return out;
}

void check_f32(const at::Tensor& t, const char* op, const char* name, std::initializer_list<int64_t> shape) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes().equals(shape), op, ": ", name, " must be ", at::IntArrayRef(shape), ", got ",
                    t.sizes());
}

// slots [B] int64, each a distinct index below n (two rows of one slot would race)
const int64_t* checked_slots(const at::Tensor& slots, int64_t rows, int64_t n, const char* op) {
  TORCH_CHECK_VALUE(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                        slots.size(0) == rows && slots.is_contiguous(),
                    op, ": slots must be a contiguous int64 CPU tensor [", rows, "], got ", slots.scalar_type(), " ",
                    slots.sizes());
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<char> seen(static_cast<size_t>(n), 0);
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK_VALUE(sp[b] >= 0 && sp[b] < n, op, ": slots[", b, "] = ", sp[b], " is outside the state's ", n,
                      " slots");
    TORCH_CHECK_VALUE(!seen[sp[b]], op, ": slot ", sp[b], " appears twice in one call");
    seen[sp[b]] = 1;
  }
  return sp;
}

at::Tensor delta_rule_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots,
                           c10::string_view variant) {
  const char* op = "delta_rule_step";
  const Variant& fn = pick(std::string(variant));
  TORCH_CHECK_VALUE(q.dim() == 3 && v.dim() == 3 && state.dim() == 4, op,
                    ": q, k, g must be [B, H, d_k], v [B, H, d_v], state [N, H, d_k, d_v]");
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2), n = state.size(0);
  TORCH_CHECK_VALUE(dk >= 1 && dk <= MAX_DK && dv >= 1, op, ": d_k must be 1..", MAX_DK, " and d_v >= 1");
  check_f32(q, op, "q", {rows, heads, dk});
  check_f32(k, op, "k", {rows, heads, dk});
  check_f32(g, op, "g", {rows, heads, dk});
  check_f32(v, op, "v", {rows, heads, dv});
  check_f32(beta, op, "beta", {rows, heads});
  check_f32(state, op, "state", {n, heads, dk, dv});
  TORCH_CHECK_VALUE(state.is_contiguous(), op, ": state must be contiguous (it is updated in place)");
  const int64_t* sp = checked_slots(slots, rows, n, op);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), gc = g.contiguous(), vc = v.contiguous();
  const at::Tensor bc = beta.contiguous();
  at::Tensor out = at::empty({rows, heads, dv}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *gp = gc.data_ptr<float>();
  const float *vp = vc.data_ptr<float>(), *bp = bc.data_ptr<float>();
  float *stp = state.data_ptr<float>(), *op_ = out.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(2 * dv));
    float decay[MAX_DK];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b = p / heads, h = p % heads;
      for (int64_t i = 0; i < dk; ++i) decay[i] = std::exp(gp[p * dk + i]);
      fn.fn(stp + (sp[b] * heads + h) * dk * dv, qp + p * dk, kp + p * dk, decay, vp + p * dv, bp[p],
            op_ + p * dv, scratch.data(), dk, dv);
    }
  });
  return out;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One thread's scratch for the chunked form, blocks of up to `block` tokens: the padded state and a block's operands.
struct WyScratch {
  std::vector<float> buf;
  WyBlock w{};

  WyScratch(int64_t block, int64_t dk, int64_t dv) {
    const int64_t dkp = round_up(dk, 16), dvp = round_up(dv, 32), rows = round_up(block, 4), cols = round_up(block, 16);
    buf.assign(static_cast<size_t>(dkp * dvp + 7 * rows * dkp + dkp + dkp * cols + 2 * rows * cols + 2 * rows * dvp),
               0.0f);
    float* p = buf.data();
    auto take = [&p](int64_t n) { float* at = p; p += n; return at; };
    w.dk = dk, w.dv = dv, w.dkp = dkp, w.dvp = dvp;
    w.S = take(dkp * dvp);
    for (float** x : {&w.qs, &w.ks, &w.gs, &w.kd, &w.qd, &w.kl, &w.e}) *x = take(rows * dkp);
    w.egc = take(dkp), w.wt = take(dkp * cols), w.a = take(rows * cols), w.b = take(rows * cols);
    w.u = take(rows * dvp), w.o = take(rows * dvp);
  }
};

// The prefill's operands: rows [T, H, ...] contiguous, the state [N, H, d_k, d_v].
struct Prefill {
  const float *q, *k, *g, *v, *beta;
  float *state, *out;
  int64_t heads, dk, dv;
};

// Rows a .. a + c - 1 of head h into the block (padded with zeros), the block's pairs zeroed.
void load_block(WyBlock& w, const Prefill& p, int64_t a, int64_t c, int64_t h) {
  w.c = c, w.cr = round_up(c, 4), w.cw = round_up(c, 16);
  for (int64_t t = 0; t < w.cr; ++t) {
    float* dst[3] = {w.qs + t * w.dkp, w.ks + t * w.dkp, w.gs + t * w.dkp};
    const float* src[3] = {p.q, p.k, p.g};
    const int64_t real = t < c ? p.dk : 0, row = t < c ? ((a + t) * p.heads + h) * p.dk : 0;
    for (int x = 0; x < 3; ++x) {
      std::copy(src[x] + row, src[x] + row + real, dst[x]);
      std::fill(dst[x] + real, dst[x] + w.dkp, 0.0f);
    }
  }
  std::fill(w.wt, w.wt + w.dkp * w.cw, 0.0f);
  std::fill(w.a, w.a + w.cr * w.cw, 0.0f);
  std::fill(w.b, w.b + w.cr * w.cw, 0.0f);
  w.v = p.v + (a * p.heads + h) * p.dv, w.beta = p.beta + a * p.heads + h;
  w.v_stride = p.heads * p.dv, w.beta_stride = p.heads;
}

// Tokens first .. last - 1 of head h from the state st [d_k, d_v] in blocks of `block` (the chunked form).
void wy_piece(BlockFn fn, WyBlock& w, const Prefill& p, float* st, int64_t first, int64_t last, int64_t h,
              int64_t block) {
  for (int64_t i = 0; i < w.dkp; ++i)
    for (int64_t j = 0; j < w.dvp; ++j) w.S[i * w.dvp + j] = i < p.dk && j < p.dv ? st[i * p.dv + j] : 0.0f;
  for (int64_t a = first; a < last; a += block) {
    const int64_t c = std::min(block, last - a);
    load_block(w, p, a, c, h);
    fn(w);
    for (int64_t t = 0; t < c; ++t)
      std::copy(w.o + t * w.dvp, w.o + t * w.dvp + p.dv, p.out + ((a + t) * p.heads + h) * p.dv);
  }
  for (int64_t i = 0; i < p.dk; ++i) std::copy(w.S + i * w.dvp, w.S + i * w.dvp + p.dv, st + i * p.dv);
}

// Tokens first .. last - 1 of head h from the state st, token after token (delta_rule_step's update).
void token_piece(HeadFn fn, const Prefill& p, float* st, int64_t first, int64_t last, int64_t h, float* scratch) {
  float decay[MAX_DK];
  for (int64_t t = first; t < last; ++t) {
    const int64_t r = t * p.heads + h;
    for (int64_t i = 0; i < p.dk; ++i) decay[i] = std::exp(p.g[r * p.dk + i]);
    fn(st, p.q + r * p.dk, p.k + r * p.dk, decay, p.v + r * p.dv, p.beta[r], p.out + r * p.dv, scratch, p.dk, p.dv);
  }
}

// cu [S + 1] int64 from 0 to the rows, not decreasing
const int64_t* checked_cu(const at::Tensor& cu, int64_t rows, const char* op) {
  TORCH_CHECK_VALUE(cu.device().is_cpu() && cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.size(0) >= 1 &&
                        cu.is_contiguous(),
                    op, ": cu must be a contiguous int64 CPU tensor [S + 1]");
  const int64_t seqs = cu.size(0) - 1;
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(cp[0] == 0 && cp[seqs] == rows, op, ": cu must run from 0 to the ", rows, " tokens, got ", cp[0],
                    " .. ", cp[seqs]);
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK_VALUE(cp[s] <= cp[s + 1], op, ": cu must not decrease (cu[", s, "] = ", cp[s], " > cu[", s + 1,
                      "] = ", cp[s + 1], ")");
  return cp;
}

at::Tensor delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, const at::Tensor& cu,
                              c10::string_view variant, int64_t block) {
  const char* op = "delta_rule_prefill";
  const Variant& fn = pick(std::string(variant));
  TORCH_CHECK_VALUE(block >= 0 && block <= MAX_BLOCK, op, ": block must be 0 (token after token) .. ", MAX_BLOCK,
                    ", got ", block);
  TORCH_CHECK_VALUE(q.dim() == 3 && v.dim() == 3 && state.dim() == 4, op,
                    ": q, k, g must be [T, H, d_k], v [T, H, d_v], state [N, H, d_k, d_v]");
  const int64_t rows = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2), n = state.size(0);
  TORCH_CHECK_VALUE(dk >= 1 && dk <= MAX_DK && dv >= 1, op, ": d_k must be 1..", MAX_DK, " and d_v >= 1");
  check_f32(q, op, "q", {rows, heads, dk});
  check_f32(k, op, "k", {rows, heads, dk});
  check_f32(g, op, "g", {rows, heads, dk});
  check_f32(v, op, "v", {rows, heads, dv});
  check_f32(beta, op, "beta", {rows, heads});
  check_f32(state, op, "state", {n, heads, dk, dv});
  TORCH_CHECK_VALUE(state.is_contiguous(), op, ": state must be contiguous (it is updated in place)");
  const int64_t* cp = checked_cu(cu, rows, op);
  const int64_t seqs = cu.size(0) - 1;
  const int64_t* sp = checked_slots(slots, seqs, n, op);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), gc = g.contiguous(), vc = v.contiguous();
  const at::Tensor bc = beta.contiguous();
  at::Tensor out = at::empty({rows, heads, dv}, q.options());
  const Prefill p{qc.data_ptr<float>(), kc.data_ptr<float>(), gc.data_ptr<float>(), vc.data_ptr<float>(),
                  bc.data_ptr<float>(), state.data_ptr<float>(), out.data_ptr<float>(), heads, dk, dv};
  at::parallel_for(0, seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<WyScratch> wy;
    std::vector<float> scratch(static_cast<size_t>(2 * dv));
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t s = piece / heads, h = piece % heads;
      float* st = p.state + (sp[s] * heads + h) * dk * dv;
      if (cp[s] == cp[s + 1]) continue;
      if (block == 0) {
        token_piece(fn.fn, p, st, cp[s], cp[s + 1], h, scratch.data());
        continue;
      }
      if (!wy) wy = std::make_unique<WyScratch>(block, dk, dv);
      wy_piece(fn.block, wy->w, p, st, cp[s], cp[s + 1], h, block);
    }
  });
  return out;
}

at::Tensor short_conv_step(const at::Tensor& x, at::Tensor& conv, const at::Tensor& weight, const at::Tensor& slots) {
  const char* op = "short_conv_step";
  TORCH_CHECK_VALUE(x.dim() == 2 && conv.dim() == 3 && weight.dim() == 2, op,
                    ": x must be [B, C], conv [N, C, K - 1], weight [C, K]");
  const int64_t rows = x.size(0), channels = x.size(1), kernel = weight.size(1), n = conv.size(0);
  TORCH_CHECK_VALUE(kernel >= 2, op, ": the convolution needs at least 2 taps, got ", kernel);
  check_f32(x, op, "x", {rows, channels});
  check_f32(conv, op, "conv", {n, channels, kernel - 1});
  check_f32(weight, op, "weight", {channels, kernel});
  TORCH_CHECK_VALUE(conv.is_contiguous(), op, ": conv must be contiguous (it is updated in place)");
  const int64_t* sp = checked_slots(slots, rows, n, op);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty({rows, channels}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float *cp = conv.data_ptr<float>(), *yp = out.data_ptr<float>();
  const int64_t past = kernel - 1;
  at::parallel_for(0, rows * channels, 256, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b = p / channels, c = p % channels;
      float* window = cp + (sp[b] * channels + c) * past;
      const float* w = wp + c * kernel;
      float acc = 0.0f;
      for (int64_t j = 0; j < past; ++j) acc += window[j] * w[j];
      acc += xp[p] * w[past];
      for (int64_t j = 0; j + 1 < past; ++j) window[j] = window[j + 1];
      window[past - 1] = xp[p];
      yp[p] = acc / (1.0f + std::exp(-acc));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mla_kernels, m) {
  m.def("delta_rule_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots, "
        "str variant=\"auto\") -> Tensor");
  m.def("delta_rule_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots, "
        "Tensor cu, str variant=\"auto\", int block=16) -> Tensor");
  m.def("short_conv_step(Tensor x, Tensor(a!) conv, Tensor weight, Tensor slots) -> Tensor");
  m.def("delta_rule_variants() -> str[]", &delta_rule_variants);
}

TORCH_LIBRARY_IMPL(mla_kernels, CPU, m) {
  m.impl("delta_rule_step", &delta_rule_step);
  m.impl("delta_rule_prefill", &delta_rule_prefill);
  m.impl("short_conv_step", &short_conv_step);
}
