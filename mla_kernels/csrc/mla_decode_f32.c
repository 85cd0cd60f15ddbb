/* Absorbed MLA decode for x86-64 with AVX2 and FMA: float32 queries, weights and latent cache. For query row t
 * and head h, with c_j / k_r_j the latent and RoPE key of the row's j-th cached token:
 *
 *     q~ = W_UK[h]^T q_n[t, h]                                   (d_c values)
 *     s_j = scale * (q~ . c_j + q_r[t, h] . k_r_j),  j < len[t]
 *     o_lat = sum_j softmax(s)_j c_j                             (d_c values)
 *     out[t, h] = W_UV[h] o_lat = sum_c o_lat[c] W_UV^T[h][c, :]  (d_v values)
 *
 * One call does a whole layer's decode attention: the absorption, the attention over the cache and the
 * up-projection, where torch needs a batched product, a concatenation, a gather, two more batched products and a
 * softmax. Each thread takes a group of heads for every row: it reads each head's 2 * d_c * d_n
 * weights from memory once and again from its cache for the head's other rows. The caller provides each thread's
 * scratch (q~, o_lat and the scores: 2 * d_c + max(lens) floats).
 *
 * Compiled with gemv_f32.c into the typed operators (ops/cpu_kernels.cpp). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"
#include "simd.h"

#define MAX_GROUP MLA_DECODE_MAX_GROUP  /* heads per thread */

/* Ask for n bytes at p in cache, front to back: one sequential stream the memory system can run ahead on (the
 * products below read their weights by column blocks, which the hardware prefetchers follow poorly from memory). */
static inline void prefetch(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

/* Eight weights from b + i as floats: float32, or bfloat16 (its bits are a float32's upper half). The weight format
 * is a compile-time constant wherever this is inlined, so each format gets its own loops. */
static inline __attribute__((always_inline)) __m256 load8(const void *b, int64_t i, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)b + i))), 16));
    return _mm256_loadu_ps((const float *)b + i);
}

static inline __attribute__((always_inline)) float load1(const void *b, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)b)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)b)[i];
}

/* y[0:n] = sum_i x[i] b[i][0:n] for one row x and a row-major b [k, n], reading b front to back as two sequential
 * streams (its two halves side by side, each summed into its own accumulator in L1; one stream was 10-17 % slower
 * from memory). The one-row case of small_gemm, whose column blocks stream a cold matrix more slowly. */
static inline __attribute__((always_inline)) void vec_mat(const float *x, const void *b, int64_t k, int64_t n,
                                                          float *y, const int bf16) {
    const int64_t n8 = n - n % 8, half = k / 2;
    float y2[n];
    for (int64_t j = 0; j < n; j++) y[j] = y2[j] = 0.0f;
    for (int64_t i = 0; i < half; i++) {
        const int64_t ra = i * n, rb = (i + half) * n;
        const __m256 pa = _mm256_set1_ps(x[i]), pb = _mm256_set1_ps(x[i + half]);
        for (int64_t j = 0; j < n8; j += 8) {
            _mm256_storeu_ps(y + j, _mm256_fmadd_ps(pa, load8(b, ra + j, bf16), _mm256_loadu_ps(y + j)));
            _mm256_storeu_ps(y2 + j, _mm256_fmadd_ps(pb, load8(b, rb + j, bf16), _mm256_loadu_ps(y2 + j)));
        }
        for (int64_t j = n8; j < n; j++) {
            y[j] += x[i] * load1(b, ra + j, bf16);
            y2[j] += x[i + half] * load1(b, rb + j, bf16);
        }
    }
    for (int64_t i = 2 * half; i < k; i++)  /* an odd k's last row */
        for (int64_t j = 0; j < n; j++) y[j] += x[i] * load1(b, i * n + j, bf16);
    for (int64_t j = 0; j < n; j++) y[j] += y2[j];
}

/* c[t][0:n] = sum_k a[t][k] b[k][0:n] for t < m: rows of a (row stride lda) times the row-major b [k, n] (float32 or
 * bfloat16) into rows of c (row stride ldc), two rows of a by 32 columns of b in eight registers (one load of b
 * serves two rows). */
