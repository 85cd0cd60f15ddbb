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
 * Built with gemv_f32.c into one library by mla_kernels.cpu_gemv. */
#include <math.h>
#include <omp.h>

#include "simd.h"

#define MAX_GROUP 256  /* heads per thread */

/* y[0:n] = sum_r x[r] * row_r[0:n] with row_r = base + (idx ? idx[r] : r) * ld: rows of a matrix (or gathered
 * cache rows) scaled and summed, 64 columns (eight registers) at a time. */
static void row_sum(const float *x, const float *base, int64_t ld, const int64_t *idx, int64_t nrows, int64_t n,
                    float *y) {
    int64_t c = 0;
    for (; c + 64 <= n; c += 64) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
        for (int64_t r = 0; r < nrows; r++) {
            const float *row = base + (idx ? idx[r] : r) * ld + c;
            const __m256 s = _mm256_set1_ps(x[r]);
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(s, _mm256_loadu_ps(row + 8 * u), a[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(y + c + 8 * u, a[u]);
    }
    for (; c + 8 <= n; c += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t r = 0; r < nrows; r++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(x[r]), _mm256_loadu_ps(base + (idx ? idx[r] : r) * ld + c), a);
        _mm256_storeu_ps(y + c, a);
    }
    for (; c < n; c++) {
        float s = 0.0f;
        for (int64_t r = 0; r < nrows; r++) s += x[r] * base[(idx ? idx[r] : r) * ld + c];
        y[c] = s;
    }
}

/* softmax of s[0:n] in place */
static void softmax(float *s, int64_t n) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    for (int64_t j = 0; j < n; j++) sum += (s[j] = expf(s[j] - mx));
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; j++) s[j] *= inv;
}

/* y[0:n] += a * x[0:n] */
static inline void axpy(float a, const float *x, float *y, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* s[h * ld + j] = scale * (q[h] . key[:d_c] + qr[h] . key[d_c:]) for nh heads: four heads share each load of the
 * key, whose d_c + d_r values are read once per four heads. */
static void scores(const float *const *q, const float *const *qr, const float *key, int64_t nh, int64_t d_c,
                   int64_t d_r, float scale, float *s, int64_t ld, int64_t j) {
    int64_t h = 0;
    for (; h + 4 <= nh; h += 4) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = 0;
        for (; i + 8 <= d_c; i += 8) {
            const __m256 k = _mm256_loadu_ps(key + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i), k, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q[h + 1] + i), k, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q[h + 2] + i), k, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q[h + 3] + i), k, a3);
        }
        float t[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
        for (int u = 0; u < 4; u++) {
            for (int64_t c = i; c < d_c; c++) t[u] += q[h + u][c] * key[c];
            s[(h + u) * ld + j] = scale * (t[u] + dot_f32(qr[h + u], key + d_c, d_r));
        }
    }
    for (; h < nh; h++) s[h * ld + j] = scale * (dot_f32(q[h], key, d_c) + dot_f32(qr[h], key + d_c, d_r));
}

/* o[h][0:d_c] = sum_j p[h * ld + j] key_j[0:d_c] for nh heads, keys key_j = cache + slot[j] * width: two heads and
 * 32 columns at a time, in registers, so each key block is loaded once per two heads and nothing is stored until
 * the end. */
