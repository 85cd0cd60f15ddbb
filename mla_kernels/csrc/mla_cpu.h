/* The entry points of the compiled CPU kernels (gemv_f32.c, gemv_fp8.c, gemv_int4.c, gemv_ggml.c, gemm_w8a8.c,
 * gemm_fp4.c, amx_bf16.c, amx_int8.c, mla_decode_f32.c, mla_layer_f32.c). Every source includes this header, so a definition that drifts from its declaration fails the
 * build; ops/cpu_kernels.cpp registers each as a typed torch operator (mla_kernels::*). Pointers are row-major
 * buffers, sizes are element counts, "threads" the OpenMP threads a call may use. */
#ifndef MLA_CPU_H
#define MLA_CPU_H
#include <stdint.h>

#include "isa_cap.h"

/* The kernels' limits (ops/cpu_kernels.cpp refuses larger calls and reports them as mla_kernels::limits()). */
#define MLA_FEW_ROWS 8            /* rows of a product with float32 / bfloat16 / float16 weights, and of a layer call */
#define MLA_QUANT_ROWS 64         /* rows of a product with int8, FP8 or int4 weights */
#define MLA_MOE_MAX_TOPK 64       /* experts a row is routed to */
#define MLA_DECODE_MAX_GROUP 256  /* heads one thread of the absorbed decode takes */
#define MLA_PREFILL_ROWS 32       /* rows of one head a task of the prefill attention takes (its scores' rows) */
#define MLA_PREFILL_KEY_PAD 64    /* columns the prefill attention may read past the last key, and its scores hold */

/* A weight operand of the tables: its weight pointer, its scales pointer and its kind: W_F32 (float32, no scales),
 * W_I8 (int8 with a float32 scale per row; the input rows rounded to int16 with a power-of-two scale), W_BF16 / W_F16
 * (bfloat16 / float16, no scales: read at two bytes, widened exactly), W_I4 + v (group-wise int4 with float16
 * scales, gemv_int4.c, run by its variant v), W_W8A8 + v (int8 with a float32 scale per row, the input rows rounded
 * to int8 per row: gemm_w8a8.c, run by its variant v; ops/cpu_kernels.cpp tells it from W_I8 by its scales' shape,
 * [n, 1] as W8A8 checkpoints store them against int8's [n]), W_FP4 + v (E2M1 nibbles [n, k / 2]: gemm_fp4.c, run by
 * its variant v; the scales pointer is the matrix's FP4 table, FP4_FIELDS) or W_GG + v (ggml block types as a GGUF
 * file stores them, gemv_ggml.c, run by its variant v: the weight pointer is the matrix's parts table, GG_PARTS, and
 * there are no scales) or W_I4G + v (int4 nibbles in groups of 32, 64 or 128, with or without zero points:
 * gemv_int4.c's grouped products, run by its variant v; the scales pointer is the matrix's int4 table, I4G_FIELDS). Each kind's products give a row the same bits as the matrix's own product (linear,
 * w8a8_linear, fp4_linear, linear_int4, ggml_linear), alone or beside other rows. ops/cpu_kernels.cpp builds the
 * tables (mla_kernels::mlp_table, layer_table, step_table) from typed arguments. */
enum WeightKind { W_F32 = 0, W_I8 = 1, W_BF16 = 2, W_F16 = 3, W_I4 = 4, W_W8A8 = 8, W_FP4 = 12, W_GG = 16, W_I4G = 20 };
#define W_IS_I4(kind) ((kind) >= W_I4 && (kind) < W_W8A8)
#define W_IS_W8A8(kind) ((kind) >= W_W8A8 && (kind) < W_FP4)
#define W_IS_FP4(kind) ((kind) >= W_FP4 && (kind) < W_GG)
#define W_IS_GG(kind) ((kind) >= W_GG && (kind) < W_I4G)
#define W_IS_I4G(kind) ((kind) >= W_I4G)