static inline __attribute__((always_inline)) void small_gemm(const float *a, int64_t lda, const void *b, int64_t k,
                                                             int64_t n, float *c, int64_t ldc, int64_t m,
                                                             const int bf16) {
    if (m == 1) {
        vec_mat(a, b, k, n, c, bf16);
        return;
    }
    prefetch(b, k * n * (bf16 ? 2 : 4));
    for (int64_t t = 0; t < m; t += 2) {
        const float *a0 = a + t * lda, *a1 = t + 1 < m ? a0 + lda : a0;  /* an odd last row: computed twice */
        float *c0 = c + t * ldc, *c1 = t + 1 < m ? c0 + ldc : c0;
        int64_t j = 0;
        for (; j + 32 <= n; j += 32) {
            __m256 x[4], y[4];
            for (int u = 0; u < 4; u++) x[u] = y[u] = _mm256_setzero_ps();
            for (int64_t i = 0; i < k; i++) {
                const __m256 p = _mm256_set1_ps(a0[i]), q = _mm256_set1_ps(a1[i]);
                for (int u = 0; u < 4; u++) {
                    const __m256 bv = load8(b, i * n + j + 8 * u, bf16);
                    x[u] = _mm256_fmadd_ps(p, bv, x[u]);
                    y[u] = _mm256_fmadd_ps(q, bv, y[u]);
                }
            }
            for (int u = 0; u < 4; u++) {
                _mm256_storeu_ps(c1 + j + 8 * u, y[u]);
                _mm256_storeu_ps(c0 + j + 8 * u, x[u]);
            }
        }
        for (; j < n; j++) {
            float x0 = 0.0f, y0 = 0.0f;
            for (int64_t i = 0; i < k; i++) {
                x0 += a0[i] * load1(b, i * n + j, bf16);
                y0 += a1[i] * load1(b, i * n + j, bf16);
            }
            c1[j] = y0;
            c0[j] = x0;
        }
    }
}

/* Ask for a cached key row (width floats) in L1. A row of DeepSeek's latent is 2304 bytes, so consecutive keys cross a
 * 4 KB page every other row, where the hardware prefetchers stop; the scores ask for the pair of keys KEYS_AHEAD
 * ahead (bench/RESULTS.md: 10-20 % off the attention over 224 keys). */
#define KEYS_AHEAD 4
static inline void fetch_key(const float *key, int64_t width) {
    for (int64_t b = 0; b < width; b += 16) _mm_prefetch((const char *)(key + b), _MM_HINT_T0);
}

/* e^x for eight floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error below
 * 2e-7 on that range), times 2^n built in the exponent bits. Inputs below -87 give 0 (softmax only feeds x <= 0). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts: exact n * hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* softmax of s[0:n] in place */
static void softmax(float *s, int64_t n) {
    const int64_t n8 = n - n % 8;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n8; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float mx = _mm_cvtss_f32(m4);
    for (int64_t j = n8; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const __m256 mb = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
        _mm256_storeu_ps(s + j, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (int64_t j = n8; j < n; j++) sum += (s[j] = expf(s[j] - mx));
    const float inv = 1.0f / sum;
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t j = 0; j < n8; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), iv));
    for (int64_t j = n8; j < n; j++) s[j] *= inv;
}

/* Accumulate four heads' queries q[0..3][0:n] against two keys ka, kb (four heads by two keys in eight registers:
 * each load of a key serves four heads, each load of a query two keys). */
static inline void tile4x2(const float *const *q, const float *ka, const float *kb, int64_t n, __m256 *acc) {
    for (int64_t i = 0; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(ka + i), b = _mm256_loadu_ps(kb + i);
        for (int u = 0; u < 4; u++) {
            const __m256 qv = _mm256_loadu_ps(q[u] + i);
            acc[2 * u] = _mm256_fmadd_ps(qv, a, acc[2 * u]);
            acc[2 * u + 1] = _mm256_fmadd_ps(qv, b, acc[2 * u + 1]);
        }
    }
}

