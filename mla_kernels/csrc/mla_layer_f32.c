/* One decoder layer of a decode step in one call, for float32 activations on x86-64 with AVX2 and FMA: the
 * same kernels the step would otherwise call one by one from Python (gemv_f32.c, mla_decode_f32.c), in order,
 * with their intermediate rows in one scratch buffer. For the step's T rows x [T, d] (updated in place):
 *
 *     h = RMSNorm(x)                                    input_layernorm
 *     [q_lat ; latent] = qkv_a(h);  q = q_b(RMSNorm(q_lat))   (a q_lora_rank model; else q = q_proj(h),
 *                                                        latent = kv_a(h))
 *     cache[slot] = [RMSNorm(c) ; RoPE(k_r)];  q_r = RoPE(q_r)
 *     o = absorbed attention of q over the paged latent cache
 *     x += o_proj(o)
 *     h = RMSNorm(x)                                    post_attention_layernorm
 *     x += MLP(h)   the dense MLP or the MoE layer (router, routing, routed and shared experts); without an MLP
 *                   table the caller runs it, and finds h at the start of the scratch buffer
 *
 * Weights are float32, bfloat16, float16, int8 with a float32 scale per row (the input rows rounded to int16, or to
 * int8 per row for W8A8: gemm_w8a8.c), group-wise int4 (gemv_int4.c), FP4 (gemm_fp4.c) or ggml block types as a
 * GGUF file stores them (gemv_ggml.c); the absorbed factors float32 or bfloat16 (quantised models). The layer's weights and sizes are a table of 64-bit
 * integers (LayerField), the step's rows another (StepField), both built by ops/cpu_kernels.cpp, which checks every
 * shape once when it builds them. The Python side costs one call a
 * layer instead of about fifteen (each some microseconds of dispatch: bench/RESULTS.md). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"

#define PTR(type, table, field) ((type)(intptr_t)(table)[field])


/* y [m, n] = x [m, k] W^T for the operand L[w_field .. w_field + 2]: weight, scales, kind */
static void product(const int64_t *L, int w_field, const float *x, float *y, int64_t m, int64_t n, int64_t k,
                    int64_t threads) {
    const void *w = PTR(const void *, L, w_field);
    const void *scale = PTR(const void *, L, w_field + 1);
    const int64_t kind = L[w_field + 2];
    if (kind == W_BF16 || kind == W_F16)
        (m == 1 ? mla_gemv_half((const uint16_t *)w, kind, x, y, n, k, threads)
                : mla_gemm_few_half((const uint16_t *)w, kind, x, y, m, n, k, threads, -1));
    else if (W_IS_GG(kind))
        mla_gemm_gg_parts((const int64_t *)w, x, y, m, threads, kind - W_GG);
    else if (W_IS_W8A8(kind))
        mla_gemm_w8a8((const int8_t *)w, (const float *)scale, x, NULL, y, m, n, k, threads, kind - W_W8A8);
    else if (W_IS_FP4(kind))
        mla_gemm_fp4(((const int64_t *)scale)[0], (const uint8_t *)w, PTR(const uint8_t *, (const int64_t *)scale, 3),
                     PTR(const float *, (const int64_t *)scale, 4), x, y, m, n, k, threads, kind - W_FP4);
    else if (W_IS_I4G(kind))
        mla_gemm_i4_groups((const uint8_t *)w, PTR(const uint16_t *, (const int64_t *)scale, 3),
                           PTR(const uint8_t *, (const int64_t *)scale, 4), ((const int64_t *)scale)[5], x, y, m, n, k,
                           threads, kind - W_I4G);
    else if (W_IS_I4(kind))
        mla_gemm_i4((const uint8_t *)w, (const uint16_t *)scale, x, y, m, n, k, threads, kind - W_I4);
    else if (kind == W_I8)
        (m == 1 ? mla_gemv_i8((const int8_t *)w, (const float *)scale, x, y, n, k, threads)
                : mla_gemm_few_i8((const int8_t *)w, (const float *)scale, x, y, m, n, k, threads, -1));
    else
        (m == 1 ? mla_gemv_f32((const float *)w, x, y, n, k, threads)
                : mla_gemm_few_f32((const float *)w, x, y, m, n, k, threads, -1));
}

#define MAX_ROWS MLA_FEW_ROWS  /* rows a call takes */
#define MAX_TOPK MLA_MOE_MAX_TOPK

/* The MLP's scratch floats for t rows: mla_moe_row's for one row, else mlp_rows' (logits [t, E] and the routing's
 * 4 E + n_group; the MLPs' rows are mla_mlps_rows' own). */