static void weighted_keys(const float *p, int64_t ld, const float *cache, int64_t width, const int64_t *slot,
                          int64_t len, int64_t nh, int64_t d_c, float *const *o) {
    int64_t h = 0;
    for (; h + 2 <= nh; h += 2) {
        int64_t c = 0;
        for (; c + 32 <= d_c; c += 32) {
            __m256 a[4], b[4];
            for (int u = 0; u < 4; u++) a[u] = b[u] = _mm256_setzero_ps();
            for (int64_t j = 0; j < len; j++) {
                const float *k = cache + slot[j] * width + c;
                const __m256 pa = _mm256_set1_ps(p[h * ld + j]), pb = _mm256_set1_ps(p[(h + 1) * ld + j]);
                for (int u = 0; u < 4; u++) {
                    const __m256 kv = _mm256_loadu_ps(k + 8 * u);
                    a[u] = _mm256_fmadd_ps(pa, kv, a[u]);
                    b[u] = _mm256_fmadd_ps(pb, kv, b[u]);
                }
            }
            for (int u = 0; u < 4; u++) {
                _mm256_storeu_ps(o[h] + c + 8 * u, a[u]);
                _mm256_storeu_ps(o[h + 1] + c + 8 * u, b[u]);
            }
        }
        for (; c < d_c; c++) {
            float sa = 0.0f, sb = 0.0f;
            for (int64_t j = 0; j < len; j++) {
                const float k = cache[slot[j] * width + c];
                sa += p[h * ld + j] * k;
                sb += p[(h + 1) * ld + j] * k;
            }
            o[h][c] = sa;
            o[h + 1][c] = sb;
        }
    }
    for (; h < nh; h++) row_sum(p + h * ld, cache, width, slot, len, d_c, o[h]);
}

/* q_n [T, H, d_n] and q_r [T, H, d_r] (strides per row and per head, elements contiguous), w_uk [H, d_n, d_c],
 * w_uv_t [H, d_c, d_v], cache [*, d_c + d_r], slots [T, slot_stride] (the cache row of each row's keys), lens [T]
 * (>= 1; at most slot_stride are read), out [T, H, d_v], scratch [threads, scratch_stride] with scratch_stride >=
 * G (2 T d_c + slot_stride), G = ceil(H / threads) heads per thread. */
void mla_absorbed_decode_f32(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                             int64_t qr_h, const float *w_uk, const float *w_uv_t, const float *cache,
                             const int64_t *slots, int64_t slot_stride, const int64_t *lens, float scale, float *out,
                             float *scratch, int64_t scratch_stride, int64_t rows, int64_t heads, int64_t d_n,
                             int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads) {
    const int64_t width = d_c + d_r, group = (heads + threads - 1) / threads;
    if (group > MAX_GROUP) return;  /* the caller runs enough threads (mla_kernels.cpu_gemv) */
    #pragma omp parallel num_threads((int)threads)
    {
        const int64_t h0 = omp_get_thread_num() * group, h1 = h0 + group < heads ? h0 + group : heads;
        float *q_abs = scratch + omp_get_thread_num() * scratch_stride;  /* [T][G][d_c] */
        float *o_lat = q_abs + rows * group * d_c;                          /* [T][G][d_c] */
        float *s = o_lat + rows * group * d_c;                              /* [G][slot_stride] */
        /* absorb: each head's W_UK streamed front to back once, every row's q~ accumulated in cache */
        for (int64_t i = 0; i < rows * group * d_c; i++) q_abs[i] = 0.0f;
        for (int64_t h = h0; h < h1; h++)
            for (int64_t n = 0; n < d_n; n++)
                for (int64_t t = 0; t < rows; t++)
                    axpy(q_n[t * qn_t + h * qn_h + n], w_uk + (h * d_n + n) * d_c, q_abs + (t * group + h - h0) * d_c,
                         d_c);
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
            for (int64_t j = 0; j < len; j++)
                scores(qa, qr, cache + slot[j] * width, h1 - h0, d_c, d_r, scale, s, slot_stride, j);
            for (int64_t h = h0; h < h1; h++) softmax(s + (h - h0) * slot_stride, len);
            weighted_keys(s, slot_stride, cache, width, slot, len, h1 - h0, d_c, ol);
        }
        /* up-project: each head's W_UV read from memory once */
        for (int64_t h = h0; h < h1; h++)
            for (int64_t t = 0; t < rows; t++)
                row_sum(o_lat + (t * group + h - h0) * d_c, w_uv_t + h * d_c * d_v, d_v, NULL, d_c, d_v,
                        out + (t * heads + h) * d_v);
    }
}