/* s[h * ld + j] = scale * (q[h] . key_j[:d_c] + qr[h] . key_j[d_c:]) for nh heads and the keys j0 and j0 + 1
 * (key_j = cache + slot[j] * width; with one = 1 only j0). Four heads by two keys at a time when d_c and d_r are
 * multiples of 8, else one dot product at a time. */
static void scores(const float *const *q, const float *const *qr, const float *cache, int64_t width,
                   const int64_t *slot, int64_t j0, int one, int64_t nh, int64_t d_c, int64_t d_r, float scale,
                   float *s, int64_t ld) {
    const float *ka = cache + slot[j0] * width, *kb = one ? ka : cache + slot[j0 + 1] * width;
    int64_t h = 0;
    if (d_c % 8 == 0 && d_r % 8 == 0) {
        for (; h + 4 <= nh; h += 4) {
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            tile4x2(q + h, ka, kb, d_c, acc);
            tile4x2(qr + h, ka + d_c, kb + d_c, d_r, acc);
            for (int u = 0; u < 4; u++) {
                s[(h + u) * ld + j0] = scale * hsum(acc[2 * u]);
                if (!one) s[(h + u) * ld + j0 + 1] = scale * hsum(acc[2 * u + 1]);
            }
        }
    }
    for (; h < nh; h++)
        for (int k = 0; k < 2 - one; k++) {
            const float *key = k ? kb : ka;
            s[h * ld + j0 + k] = scale * (dot_f32(q[h], key, d_c) + dot_f32(qr[h], key + d_c, d_r));
        }
}

/* o[h][c0:c0+32] (+)= sum_{j0 <= j < j1} p[h * ld + j] key_j[c0:c0+32] for the heads h0 and h1 (h1 == h0: one
 * head), in eight registers: each key block is loaded once for both heads. */
static inline void weigh_block(const float *p, int64_t ld, const float *cache, int64_t width, const int64_t *slot,
                               int64_t j0, int64_t j1, int64_t h0, int64_t h1, int64_t c0, float *const *o) {
    __m256 a[4], b[4];
    for (int u = 0; u < 4; u++) {
        a[u] = j0 ? _mm256_loadu_ps(o[h0] + c0 + 8 * u) : _mm256_setzero_ps();
        b[u] = j0 ? _mm256_loadu_ps(o[h1] + c0 + 8 * u) : _mm256_setzero_ps();
    }
    for (int64_t j = j0; j < j1; j++) {
        const float *k = cache + slot[j] * width + c0;
        const __m256 pa = _mm256_set1_ps(p[h0 * ld + j]), pb = _mm256_set1_ps(p[h1 * ld + j]);
        for (int u = 0; u < 4; u++) {
            const __m256 kv = _mm256_loadu_ps(k + 8 * u);
            a[u] = _mm256_fmadd_ps(pa, kv, a[u]);
            b[u] = _mm256_fmadd_ps(pb, kv, b[u]);
        }
    }
    for (int u = 0; u < 4; u++) {
        _mm256_storeu_ps(o[h1] + c0 + 8 * u, b[u]);
        _mm256_storeu_ps(o[h0] + c0 + 8 * u, a[u]);  /* last: the one head's result when h1 == h0 */
    }
}

/* o[h][0:d_c] = sum_j p[h * ld + j] key_j[0:d_c] for nh heads, keys key_j = cache + slot[j] * width. The keys go in
 * chunks of WEIGH_KEYS (a chunk's latents fit in L2; a row's whole context may not), and within a chunk 32 columns
 * of them at a time (in L1) serve every pair of heads. */