static int64_t mlp_scratch(const int64_t *L, int64_t t) {
    const int64_t *route = PTR(const int64_t *, L, L_ROUTE);
    const int64_t experts = route ? route[6] : 0, groups = route ? route[2] : 0, inter = L[L_MAX_INTER];
    if (t == 1 && !L[L_ONE_PATH]) return 3 * inter + (route ? 5 * experts + groups + MAX_TOPK + 1 : 0);
    return t * experts + 4 * experts + groups;
}

/* One gated MLP (a row of the MLP table) of n rows xs [n, d] -> h [n, d]: gate_up [n, 2 I], act [n, I] scratch. */
static void gated_rows(int64_t d, const int64_t *mlp, const float *xs, int64_t n, float *gate_up, float *act, float *h,
                       int64_t threads) {
    const int64_t inter = mlp[6];
    product(mlp, 0, xs, gate_up, n, 2 * inter, d, threads);
    for (int64_t j = 0; j < n; j++) {
        const float *g = gate_up + j * 2 * inter;
        for (int64_t r = 0; r < inter; r++) act[j * inter + r] = g[r] / (1.0f + expf(-g[r])) * g[inter + r];
    }
    product(mlp, 3, act, h, n, d, inter, threads);
}

/* The variant of the ggml-type kernels that both products of each of the n MLPs (table rows ids) read, or -1 where
 * one reads another kind or variant. */
static int64_t gg_variant(const int64_t *table, const int64_t *ids, int64_t n) {
    int64_t variant = -1;
    for (int64_t i = 0; i < n; i++)
        for (int64_t f = 2; f <= 5; f += 3) {
            const int64_t kind = table[ids[i] * MLP_FIELDS + f];
            if (!W_IS_GG(kind) || (variant >= 0 && kind - W_GG != variant)) return -1;
            variant = kind - W_GG;
        }
    return variant;
}

#define MAX_MLPS (MAX_ROWS * MAX_TOPK + 1)  /* the MLPs one call's rows can reach: routed, then one shared */

/* The MLPs a layer call runs: MLP i (table row ids[i]) over the counts[i] rows rows[i] of h, their outputs times
 * weights[i] added to theirs (in list order), the last the shared experts' when shared. */
typedef struct {
    int64_t n, shared, ids[MAX_MLPS], counts[MAX_MLPS], rows[MAX_MLPS][MAX_ROWS];
    float weights[MAX_MLPS][MAX_ROWS];
} MlpList;

/* MLP i (table row ids[i]) over the counts[i] rows rows[i][..] of h [t, d]: out [sum counts, d], each MLP's outputs
 * in turn, unweighted. Every product in ggml types: all in one parallel region (mla_gg_mlps); else one row: all in
 * one region too (mla_mlps_row); else MLP by MLP, each product a call. The same bits for a row every way: each
 * product's row is computed alone, the activation by the same expression. */
void mla_mlps_rows(const int64_t *table, const int64_t *ids, const int64_t *const *rows, const int64_t *counts,
                   int64_t n, const float *h, int64_t t, int64_t d, float *out, int64_t threads) {
    const int64_t variant = gg_variant(table, ids, n);
    if (variant >= 0) {
        mla_gg_mlps(variant, table, ids, rows, counts, n, h, t, d, out, threads);
        return;
    }
    if (t == 1) {  /* every MLP over the one row */
        mla_mlps_row(h, d, table, ids, n, out, threads);
        return;
    }
    int64_t inter = 1, most = 1;
    for (int64_t i = 0; i < n; i++) {
        inter = table[ids[i] * MLP_FIELDS + 6] > inter ? table[ids[i] * MLP_FIELDS + 6] : inter;
        most = counts[i] > most ? counts[i] : most;
    }
    float *xs = (float *)malloc((size_t)(most * (d + 3 * inter)) * sizeof(float));
    if (!xs) abort();
    for (int64_t i = 0, first = 0; i < n; first += counts[i], i++) {
        for (int64_t j = 0; j < counts[i]; j++) memcpy(xs + j * d, h + rows[i][j] * d, d * sizeof(float));
        gated_rows(d, table + ids[i] * MLP_FIELDS, xs, counts[i], xs + most * d, xs + most * (d + 2 * inter),
                   out + first * d, threads);
    }
    free(xs);
}

/* y [t, d] = the list's MLPs over h (mla_mlps_rows), each output times its weight added in list order (y zeroed
 * first; the shared experts' added unweighted). */
