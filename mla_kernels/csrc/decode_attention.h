/* The absorbed decode attention and the prefill's up-projected attention (mla_decode_f32.c), written once over the
 * vector vocabulary of vec_avx2.h / vec_avx512.h and included once per instruction set, between that header and
 * vec_end.h.
 * Column blocks are four vectors wide (32 floats with AVX2, 64 with AVX-512).
 *
 * The latent cache holds float32, bfloat16 or float16 rows, or int8 / float8_e4m3fn rows with a scale per token
 * and part (ck: CacheKind). A row is widened exactly as it is read, and a quantised value multiplied by its scale
 * (one rounding, as dequantize_rows), so every sum is the one a float32 cache of the dequantised values gives. */

#if VL == 8
#define WEIGH_HEADS 2   /* heads of a tile of the weighted sum: 2 x 4 vectors of sums */
#define PREFILL_TILE 3  /* vectors of keys a tile of the prefill's scores: 4 rows x 3 vectors of sums */
#define GEMM_ROWS 2     /* rows of a a register tile of small_gemm: 2 x 4 vectors of sums in AVX2's 16 registers */
#else
#define WEIGH_HEADS 4   /* 4 x 4 vectors of sums */
#define PREFILL_TILE 3  /* 4 x 3 vectors of sums (4 x 4 measured the same, with 32 KB of keys a tile) */
#define GEMM_ROWS 4     /* 4 x 4 vectors of sums in AVX-512's 32 registers */
#endif

/* VL cached values from c + i as floats, times sv (quantised caches: the part's scale, kscale); ck, as load_w's wf,
 * a constant wherever this is inlined. */
static inline __attribute__((always_inline)) V SFX(load_c)(const void *c, int64_t i, const int ck, const V sv) {
    if (ck == C_I8) return V_MUL(V_I8((const int8_t *)c + i), sv);
    if (ck == C_FP8) return V_MUL(V_FP8((const uint8_t *)c + i), sv);
    return ck == C_BF16 ? V_BF16((const uint16_t *)c + i) : ck == C_F16 ? V_F16((const uint16_t *)c + i)
                                                          : V_LOAD((const float *)c + i);
}

/* VL weights at (i, j .. j + VL - 1) of a head's k x n factor b as floats, in format wf (FactorFormat: float32,
 * bfloat16, or runs, whose values fma(A, q, B) are the ones load1w gives). The format is a compile-time constant
 * wherever this is inlined, so each format gets its own loops. */
static inline __attribute__((always_inline)) V SFX(load_w)(const void *b, int64_t k, int64_t n, int64_t i, int64_t j,
                                                           const int wf) {
    if (wf == FACTOR_RUNS) {
        const float *a = (const float *)((const int8_t *)b + k * n) + i / FACTOR_RUN * n + j;
        return V_FMA(V_LOAD(a), V_I8((const int8_t *)b + i * n + j), V_LOAD(a + k / FACTOR_RUN * n));
    }
    return wf == FACTOR_BF16 ? V_BF16((const uint16_t *)b + i * n + j) : V_LOAD((const float *)b + i * n + j);
}

/* y[0:n] = sum_i x[i] b[i][0:n] for one row x and a row-major b [k, n], reading b front to back (small_gemm's column
 * blocks stream a cold matrix more slowly). Every sum runs over i in order as small_gemm's do, its columns past the
 * last block of 4 VL by the same scalar expression: a row's result does not depend on how many rows share the call. */
static inline __attribute__((always_inline)) void SFX(vec_mat)(const float *x, const void *b, int64_t k, int64_t n,
                                                               float *y, const int wf) {
    const int64_t nb = n - n % (4 * VL);
    for (int64_t j = 0; j < n; j++) y[j] = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const V p = V_SET1(x[i]);
        for (int64_t j = 0; j < nb; j += VL) V_STORE(y + j, V_FMA(p, SFX(load_w)(b, k, n, i, j, wf), V_LOAD(y + j)));
    }
    for (int64_t j = nb; j < n; j++) {
        float x0 = 0.0f;
        for (int64_t i = 0; i < k; i++) x0 = fmaf(x[i], load1w(b, k, n, i, j, wf), x0);
        y[j] = x0;
    }
}