/* The FP4 table of a matrix [n, k] (k a whole number of groups): int64 {format (FP4_MX or FP4_NV), n, k, the
 * address of its group scales [n, k / group] (MXFP4 UE8M0 bytes, NVFP4 E4M3 bytes), the address of its float32
 * global scales [n] (NVFP4; 0 for MXFP4)}. */
#define FP4_FIELDS 5
enum { FP4_MX = 0, FP4_NV = 1 }; /* gemm_fp4.c: MXFP4 (UE8M0 scales per 32) and NVFP4 (E4M3 per 16, global) */

/* The int4 table of a grouped int4 matrix [n, k] (nibbles [n, kp / 2], kp = k rounded up to 32): int64 {W_I4G (what
 * the table is), n, k, the address of its float16 scales [n, kp / group], the address of its zero points
 * [n, kp / group] (uint8 in [0, 16]; 0: none, the nibble less 8), the group (32, 64 or 128)}. */
#define I4G_FIELDS 6

/* A matrix [n, k] in ggml block types, stacked from parts of whole rows (an expert's gate_proj rows in one type
 * beside its up_proj rows in another): int64 {P, n, k, then for each part its ggml type, the address of its first
 * row, its row stride in bytes and its row count}; the parts' rows add up to n. */
#define GG_HEAD 3
#define GG_PART_FIELDS 4
#define GG_MAX_PARTS 8

/* The element type of a latent cache the attention reads and rope_store writes: float32, or bfloat16 / float16 rows
 * (written rounded to nearest even, as torch rounds; read widened exactly), or int8 / float8_e4m3fn rows with two
 * float32 scales per token, scales [S, 2] (the latent's and the RoPE key's: each part absmax-quantised, value =
 * stored * scale, as mla_kernels.common.quantize_per_token / dequantize_rows). */
enum CacheKind { C_F32 = 0, C_BF16 = 1, C_F16 = 2, C_I8 = 3, C_FP8 = 4 };

/* A gated MLP's row of an MLP table: gate_up [2 I, d] weight, scales, kind; down [d, I] weight, scales, kind; I. */
#define MLP_FIELDS 7

/* The layer table of mla_decoder_layer. */
enum LayerField {
    L_IN_NORM, L_POST_NORM, L_Q_NORM, L_KV_NORM,  /* RMSNorm weights (L_Q_NORM: 0 without q_lora_rank) */
    L_QA_W, L_QA_S, L_QA_K,  /* [q_lora + d_c + d_r, d] stacked q_a/kv_a; without q_lora_rank: q_proj [H (d_n + d_r), d] */
    L_KVA_W, L_KVA_S, L_KVA_K,  /* kv_a [d_c + d_r, d] without q_lora_rank, else 0 */
    L_QB_W, L_QB_S, L_QB_K,  /* q_b [H (d_n + d_r), q_lora] (0 without q_lora_rank) */
    L_W_UK, L_W_UV_T, L_W_FORMAT,  /* [H, d_n, d_c], [H, d_c, d_v] in the FactorFormat L_W_FORMAT */
    L_O_W, L_O_S, L_O_K,  /* o_proj [d, H d_v] */
    L_MLP_TABLE,  /* an MLP table: the dense MLP (row 0) or the experts and shared experts; 0: none */
    L_ROUTER, L_ROUTE, L_ROUTE_BIAS,  /* a MoE layer's router [E, d], route config and correction bias; else 0 */
    L_FIRST, L_COUNT, L_SHARED, L_MAX_INTER,  /* its experts in the table (mla_moe_row), the largest I */
    L_D, L_Q_LORA, L_HEADS, L_D_N, L_D_R, L_D_C, L_D_V, L_INTERLEAVE,
    L_FLOATS,  /* float32 [6]: the four norms' eps, the softmax scale, the routed scaling factor */
    L_ONE_PATH,  /* 1: the MLP of one row takes the path of several (a row's bits do not depend on the step's rows) */
    L_FIELDS
};