static void run_mlps(const int64_t *L, const int64_t *table, const MlpList *m, const float *h, int64_t t, float *y,
                     int64_t threads) {
    const int64_t d = L[L_D];
    const int64_t *rows[MAX_MLPS];
    int64_t first = 0, total = 0;
    for (int64_t i = 0; i < m->n; i++) {
        rows[i] = m->rows[i];
        total += m->counts[i];
    }
    float *outs = (float *)malloc((size_t)(total * d) * sizeof(float));
    if (!outs) abort();
    mla_mlps_rows(table, m->ids, rows, m->counts, m->n, h, t, d, outs, threads);
    for (int64_t i = 0; i < t * d; i++) y[i] = 0.0f;
    for (int64_t i = 0; i < m->n; first += m->counts[i], i++) {
        const float *out = outs + first * d;
        if (m->shared && i == m->n - 1) {
            for (int64_t r = 0; r < t * d; r++) y[r] += out[r];
        } else {
            for (int64_t j = 0; j < m->counts[i]; j++)
                for (int64_t r = 0; r < d; r++) y[m->rows[i][j] * d + r] += out[j * d + r] * m->weights[i][j];
        }
    }
    free(outs);
}

/* The MLP of t rows h [t, d] -> y [t, d]: the dense MLP (table row 0), or the MoE layer: each row routed (its
 * logits by the one-row product, whatever t), then expert by expert (ascending) the rows that chose it, gathered,
 * through the expert once, their outputs times the routing weights added to theirs; then the shared experts over
 * every row. A row's output does not depend on the rows beside it where the experts' products do not (the integer
 * formats' kernels); a layer with L_ONE_PATH takes it for one row too (mla_moe_row, which one row takes otherwise,
 * sums in another order, in one parallel region: 1.3x faster at one row of int8 experts). */
static void mlp_rows(const int64_t *L, const float *h, int64_t t, float *y, float *scratch, int64_t threads) {
    const int64_t d = L[L_D], *table = PTR(const int64_t *, L, L_MLP_TABLE);
    const int64_t *cfg = PTR(const int64_t *, L, L_ROUTE);
    const int64_t experts = cfg ? cfg[6] : 0;
    float *logits = scratch, *route_scratch = logits + t * experts;
    MlpList *m = (MlpList *)malloc(sizeof(MlpList));  /* about 57 KB: off the stack */
    if (!m) abort();
    m->n = 0;
    m->shared = !cfg || L[L_SHARED] >= 0;
    if (cfg) {
        const float *f = PTR(const float *, L, L_FLOATS);
        int64_t ids[MAX_ROWS][MAX_TOPK], k[MAX_ROWS];
        float w[MAX_ROWS][MAX_TOPK];
        for (int64_t j = 0; j < t; j++)
            mla_gemv_f32(PTR(const float *, L, L_ROUTER), h + j * d, logits + j * experts, experts, d, threads);
        for (int64_t j = 0; j < t; j++)
            k[j] = mla_route_row(logits + j * experts, cfg, PTR(const float *, L, L_ROUTE_BIAS), f[5], ids[j], w[j],
                                 route_scratch);
        for (int64_t e = L[L_FIRST]; e < L[L_FIRST] + L[L_COUNT]; e++) {
            int64_t n = 0;
            for (int64_t j = 0; j < t; j++)
                for (int64_t i = 0; i < k[j]; i++)
                    if (ids[j][i] == e) {
                        m->rows[m->n][n] = j;
                        m->weights[m->n][n++] = w[j][i];
                    }
            if (n) {
                m->ids[m->n] = e - L[L_FIRST];
                m->counts[m->n++] = n;
            }
        }
    }
    if (m->shared) {  /* the dense MLP, or the shared experts: every row */
        m->ids[m->n] = cfg ? L[L_SHARED] : 0;
        m->counts[m->n] = t;
        for (int64_t j = 0; j < t; j++) m->rows[m->n][j] = j;
        m->n++;
    }
    run_mlps(L, table, m, h, t, y, threads);
    free(m);
}

/* Scratch floats one call needs, laid out as in mla_decoder_layer. */
int64_t mla_decoder_layer_scratch(const int64_t *L, const int64_t *S) {
    const int64_t t = S[S_ROWS], d = L[L_D], heads = L[L_HEADS], qk = L[L_D_N] + L[L_D_R];
    const int64_t lat_w = L[L_Q_LORA] + L[L_D_C] + L[L_D_R];
    return t * d + t * lat_w + t * L[L_Q_LORA] + t * heads * qk + t * heads * L[L_D_V] + t * d +
           S[S_DECODE_THREADS] * S[S_DECODE_STRIDE] + mlp_scratch(L, t) + t * d;
}