/* c[t][0:n] = sum_k a[t][k] b[k][0:n] for t < m: rows of a (row stride lda) times the row-major b [k, n] (float32 or
 * bfloat16) into rows of c (row stride ldc), GEMM_ROWS rows of a by a column block of b in a register tile (one load
 * of b serves every row of the tile; the last tile repeats the last row where m is not a multiple). b is taken
 * GEMM_KC of its rows at a time, and each column block of those (at most 32 KB of float32) serves every row of a
 * while it is in L1. A chunk's sums continue from the last one's, so each sum runs over k in order, as one pass
 * would: a row's result does not depend on the tile it is in. */
static inline __attribute__((always_inline)) void SFX(small_gemm)(const float *a, int64_t lda, const void *b,
                                                                  int64_t k, int64_t n, float *c, int64_t ldc,
                                                                  int64_t m, const int wf) {
    if (m == 1) {
        SFX(vec_mat)(a, b, k, n, c, wf);
        return;
    }
    prefetch(b, factor_bytes(k, n, wf));
    const int64_t nb = n - n % (4 * VL);
    for (int64_t k0 = 0; k0 < k; k0 += GEMM_KC) {
        const int64_t k1 = k0 + GEMM_KC < k ? k0 + GEMM_KC : k;
        for (int64_t t = 0; t < m; t += GEMM_ROWS) {
            const float *ar[GEMM_ROWS];
            float *cr[GEMM_ROWS];
            for (int r = 0; r < GEMM_ROWS; r++) {
                const int64_t row = t + r < m ? t + r : m - 1;
                ar[r] = a + row * lda;
                cr[r] = c + row * ldc;
            }
            for (int64_t j = 0; j < nb; j += 4 * VL) {
                V acc[GEMM_ROWS][4];
                for (int r = 0; r < GEMM_ROWS; r++)
                    for (int u = 0; u < 4; u++) acc[r][u] = k0 ? V_LOAD(cr[r] + j + VL * u) : V_ZERO();
                for (int64_t i = k0; i < k1; i++) {
                    V bv[4];
                    for (int u = 0; u < 4; u++) bv[u] = SFX(load_w)(b, k, n, i, j + VL * u, wf);
                    for (int r = 0; r < GEMM_ROWS; r++) {
                        const V p = V_SET1(ar[r][i]);
                        for (int u = 0; u < 4; u++) acc[r][u] = V_FMA(p, bv[u], acc[r][u]);
                    }
                }
                for (int r = GEMM_ROWS - 1; r >= 0; r--)  /* a repeated row's copies hold the same sums */
                    for (int u = 0; u < 4; u++) V_STORE(cr[r] + j + VL * u, acc[r][u]);
            }
            for (int r = 0; r < GEMM_ROWS && t + r < m; r++)  /* columns past the last block */
                for (int64_t j = nb; j < n; j++) {
                    float x0 = k0 ? cr[r][j] : 0.0f;
                    for (int64_t i = k0; i < k1; i++) x0 = fmaf(ar[r][i], load1w(b, k, n, i, j, wf), x0);
                    cr[r][j] = x0;
                }
        }
    }
}