/* The step table of mla_decoder_layer: the rows and where their metadata lies. */
enum StepField {
    S_ROWS, S_COS, S_SIN, S_CS_LD,  /* T; the RoPE tables [T, d_r / 2] (row stride) */
    S_SLOTS,  /* [T] int64: each row's own cache slot */
    S_KEYS, S_KEY_STRIDE, S_LENS,  /* [T, stride] int64 cache rows of each row's keys, [T] int64 their counts */
    S_THREADS, S_DECODE_THREADS, S_DECODE_STRIDE,  /* threads; the attention's threads and scratch per thread */
    S_FIELDS
};

void mla_gemv_f32(const float *w, const float *x, float *y, int64_t n, int64_t k, int64_t threads);
void mla_gemv_half(const uint16_t *w, int64_t kind, const float *x, float *y, int64_t n, int64_t k,
                   int64_t threads);
void mla_gemv_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t n, int64_t k,
                 int64_t threads);
void mla_gemm_few_f32(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t threads,
                      int64_t variant);
int64_t mla_float_variants(void);
void mla_gemm_few_half(const uint16_t *w, int64_t kind, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                       int64_t threads, int64_t variant);
void mla_gemm_few_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads, int64_t variant);
int64_t mla_i8_variants(void);
int64_t mla_w8a8_variants(void);
void mla_gemm_fp4(int64_t kind, const uint8_t *w, const uint8_t *scales, const float *global, const float *x,
                  float *y, int64_t m, int64_t n, int64_t k, int64_t threads, int64_t variant);
void mla_fp4_share(int64_t variant, const uint8_t *w, const int64_t *fp4, const float *x, float *y, float alpha,
                   int add);
void mla_gemm_w8a8(const int8_t *w, const float *scale, const float *x, const float *row_amax, float *y, int64_t rows,
                   int64_t n, int64_t k, int64_t threads, int64_t variant);
float mla_w8a8_prepare(const float *x, int16_t *xq, int64_t k);
void mla_w8a8_share(int64_t variant, const int8_t *w, const float *scale, const int16_t *xq, float sx, float *y,
                    int64_t n, int64_t k, float alpha, int add);
void mla_gemm_fp8(const uint8_t *w, const float *scale, int64_t bn, int64_t bk, const float *x, float *y,
                  int64_t m, int64_t n, int64_t k, int64_t threads);
void mla_gemm_i4(const uint8_t *w, const uint16_t *scales, const float *x, float *y, int64_t rows, int64_t n,
                 int64_t k, int64_t threads, int64_t variant);
void mla_gemm_i4_groups(const uint8_t *w, const uint16_t *scales, const uint8_t *zeros, int64_t group, const float *x,
                        float *y, int64_t rows, int64_t n, int64_t k, int64_t threads, int64_t variant);
int64_t mla_i4_variants(void);
void mla_i4g_share(int64_t variant, const uint8_t *w, const int64_t *table, const uint8_t *xp, float *y, float alpha,
                   int add);
void mla_i4_from_stored(const uint8_t *src, uint8_t *dst, int64_t groups, int64_t threads);
int64_t mla_q8_row_bytes(int64_t k);
void mla_q8_prepare(const float *x, int64_t rows, int64_t k, uint8_t *out);
void mla_i4_share(int64_t variant, const uint8_t *w, const uint16_t *scales, const uint8_t *xp, float *y, int64_t n,
                  int64_t k, float alpha, int add);
/* Products with weights in ggml's block types as stored (gemv_ggml.c; type: ggml's number): mla_ggml_row_bytes is 0
 * for a type or k the kernels do not take. */
void mla_gemm_ggml(int64_t type, const uint8_t *w, int64_t w_stride, const float *x, float *y, int64_t rows,
                   int64_t n, int64_t k, int64_t threads, int64_t variant);