static void residual(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* x [T, d] in place through one decoder layer (the file's comment); cache: the layer's flat latent rows, of
 * cache_kind (CacheKind), with cache_scales [S, 2] for an int8 or e4m3 cache. Returns 1
 * when it also ran the MLP (the layer has an MLP table), else 0: then h = RMSNorm(x) is at scratch[0 : T d]. */
int64_t mla_decoder_layer(const int64_t *L, const int64_t *S, float *x, void *cache, int64_t cache_kind,
                          float *cache_scales, float *scratch) {
    const float *f = PTR(const float *, L, L_FLOATS);
    const int64_t t = S[S_ROWS], threads = S[S_THREADS], d = L[L_D], heads = L[L_HEADS], q_lora = L[L_Q_LORA];
    const int64_t d_n = L[L_D_N], d_r = L[L_D_R], d_c = L[L_D_C], d_v = L[L_D_V], qk = d_n + d_r;
    const int64_t lat_w = q_lora + d_c + d_r;  /* a row of the stacked input projection */
    float *h = scratch, *qa = h + t * d, *qn = qa + t * lat_w, *q = qn + t * q_lora, *o = q + t * heads * qk;
    float *out = o + t * heads * d_v, *att = out + t * d, *mlp = att + S[S_DECODE_THREADS] * S[S_DECODE_STRIDE];
    mla_rms_norm_f32(x, d, PTR(const float *, L, L_IN_NORM), h, t, d, f[0]);
    if (q_lora) {
        product(L, L_QA_W, h, qa, t, lat_w, d, threads);
        mla_rms_norm_f32(qa, lat_w, PTR(const float *, L, L_Q_NORM), qn, t, q_lora, f[2]);
        product(L, L_QB_W, qn, q, t, heads * qk, q_lora, threads);
    } else {
        product(L, L_QA_W, h, q, t, heads * qk, d, threads);
        product(L, L_KVA_W, h, qa, t, d_c + d_r, d, threads);
    }
    mla_rope_store_f32(qa + q_lora, lat_w, PTR(const float *, L, L_KV_NORM), f[3], q, heads * qk, qk, heads, d_n,
                       PTR(const float *, S, S_COS), PTR(const float *, S, S_SIN), S[S_CS_LD], cache, cache_kind,
                       cache_scales, PTR(const int64_t *, S, S_SLOTS), t, d_c, d_r, L[L_INTERLEAVE]);
    (L[L_W_FORMAT] == FACTOR_RUNS   ? mla_absorbed_decode_runs
     : L[L_W_FORMAT] == FACTOR_BF16 ? mla_absorbed_decode_bf16w
                                    : mla_absorbed_decode_f32)(
        q, heads * qk, qk, q + d_n, heads * qk, qk, PTR(const void *, L, L_W_UK), PTR(const void *, L, L_W_UV_T), cache,
        cache_scales, PTR(const int64_t *, S, S_KEYS), S[S_KEY_STRIDE], PTR(const int64_t *, S, S_LENS), f[4], o, att,
        S[S_DECODE_STRIDE], t, heads, d_n, d_r, d_c, d_v, S[S_DECODE_THREADS], cache_kind, -1);
    product(L, L_O_W, o, out, t, d, heads * d_v, threads);
    residual(x, out, t * d);
    mla_rms_norm_f32(x, d, PTR(const float *, L, L_POST_NORM), h, t, d, f[1]);
    if (!L[L_MLP_TABLE]) return 0;
    float *y = mlp + mlp_scratch(L, t);
    const int64_t *table = PTR(const int64_t *, L, L_MLP_TABLE);
    if (t > 1 || L[L_ONE_PATH]) {
        mlp_rows(L, h, t, y, mlp, threads);
    } else if (L[L_ROUTER]) {
        mla_moe_row(h, y, d, PTR(const float *, L, L_ROUTER), PTR(const int64_t *, L, L_ROUTE),
                    PTR(const float *, L, L_ROUTE_BIAS), f[5], table, L[L_FIRST], L[L_COUNT], L[L_SHARED], mlp,
                    L[L_MAX_INTER], threads);
    } else {
        const int64_t id = 0;
        const float one = 1.0f;
        mla_gated_mlps(h, y, d, table, &id, &one, 1, mlp, threads);
    }
    residual(x, y, t * d);
    return 1;
}