#define WEIGH_KEYS 32
static void weighted_keys(const float *p, int64_t ld, const float *cache, int64_t width, const int64_t *slot,
                          int64_t len, int64_t nh, int64_t d_c, float *const *o) {
    const int64_t c32 = d_c - d_c % 32;
    for (int64_t j0 = 0; j0 < len; j0 += WEIGH_KEYS) {
        const int64_t j1 = j0 + WEIGH_KEYS < len ? j0 + WEIGH_KEYS : len;
        for (int64_t c = 0; c < c32; c += 32)
            for (int64_t h = 0; h < nh; h += 2)
                weigh_block(p, ld, cache, width, slot, j0, j1, h, h + 1 < nh ? h + 1 : h, c, o);
        for (int64_t h = 0; h < nh; h++)  /* columns past the last block of 32 */
            for (int64_t c = c32; c < d_c; c++) {
                float acc = j0 ? o[h][c] : 0.0f;
                for (int64_t j = j0; j < j1; j++) acc += p[h * ld + j] * cache[slot[j] * width + c];
                o[h][c] = acc;
            }
    }
}

/* q_n [T, H, d_n] and q_r [T, H, d_r] (strides per row and per head, elements contiguous), w_uk [H, d_n, d_c],
 * w_uv_t [H, d_c, d_v], cache [*, d_c + d_r], slots [T, slot_stride] (the cache row of each row's keys), lens [T]
 * (>= 1; at most slot_stride are read), out [T, H, d_v], scratch [threads, scratch_stride] with scratch_stride >=
 * G (2 T d_c + slot_stride), G = ceil(H / threads) heads per thread. */
static inline __attribute__((always_inline)) void absorbed_decode(
        const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t, int64_t qr_h, const void *w_uk,
        const void *w_uv_t, const float *cache, const int64_t *slots, int64_t slot_stride, const int64_t *lens,
        float scale, float *out, float *scratch, int64_t scratch_stride, int64_t rows, int64_t heads, int64_t d_n,
        int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads, const int bf16) {
    const int64_t esize = bf16 ? 2 : 4;
    const int64_t width = d_c + d_r, group = (heads + threads - 1) / threads;
    if (group > MAX_GROUP) abort();  /* ops/cpu_kernels.cpp runs enough threads that this cannot happen */
    #pragma omp parallel num_threads((int)threads)
    {
        const int64_t h0 = omp_get_thread_num() * group, h1 = h0 + group < heads ? h0 + group : heads;
        float *q_abs = scratch + omp_get_thread_num() * scratch_stride;  /* [T][G][d_c] */
        float *o_lat = q_abs + rows * group * d_c;                          /* [T][G][d_c] */
        float *s = o_lat + rows * group * d_c;                              /* [G][slot_stride] */
        /* absorb: q~[t] = q_n[t, h] W_UK[h], every row of a head at once */
        for (int64_t h = h0; h < h1; h++)
            small_gemm(q_n + h * qn_h, qn_t, (const char *)w_uk + h * d_n * d_c * esize, d_n, d_c,
                       q_abs + (h - h0) * d_c, group * d_c, rows, bf16);
        /* attend: keys outer and this thread's heads inner for the scores, heads outer for the weighted sum */
        const float *qa[MAX_GROUP], *qr[MAX_GROUP];
        float *ol[MAX_GROUP];
        for (int64_t t = 0; t < rows; t++) {
            const int64_t *slot = slots + t * slot_stride;
            const int64_t len = lens[t] < slot_stride ? lens[t] : slot_stride;
            for (int64_t h = h0; h < h1; h++) {
                qa[h - h0] = q_abs + (t * group + h - h0) * d_c;
                qr[h - h0] = q_r + t * qr_t + h * qr_h;
                ol[h - h0] = o_lat + (t * group + h - h0) * d_c;
            }
            for (int64_t j = 0; j < len; j += 2) {
                for (int64_t u = j + KEYS_AHEAD; u < j + KEYS_AHEAD + 2 && u < len; u++)
                    fetch_key(cache + slot[u] * width, width);
                scores(qa, qr, cache, width, slot, j, j + 1 == len, h1 - h0, d_c, d_r, scale, s, slot_stride);
            }
            for (int64_t h = h0; h < h1; h++) softmax(s + (h - h0) * slot_stride, len);
            weighted_keys(s, slot_stride, cache, width, slot, len, h1 - h0, d_c, ol);
        }
        /* up-project: out[t, h] = o_lat[t] W_UV^T[h], every row of a head at once */
        for (int64_t h = h0; h < h1; h++)
            small_gemm(o_lat + (h - h0) * d_c, group * d_c, (const char *)w_uv_t + h * d_c * d_v * esize, d_c, d_v,
                       out + h * d_v, heads * d_v, rows, bf16);
    }
}