void mla_gemm_gg_parts(const int64_t *parts, const float *x, float *y, int64_t rows, int64_t threads,
                       int64_t variant);
void mla_gg_prepare(const float *x, int64_t k, uint8_t *out);
void mla_gg_share(int64_t variant, const int64_t *parts, const uint8_t *xp, float *y, float alpha, int add);
void mla_gg_mlps(int64_t variant, const int64_t *table, const int64_t *ids, const int64_t *const *rows,
                 const int64_t *counts, int64_t n, const float *h, int64_t t, int64_t d, float *out, int64_t threads);
int64_t mla_ggml_row_bytes(int64_t type, int64_t k);
/* Q4_K rows [n, k] (row r at w + r w_stride; n a multiple of 8) repacked into out [n, k / 256 x 148], type
 * MLA_GG_Q4_K_R8: the same values, eight rows interleaved a super-block at a time (gemv_ggml.c). */
#define MLA_GG_Q4_K_R8 1012
void mla_ggml_repack_q4_k(const uint8_t *w, int64_t w_stride, int64_t n, int64_t k, uint8_t *out, int64_t threads);
int64_t mla_ggml_variants(void);
int64_t mla_gg_prepared_bytes(int64_t k);
void mla_rms_norm_f32(const float *x, int64_t ld, const float *weight, float *y, int64_t m, int64_t k, float eps);
/* AMX bfloat16 products (amx_bf16.c): 1 where this CPU and kernel run them; W [n, k] repacked into tiles (n a multiple
 * of 16, k of 32); y [m, n] = x . W^T for float32 rows xf or bfloat16 rows xb (the other NULL), row stride ld. */
int64_t mla_amx_bf16(void);
void mla_amx_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k);
void mla_amx_linear_bf16(const float *xf, const uint16_t *xb, int64_t ld, const uint16_t *packed, float *y,
                         int64_t m, int64_t n, int64_t k, int64_t threads);
/* AMX int8 products (amx_int8.c): 1 where this CPU and kernel run them; y [m, n] = W8A8's product of int8 rows xq
 * [m, k] (held as int16, scales sx [m]) and the int8 weight w [n, k] as stored (row scales sw [n]), the same bits as
 * gemm_w8a8.c's other variants. */
int64_t mla_amx_int8(void);
void mla_amx_w8a8(const int8_t *w, const float *sw, const int16_t *xq, const float *sx, float *y, int64_t m, int64_t n,
                  int64_t k, int64_t threads);
/* The absorbed factors' formats (W_UK [H, k = d_n, n = d_c], W_UV^T [H, k = d_c, n = d_v]): float32, bfloat16, or
 * runs: a head's k x n int8 values q, then float32 A and B [k / FACTOR_RUN, n], the value at (i, j) fma(A[i / 32][j],
 * q[i][j], B[i / 32][j]): a quantised checkpoint's factors exactly, where its blocks of 32 run along k (a GGUF file's
 * attn_k_b and attn_v_b in 32-value or K-quant types), at 1.25 bytes a value. */
enum { FACTOR_F32 = 0, FACTOR_BF16 = 1, FACTOR_RUNS = 2 };
#define FACTOR_RUN 32
int64_t mla_decode_by_rows(int64_t rows, int64_t heads, int64_t threads);
int64_t mla_decode_scratch(int64_t rows, int64_t heads, int64_t d_c, int64_t slot_stride, int64_t threads);
void mla_absorbed_decode_f32(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                             int64_t qr_h, const void *w_uk, const void *w_uv_t, const void *cache,
                             const float *cache_scales, const int64_t *slots, int64_t slot_stride,
                             const int64_t *lens, float scale, float *out, float *scratch, int64_t scratch_stride,
                             int64_t rows, int64_t heads, int64_t d_n, int64_t d_r, int64_t d_c, int64_t d_v,
                             int64_t threads, int64_t cache_kind, int64_t variant);
