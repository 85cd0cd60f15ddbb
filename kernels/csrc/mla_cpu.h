/* The entry points of the compiled CPU kernels (gemv_f32.c, gemv_fp8.c, gemv_int4.c, mla_decode_f32.c,
 * mla_layer_f32.c). Every source includes this header, so a definition that drifts from its declaration fails the
 * build; ops/cpu_kernels.cpp registers each as a typed torch operator (mla_kernels::*). Pointers are row-major
 * buffers, sizes are element counts, "threads" the OpenMP threads a call may use. */
#ifndef MLA_CPU_H
#define MLA_CPU_H
#include <stdint.h>

void mla_gemv_f32(const float *w, const float *x, float *y, int64_t n, int64_t k, int64_t threads);
void mla_gemv_bf16(const uint16_t *w, const float *x, float *y, int64_t n, int64_t k, int64_t threads);
void mla_gemv_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t n, int64_t k,
                 int64_t threads);
void mla_gemm_few_f32(const float *w, const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t threads);
void mla_gemm_few_bf16(const uint16_t *w, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                       int64_t threads);
void mla_gemm_few_i8(const int8_t *w, const float *scale, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads);
int64_t mla_i8_variants(void);
void mla_i8_select(int64_t variant);
void mla_gemm_fp8(const uint8_t *w, const float *scale, int64_t bn, int64_t bk, const float *x, float *y,
                  int64_t m, int64_t n, int64_t k, int64_t threads);
void mla_gemm_i4(const uint8_t *w, const uint16_t *scales, const float *x, float *y, int64_t rows, int64_t n,
                 int64_t k, int64_t threads, int64_t variant);
int64_t mla_i4_variants(void);
void mla_i4_from_stored(const uint8_t *src, uint8_t *dst, int64_t groups, int64_t threads);
int64_t mla_q8_row_bytes(int64_t k);
void mla_q8_prepare(const float *x, int64_t rows, int64_t k, uint8_t *out);
void mla_i4_share(int64_t variant, const uint8_t *w, const uint16_t *scales, const uint8_t *xp, float *y, int64_t n,
                  int64_t k, float alpha, int add);
void mla_rms_norm_f32(const float *x, int64_t ld, const float *weight, float *y, int64_t m, int64_t k, float eps);
void mla_absorbed_decode_f32(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                             int64_t qr_h, const void *w_uk, const void *w_uv_t, const float *cache,
                             const int64_t *slots, int64_t slot_stride, const int64_t *lens, float scale, float *out,
                             float *scratch, int64_t scratch_stride, int64_t rows, int64_t heads, int64_t d_n,
                             int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads);
void mla_absorbed_decode_bf16w(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                               int64_t qr_h, const void *w_uk, const void *w_uv_t, const float *cache,
                               const int64_t *slots, int64_t slot_stride, const int64_t *lens, float scale, float *out,
                               float *scratch, int64_t scratch_stride, int64_t rows, int64_t heads, int64_t d_n,
                               int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads);
void mla_rope_store_f32(const float *latent, int64_t lat_ld, const float *norm, float eps, float *q, int64_t q_t,
                        int64_t q_h, int64_t heads, int64_t d_n, const float *cos, const float *sin, int64_t cs_ld,
                        float *cache, const int64_t *slots, int64_t rows, int64_t d_c, int64_t d_r,
                        int64_t interleave);
void mla_gated_mlps(const float *x, float *y, int64_t d, const int64_t *table, const int64_t *ids, const float *w,
                    int64_t n, float *scratch, int64_t threads);
int64_t mla_route_row(const float *logits, const int64_t *cfg, const float *bias, float scaling, int64_t *ids,
                      float *w, float *scratch);
void mla_moe_row(const float *x, float *y, int64_t d, const float *router, const int64_t *cfg, const float *bias,
                 float scaling, const int64_t *table, int64_t first, int64_t count, int64_t shared, float *scratch,
                 int64_t max_inter, int64_t threads);
int64_t mla_decoder_layer_scratch(const int64_t *L, const int64_t *S);
int64_t mla_decoder_layer(const int64_t *L, const int64_t *S, float *x, float *cache, float *scratch);

#endif