/* softmax of s[0:n] in place; returns log(sum_j e^s[j]) (the max plus the log of the shifted sum) */
static float SFX(softmax)(float *s, int64_t n) {
    const int64_t nv = n - n % VL;
    V mv = V_SET1(-INFINITY);
    for (int64_t j = 0; j < nv; j += VL) mv = V_MAX(mv, V_LOAD(s + j));
    float mx = V_HMAX(mv);
    for (int64_t j = nv; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const V mb = V_SET1(mx);
    V sv = V_ZERO();
    for (int64_t j = 0; j < nv; j += VL) {
        const V e = V_EXP(V_SUB(V_LOAD(s + j), mb));
        V_STORE(s + j, e);
        sv = V_ADD(sv, e);
    }
    float sum = V_HSUM(sv);
    for (int64_t j = nv; j < n; j++) sum += (s[j] = expf(s[j] - mx));
    const float inv = 1.0f / sum;
    const V iv = V_SET1(inv);
    for (int64_t j = 0; j < nv; j += VL) V_STORE(s + j, V_MUL(V_LOAD(s + j), iv));
    for (int64_t j = nv; j < n; j++) s[j] *= inv;
    return mx + logf(sum);
}

/* Accumulate four heads' queries q[0..3][0:n] against two keys ka, kb (four heads by two keys in eight registers:
 * each load of a key serves four heads, each load of a query two keys). */
static inline __attribute__((always_inline)) void SFX(tile4x2)(const float *const *q, const void *ka, const void *kb,
                                                               int64_t n, V *acc, const int ck, const V sa,
                                                               const V sb) {
    for (int64_t i = 0; i + VL <= n; i += VL) {
        const V a = SFX(load_c)(ka, i, ck, sa), b = SFX(load_c)(kb, i, ck, sb);
        for (int u = 0; u < 4; u++) {
            const V qv = V_LOAD(q[u] + i);
            acc[2 * u] = V_FMA(qv, a, acc[2 * u]);
            acc[2 * u + 1] = V_FMA(qv, b, acc[2 * u + 1]);
        }
    }
}

/* s[h * ld + j] = scale * (q[h] . key_j[:d_c] + qr[h] . key_j[d_c:]) for nh heads and the keys j0 and j0 + 1
 * (key_j = row slot[j] of the cache, width values; with one = 1 only j0). Four heads by two keys at a time when d_c
 * and d_r are multiples of VL (the last four repeating the last head where nh is not a multiple: a head's score is
 * the same whichever heads share its call, as the threads' split of the heads varies with the rows), else one dot
 * product at a time. */
static inline __attribute__((always_inline)) void SFX(scores)(const float *const *q, const float *const *qr,
                                                              const void *cache, int64_t width, const int64_t *slot,
                                                              int64_t j0, int one, int64_t nh, int64_t d_c,
                                                              int64_t d_r, float scale, float *s, int64_t ld,
                                                              const float *cs, const int ck) {
    const int64_t es = cache_bytes(ck), sa = slot[j0], sb = one ? sa : slot[j0 + 1];
    const char *ka = (const char *)cache + sa * width * es, *kb = (const char *)cache + sb * width * es;
    const float ca = kscale(cs, sa, 0, ck), ra = kscale(cs, sa, 1, ck);
    const float cb = kscale(cs, sb, 0, ck), rb = kscale(cs, sb, 1, ck);
    int64_t h = 0;
    if (d_c % VL == 0 && d_r % VL == 0) {
        for (; h < nh; h += 4) {
            const float *qh[4], *rh[4];
            for (int u = 0; u < 4; u++) {
                qh[u] = q[h + u < nh ? h + u : nh - 1];
                rh[u] = qr[h + u < nh ? h + u : nh - 1];
            }
            V acc[8];
            for (int u = 0; u < 8; u++) acc[u] = V_ZERO();
            SFX(tile4x2)(qh, ka, kb, d_c, acc, ck, V_SET1(ca), V_SET1(cb));
            SFX(tile4x2)(rh, ka + d_c * es, kb + d_c * es, d_r, acc, ck, V_SET1(ra), V_SET1(rb));
            for (int u = 0; u < 4 && h + u < nh; u++) {
                s[(h + u) * ld + j0] = scale * V_HSUM(acc[2 * u]);
                if (!one) s[(h + u) * ld + j0 + 1] = scale * V_HSUM(acc[2 * u + 1]);
            }
        }
    }
    for (; h < nh; h++)
        for (int k = 0; k < 2 - one; k++) {
            const char *key = k ? kb : ka;
            s[h * ld + j0 + k] = scale * (dot_c(q[h], key, d_c, ck, k ? cb : ca) +
                                          dot_c(qr[h], key + d_c * es, d_r, ck, k ? rb : ra));
        }
}

/* o[h][c0:c0 + 4 VL] (+)= sum_{j0 <= j < j1} p[h * ld + j] key_j[c0:c0 + 4 VL] for WEIGH_HEADS heads hs[0..] (a
 * repeated head computes its sums twice), in a register tile: each key block is loaded once for all of them. */
static inline __attribute__((always_inline)) void SFX(weigh_block)(const float *p, int64_t ld, const void *cache,
                                                                   int64_t width, const int64_t *slot, int64_t j0,
                                                                   int64_t j1, const int64_t *hs, int64_t c0,
                                                                   float *const *o, const float *cs, const int ck) {
    V acc[WEIGH_HEADS][4];
    for (int r = 0; r < WEIGH_HEADS; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = j0 ? V_LOAD(o[hs[r]] + c0 + VL * u) : V_ZERO();
    for (int64_t j = j0; j < j1; j++) {
        const int64_t k = slot[j] * width + c0;
        const V sk = V_SET1(kscale(cs, slot[j], 0, ck));
        V kv[4];
        for (int u = 0; u < 4; u++) kv[u] = SFX(load_c)(cache, k + VL * u, ck, sk);
        for (int r = 0; r < WEIGH_HEADS; r++) {
            const V pr = V_SET1(p[hs[r] * ld + j]);
            for (int u = 0; u < 4; u++) acc[r][u] = V_FMA(pr, kv[u], acc[r][u]);
        }
    }
    for (int r = WEIGH_HEADS - 1; r >= 0; r--)  /* a repeated head's copies hold the same sums */
        for (int u = 0; u < 4; u++) V_STORE(o[hs[r]] + c0 + VL * u, acc[r][u]);
}

/* o[h][0:d_c] = sum_j p[h * ld + j] key_j[0:d_c] for nh heads, keys key_j = cache + slot[j] * width. The keys go in
 * chunks of WEIGH_KEYS (a chunk's latents fit in L2; a row's whole context may not), and within a chunk a column block
 * of them at a time (in L1) serves every WEIGH_HEADS heads. */
static inline __attribute__((always_inline)) void SFX(weighted_keys)(const float *p, int64_t ld, const void *cache,
                                                                     int64_t width, const int64_t *slot, int64_t len,
                                                                     int64_t nh, int64_t d_c, float *const *o,
                                                                     const float *cs, const int ck) {
    const int64_t cb = d_c - d_c % (4 * VL);
    for (int64_t j0 = 0; j0 < len; j0 += WEIGH_KEYS) {
        const int64_t j1 = j0 + WEIGH_KEYS < len ? j0 + WEIGH_KEYS : len;
        for (int64_t c = 0; c < cb; c += 4 * VL)
            for (int64_t h = 0; h < nh; h += WEIGH_HEADS) {
                int64_t hs[WEIGH_HEADS];
                for (int r = 0; r < WEIGH_HEADS; r++) hs[r] = h + r < nh ? h + r : nh - 1;
                SFX(weigh_block)(p, ld, cache, width, slot, j0, j1, hs, c, o, cs, ck);
            }
        for (int64_t h = 0; h < nh; h++)  /* columns past the last block */
            for (int64_t c = cb; c < d_c; c++) {
                float acc = j0 ? o[h][c] : 0.0f;
                for (int64_t j = j0; j < j1; j++)
                    acc += p[h * ld + j] * value_c(cache, slot[j] * width + c, ck, cs, slot[j], 0);
                o[h][c] = acc;
            }
    }
}

/* q_n [T, H, d_n] and q_r [T, H, d_r] (strides per row and per head, elements contiguous), w_uk [H, d_n, d_c],
 * w_uv_t [H, d_c, d_v], cache [*, d_c + d_r] of kind ck (cs [*, 2]: its scales where quantised, else unread),
 * slots [T, slot_stride] (the cache row of each row's keys), lens [T]
 * (>= 1; at most slot_stride are read), out [T, H, d_v], scratch [threads, scratch_stride] with scratch_stride >=
 * mla_decode_scratch(T, H, d_c, slot_stride, threads). */
static inline __attribute__((always_inline)) void SFX(absorbed_decode)(
        const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t, int64_t qr_h, const void *w_uk,
                                 const void *w_uv_t, const void *cache, const float *cs,
                                 const int64_t *slots, int64_t slot_stride, const int64_t *lens, float scale,
                                 float *out, float *scratch, int64_t scratch_stride, int64_t rows, int64_t heads,
                                 int64_t d_n, int64_t d_r, int64_t d_c, int64_t d_v, int64_t threads, const int wf,
                                 const int ck) {
    const int64_t uk_bytes = factor_bytes(d_n, d_c, wf), uv_bytes = factor_bytes(d_c, d_v, wf), width = d_c + d_r, by_rows = mla_decode_by_rows(rows, heads, threads);
    const int64_t group = by_rows ? heads : (heads + threads - 1) / threads;
    if (group > MAX_GROUP) abort();  /* ops/cpu_kernels.cpp runs enough threads that this cannot happen */
    #pragma omp parallel num_threads((int)threads)
    {
        /* this thread's heads [h0, h1) of its rows [t0, t1) (mla_decode_by_rows): a group of heads of every row, or
         * every head of a run of rows (at least two each) */
        const int64_t id = omp_get_thread_num();
        const int64_t h0 = by_rows ? 0 : id * group, h1 = by_rows ? heads : (h0 + group < heads ? h0 + group : heads);
        const int64_t t0 = by_rows ? id * rows / threads : 0, t1 = by_rows ? (id + 1) * rows / threads : rows;
        const int64_t m = t1 - t0;
        float *q_abs = scratch + id * scratch_stride;  /* [m][group][d_c] */
        float *o_lat = q_abs + m * group * d_c;          /* [m][group][d_c] */
        float *s = o_lat + m * group * d_c;              /* [group][slot_stride] */
        /* absorb: q~[t] = q_n[t, h] W_UK[h], every row of a head at once */
        for (int64_t h = h0; h < h1 && m; h++)
            SFX(small_gemm)(q_n + t0 * qn_t + h * qn_h, qn_t, (const char *)w_uk + h * uk_bytes, d_n, d_c,
                            q_abs + (h - h0) * d_c, group * d_c, m, wf);
        /* attend: keys outer and this thread's heads inner for the scores, heads outer for the weighted sum */
        const float *qa[MAX_GROUP], *qr[MAX_GROUP];
        float *ol[MAX_GROUP];
        for (int64_t t = t0; t < t1; t++) {
            const int64_t *slot = slots + t * slot_stride;
            const int64_t len = lens[t] < slot_stride ? lens[t] : slot_stride;
            for (int64_t h = h0; h < h1; h++) {
                qa[h - h0] = q_abs + ((t - t0) * group + h - h0) * d_c;
                qr[h - h0] = q_r + t * qr_t + h * qr_h;
                ol[h - h0] = o_lat + ((t - t0) * group + h - h0) * d_c;
            }
            for (int64_t j = 0; j < len; j += 2) {
                for (int64_t u = j + KEYS_AHEAD; u < j + KEYS_AHEAD + 2 && u < len; u++)
                    fetch_key((const char *)cache + slot[u] * width * cache_bytes(ck), width * cache_bytes(ck));
                SFX(scores)(qa, qr, cache, width, slot, j, j + 1 == len, h1 - h0, d_c, d_r, scale, s, slot_stride, cs,
                            ck);
            }
            for (int64_t h = h0; h < h1; h++) SFX(softmax)(s + (h - h0) * slot_stride, len);
            SFX(weighted_keys)(s, slot_stride, cache, width, slot, len, h1 - h0, d_c, ol, cs, ck);
        }
        /* up-project: out[t, h] = o_lat[t] W_UV^T[h], every row of a head at once */
        for (int64_t h = h0; h < h1 && m; h++)
            SFX(small_gemm)(o_lat + (h - h0) * d_c, group * d_c, (const char *)w_uv_t + h * uv_bytes, d_c,
                            d_v, out + t0 * heads * d_v + h * d_v, heads * d_v, m, wf);
    }
}

/* o[r][c0:c0 + 4 VL] = sum_{j < n} p[r * ld + j] val_j[c0:c0 + 4 VL] for WEIGH_HEADS rows rs[0..] (a repeated row
 * computes its sums twice), values val_j = v + j * v_t: a register tile, each block of a value read once for them. */
static inline __attribute__((always_inline)) void SFX(weigh_rows)(const float *p, int64_t ld, const float *v,
                                                                  int64_t v_t, int64_t n, const int64_t *rs,
                                                                  int64_t c0, float *const *o) {
    V acc[WEIGH_HEADS][4];
    for (int r = 0; r < WEIGH_HEADS; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = V_ZERO();
    for (int64_t j = 0; j < n; j++) {
        V kv[4];
        for (int u = 0; u < 4; u++) kv[u] = V_LOAD(v + j * v_t + c0 + VL * u);
        for (int r = 0; r < WEIGH_HEADS; r++) {
            const V pr = V_SET1(p[rs[r] * ld + j]);
            for (int u = 0; u < 4; u++) acc[r][u] = V_FMA(pr, kv[u], acc[r][u]);
        }
    }
    for (int r = WEIGH_HEADS - 1; r >= 0; r--)
        for (int u = 0; u < 4; u++) V_STORE(o[rs[r]] + c0 + VL * u, acc[r][u]);
}

/* acc[r][u] += sum_{i < d} q[r][i] kt[i * kt_d + u VL .. + VL) for four rows q[0..3] and PREFILL_TILE vectors of keys
 * stored across the lanes (kt: d rows of keys, row stride kt_d): each score is one chain of multiply-adds in the
 * order of i, and no lane is ever summed across. */
static_assert(PREFILL_TILE * VL <= MLA_PREFILL_KEY_PAD, "a tile of keys reads and writes past the last key");
static inline __attribute__((always_inline)) void SFX(keys_tile)(const float *const *q, const float *kt, int64_t kt_d,
                                                                 int64_t d, V acc[4][PREFILL_TILE]) {
    for (int64_t i = 0; i < d; i++) {
        V k[PREFILL_TILE];
        for (int u = 0; u < PREFILL_TILE; u++) k[u] = V_LOAD(kt + i * kt_d + u * VL);
        for (int r = 0; r < 4; r++) {
            const V qv = V_SET1(q[r][i]);
            for (int u = 0; u < PREFILL_TILE; u++) acc[r][u] = V_FMA(qv, k[u], acc[r][u]);
        }
    }
}

/* The up-projected (naive) attention of prompt rows, causal and bottom-right aligned, for the sequences b < nseq:
 * rows cu_q[b] .. cu_q[b + 1] of q_n [T, H, d_n] and q_r [T, H, d_r] over keys cu_k[b] .. cu_k[b + 1] of k_n, k_r and
 * v [S, H, d_v]; row i of a sequence of q_len rows and k_len keys sees keys j <= k_len - q_len + i. The keys are
 * stored transposed, keys along the rows: kt [H][d_n][.] (head stride kt_h, row stride kt_d) and krt [d_r][.] (row
 * stride krt_d; one RoPE key per token, shared by the heads), key j of the sequence in column cu_k[b] + j, with
 * MLA_PREFILL_KEY_PAD readable columns past the last key (their scores are never used). Strides per row and head of
 * q_n, q_r and v are free, elements contiguous. out [T, H, d_v] and lse [T, H] (log of the softmax's sum of
 * exponentials) are contiguous.
 *
 * A task is PREFILL_ROWS rows of one head, the later rows (more keys) first; its scores [PREFILL_ROWS][k_len +
 * MLA_PREFILL_KEY_PAD] sit in scratch + thread * scratch_stride. They go four rows by PREFILL_TILE vectors of keys
 * in registers (keys_tile), each tile of keys for every four rows that see any of it (the tile stays in L1), each
 * row to its own last key but for the other three rows of its four and the tile's end; then each row's softmax,
 * then its weighted values, WEIGH_HEADS rows at a time. */
static void SFX(prefill_attention)(const float *q_n, int64_t qn_t, int64_t qn_h, const float *q_r, int64_t qr_t,
                                   int64_t qr_h, const float *kt, int64_t kt_h, int64_t kt_d, const float *krt,
                                   int64_t krt_d, const float *v, int64_t v_t, int64_t v_h, const int64_t *cu_q,
                                   const int64_t *cu_k, int64_t nseq, float scale, float *out, float *lse,
                                   float *scratch, int64_t scratch_stride, int64_t heads, int64_t d_n, int64_t d_r,
                                   int64_t d_v, int64_t threads) {
    int64_t first[nseq + 1];  /* the first task of each sequence */
    first[0] = 0;
    for (int64_t b = 0; b < nseq; b++)
        first[b + 1] = first[b] + heads * ((cu_q[b + 1] - cu_q[b] + PREFILL_ROWS - 1) / PREFILL_ROWS);
    const int64_t cb = d_v - d_v % (4 * VL), tile = PREFILL_TILE * VL;
    const V vscale = V_SET1(scale);
    #pragma omp parallel for schedule(dynamic, 1) num_threads((int)threads)
    for (int64_t task = 0; task < first[nseq]; task++) {
        int64_t b = 0;
        while (task >= first[b + 1]) b++;
        const int64_t q_len = cu_q[b + 1] - cu_q[b], k_len = cu_k[b + 1] - cu_k[b], ctx = k_len - q_len;
        const int64_t blocks = (q_len + PREFILL_ROWS - 1) / PREFILL_ROWS, local = task - first[b];
        const int64_t h = local % heads, i0 = (blocks - 1 - local / heads) * PREFILL_ROWS;
        const int64_t i1 = i0 + PREFILL_ROWS < q_len ? i0 + PREFILL_ROWS : q_len, m = i1 - i0;
        const int64_t ld = k_len + MLA_PREFILL_KEY_PAD;  /* a row of scores, room for the last tile's end */
        float *s = scratch + (int64_t)omp_get_thread_num() * scratch_stride;  /* [m][ld] */
        const float *kth = kt + h * kt_h + cu_k[b], *krb = krt + cu_k[b], *vh = v + cu_k[b] * v_t + h * v_h;
        /* scores */
        for (int64_t j = 0; j < ctx + i1; j += tile)
            for (int64_t i = i0; i < i1; i += 4) {
                const int64_t top = i + 4 < i1 ? i + 4 : i1;  /* rows [i, top) */
                if (j >= ctx + top) continue;                 /* no key of the tile is theirs */
                const float *qa[4], *qb[4];
                for (int u = 0; u < 4; u++) {
                    const int64_t t = cu_q[b] + (i + u < top ? i + u : top - 1);
                    qa[u] = q_n + t * qn_t + h * qn_h;
                    qb[u] = q_r + t * qr_t + h * qr_h;
                }
                V acc[4][PREFILL_TILE];
                for (int r = 0; r < 4; r++)
                    for (int u = 0; u < PREFILL_TILE; u++) acc[r][u] = V_ZERO();
                SFX(keys_tile)(qa, kth + j, kt_d, d_n, acc);
                SFX(keys_tile)(qb, krb + j, krt_d, d_r, acc);
                for (int r = 0; r < top - i; r++)
                    for (int u = 0; u < PREFILL_TILE; u++)
                        V_STORE(s + (i + r - i0) * ld + j + u * VL, V_MUL(vscale, acc[r][u]));
            }
        /* softmax over each row's own keys; zeros up to the last key its four rows computed */
        for (int64_t i = i0; i < i1; i++) {
            float *row = s + (i - i0) * ld;
            const int64_t sub = i - (i - i0) % 4, top = sub + 4 < i1 ? sub + 4 : i1;  /* its four rows [sub, top) */
            const int64_t n = ctx + i + 1, upto = ctx + top;
            lse[(cu_q[b] + i) * heads + h] = SFX(softmax)(row, n);
            for (int64_t j = n; j < upto; j++) row[j] = 0.0f;
        }
        /* weighted values: row i's output over keys up to its own last, WEIGH_HEADS rows at a time */
        float *o[PREFILL_ROWS];
        for (int64_t i = i0; i < i1; i++) o[i - i0] = out + ((cu_q[b] + i) * heads + h) * d_v;
        for (int64_t r = 0; r < m; r += WEIGH_HEADS) {
            int64_t rs[WEIGH_HEADS];
            for (int u = 0; u < WEIGH_HEADS; u++) rs[u] = r + u < m ? r + u : m - 1;
            const int64_t n = ctx + i0 + rs[WEIGH_HEADS - 1] + 1;  /* the tile's last row's keys (p is 0 past a row's) */
            for (int64_t c = 0; c < cb; c += 4 * VL) SFX(weigh_rows)(s, ld, vh, v_t, n, rs, c, o);
            for (int u = 0; u < WEIGH_HEADS && r + u < m; u++)  /* columns past the last block */
                for (int64_t c = cb; c < d_v; c++) {
                    float acc = 0.0f;
                    for (int64_t j = 0; j < n; j++) acc += s[(r + u) * ld + j] * vh[j * v_t + c];
                    o[r + u][c] = acc;
                }
        }
    }
}

#undef GEMM_ROWS
#undef WEIGH_HEADS
#undef PREFILL_TILE