/* The prefill's up-projected attention, causal and bottom-right aligned, for nseq sequences (cu_q, cu_k [nseq + 1]):
 * q_n [T, H, d_n], q_r [T, H, d_r], v [S, H, d_v] float32 (strides per row and per head), the keys transposed: kt
 * [H, d_n, S + MLA_PREFILL_KEY_PAD] and krt [d_r, S + MLA_PREFILL_KEY_PAD] (strides per head and per row) -> out
 * [T, H, d_v], lse [T, H]; scratch [threads, scratch_stride >= MLA_PREFILL_ROWS * (the longest k_len +
 * MLA_PREFILL_KEY_PAD)]. */
void mla_prefill_attention_f32(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                               int64_t qr_h, const float *kt, int64_t kt_h, int64_t kt_d, const float *krt,
                               int64_t krt_d, const float *v, int64_t v_t, int64_t v_h, const int64_t *cu_q,
                               const int64_t *cu_k, int64_t nseq, float scale, float *out, float *lse, float *scratch,
                               int64_t scratch_stride, int64_t heads, int64_t d_n, int64_t d_r, int64_t d_v,
                               int64_t threads, int64_t variant);
void mla_absorbed_decode_bf16w(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                               int64_t qr_h, const void *w_uk, const void *w_uv_t, const void *cache,
                               const float *cache_scales, const int64_t *slots, int64_t slot_stride,
                               const int64_t *lens, float scale, float *out, float *scratch, int64_t scratch_stride,
                               int64_t rows, int64_t heads, int64_t d_n, int64_t d_r, int64_t d_c, int64_t d_v,
                               int64_t threads, int64_t cache_kind, int64_t variant);
void mla_absorbed_decode_runs(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                              int64_t qr_h, const void *w_uk, const void *w_uv_t, const void *cache,
                              const float *cache_scales, const int64_t *slots, int64_t slot_stride,
                              const int64_t *lens, float scale, float *out, float *scratch, int64_t scratch_stride,
                              int64_t rows, int64_t heads, int64_t d_n, int64_t d_r, int64_t d_c, int64_t d_v,
                              int64_t threads, int64_t cache_kind, int64_t variant);
void mla_rope_store_f32(const float *latent, int64_t lat_ld, const float *norm, float eps, float *q, int64_t q_t,
                        int64_t q_h, int64_t heads, int64_t d_n, const float *cos, const float *sin, int64_t cs_ld,
                        void *cache, int64_t cache_kind, float *cache_scales, const int64_t *slots, int64_t rows,
                        int64_t d_c, int64_t d_r, int64_t interleave);
void mla_gated_mlps(const float *x, float *y, int64_t d, const int64_t *table, const int64_t *ids, const float *w,
                    int64_t n, float *scratch, int64_t threads);
void mla_mlps_row(const float *x, int64_t d, const int64_t *table, const int64_t *ids, int64_t n, float *out,
                  int64_t threads);
void mla_mlps_rows(const int64_t *table, const int64_t *ids, const int64_t *const *rows, const int64_t *counts,
                   int64_t n, const float *h, int64_t t, int64_t d, float *out, int64_t threads);
int64_t mla_route_row(const float *logits, const int64_t *cfg, const float *bias, float scaling, int64_t *ids,
                      float *w, float *scratch);
void mla_moe_row(const float *x, float *y, int64_t d, const float *router, const int64_t *cfg, const float *bias,
                 float scaling, const int64_t *table, int64_t first, int64_t count, int64_t shared, float *scratch,
                 int64_t max_inter, int64_t threads);
int64_t mla_decoder_layer_scratch(const int64_t *L, const int64_t *S);
int64_t mla_decoder_layer(const int64_t *L, const int64_t *S, float *x, void *cache, int64_t cache_kind,
                          float *cache_scales, float *scratch);

#endif