#define DECODE_ARGS q_n, qn_t, qn_h, q_r, qr_t, qr_h, w_uk, w_uv_t, cache, slots, slot_stride, lens, scale, out, scratch, \
                    scratch_stride, rows, heads, d_n, d_r, d_c, d_v, threads

/* float32 W_UK and W_UV^T */
void mla_absorbed_decode_f32(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                             int64_t qr_h, const void *w_uk, const void *w_uv_t, const float *cache,
                             const int64_t *slots, int64_t slot_stride, const int64_t *lens, float scale, float *out,
                             float *scratch, int64_t scratch_stride, int64_t rows, int64_t heads, int64_t d_n,
                             int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads) {
    absorbed_decode(DECODE_ARGS, 0);
}

/* bfloat16 W_UK and W_UV^T (read at half the bytes; everything else float32) */
void mla_absorbed_decode_bf16w(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                               int64_t qr_h, const void *w_uk, const void *w_uv_t, const float *cache,
                               const int64_t *slots, int64_t slot_stride, const int64_t *lens, float scale, float *out,
                               float *scratch, int64_t scratch_stride, int64_t rows, int64_t heads, int64_t d_n,
                               int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads) {
    absorbed_decode(DECODE_ARGS, 1);
}

/* RoPE of one d_r vector x into y (y may be x): pair i is (x[2i], x[2i + 1]) when interleaved, else (x[i],
 * x[i + d_r / 2]); written de-interleaved, y[i] = a cos - b sin, y[i + d_r / 2] = b cos + a sin (as
 * mla_runtime.layers.rotary). */
static void rope(const float *x, float *y, const float *cos, const float *sin, int64_t d_r, int interleave) {
    const int64_t half = d_r / 2;
    float t[d_r];
    for (int64_t i = 0; i < half; i++) {
        const float a = interleave ? x[2 * i] : x[i], b = interleave ? x[2 * i + 1] : x[i + half];
        t[i] = a * cos[i] - b * sin[i];
        t[i + half] = b * cos[i] + a * sin[i];
    }
    for (int64_t i = 0; i < d_r; i++) y[i] = t[i];
}

/* The latent side of a decode step's rows, on one thread: for row t, cache[slots[t]] = [RMSNorm(c_t) * norm ;
 * RoPE(k_r_t)] from latent_t = [c_t ; k_r_t] (row stride lat_ld), and each head's RoPE part of q (q + t q_t + h q_h
 * + d_n, d_r values) rotated in place. cos, sin: [T, d_r / 2] with row stride cs_ld. */
void mla_rope_store_f32(const float *latent, int64_t lat_ld, const float *norm, float eps, float *q, int64_t q_t,
                        int64_t q_h, int64_t heads, int64_t d_n, const float *cos, const float *sin, int64_t cs_ld,
                        float *cache, const int64_t *slots, int64_t rows, int64_t d_c, int64_t d_r,
                        int64_t interleave) {
    for (int64_t t = 0; t < rows; t++) {
        const float *c = latent + t * lat_ld, *ct = cos + t * cs_ld, *st = sin + t * cs_ld;
        float *row = cache + slots[t] * (d_c + d_r);
        const float r = 1.0f / sqrtf(dot_f32(c, c, d_c) / (float)d_c + eps);
        for (int64_t i = 0; i < d_c; i++) row[i] = c[i] * r * norm[i];
        rope(c + d_c, row + d_c, ct, st, d_r, (int)interleave);
        for (int64_t h = 0; h < heads; h++) {
            float *qr = q + t * q_t + h * q_h + d_n;
            rope(qr, qr, ct, st, d_r, (int)interleave);
        }
    }
}
