/* The W8A8 product of gemm_w8a8.c (int8 weights against int8 rows, both held as exact int32 sums), written once over
 * the vector vocabulary (vec_avx2.h, vec_avx512.h) and included once per instruction set. Every output's integer sum
 * is exact (where it fits in int32), so its value does not depend on the instruction set, on the order of the steps
 * or on the rows beside it: each row's result is the same bits however many rows share the call. */

#if VL == 8
#define W8_STREAMS 3 /* AVX2's 16 registers: three weight rows by four input rows of int32 sums */
#else
#define W8_STREAMS 4 /* AVX-512's 32: four by four */
#endif
#define W8_BLOCK 4 /* input rows a step */
#define W8_ROWS_BYTES (256 * 1024) /* the input rows a pass over the tiles takes (w8a8_rows) */

/* Weight rows rows[0 .. R) of w [n, k] against m <= W8_BLOCK input rows xq [m, k] (int8 values held as int16,
 * sign-extended once by the caller), VI_STEP values a step, each weight vector widened once for all the rows and
 * each input vector loaded once for all the weight rows; the tail (k not a multiple of VI_STEP) in scalar integers.
 * y[j, c] = float(sum) * sx[j] * sw[c]. Called with constant R and m, so the sums live in registers. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(w8a8_tile)(const int8_t *w, const float *sw,
                                                                          const int16_t *xq, const float *sx,
                                                                          float *y, const int64_t *rows, const int R,
                                                                          const int m, int64_t n, int64_t k) {
    const int64_t kv = k - k % VI_STEP;
    VI a[W8_STREAMS][W8_BLOCK];
    for (int q = 0; q < R; q++)
        for (int j = 0; j < m; j++) a[q][j] = VI_ZERO();
    for (int64_t i = 0; i < kv; i += VI_STEP) {
        VI wv[W8_STREAMS];
        for (int q = 0; q < R; q++) {
            if (!(i & 63)) _mm_prefetch((const char *)(w + rows[q] * k + i) + 1024, _MM_HINT_T0);
            wv[q] = VI_W8(w + rows[q] * k + i);
        }
        for (int j = 0; j < m; j++) {
            const VI xv = VI_X16(xq + j * k + i);
            for (int q = 0; q < R; q++) a[q][j] = VI_DOT(a[q][j], wv[q], xv);
        }
    }
    for (int q = 0; q < R; q++) {
        const int8_t *wr = w + rows[q] * k;
        for (int j = 0; j < m; j++) {
            int32_t s = VI_ISUM(a[q][j]);
            for (int64_t i = kv; i < k; i++) s += (int32_t)wr[i] * xq[j * k + i];
            y[j * n + rows[q]] = (float)s * sx[j] * sw[rows[q]];
        }
    }
}

#if VL == 16
/* AVX-512 VNNI's byte products, 64 values a step (vpdpbusd: unsigned bytes times signed bytes, four to an int32
 * lane) where the int16 tile takes 32 (vpdpwssd): the input rows come offset to unsigned bytes, xu = xq + 128, so
 * sum_i xu[i] w[i] = sum_i xq[i] w[i] + 128 wsum, with wsum = sum_i w[i] over the same values, summed in the same
 * pass (one more vpdpbusd a weight vector, against ones: the weight read once). The same exact integers as
 * w8a8_tile, so the same bits; the tail (k not a multiple of 64) from xq in scalar integers. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(w8a8_tile_u8)(const int8_t *w, const float *sw,
                                                                             const uint8_t *xu, const int16_t *xq,
                                                                             const float *sx, float *y,
                                                                             const int64_t *rows, const int R,
                                                                             const int m, int64_t n, int64_t k) {
    const int64_t kv = k - k % 64;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i a[W8_STREAMS][W8_BLOCK], ws[W8_STREAMS];
    for (int q = 0; q < R; q++) {
        ws[q] = _mm512_setzero_si512();
        for (int j = 0; j < m; j++) a[q][j] = _mm512_setzero_si512();
    }
    for (int64_t i = 0; i < kv; i += 64) {
        __m512i wv[W8_STREAMS];
        for (int q = 0; q < R; q++) {
            _mm_prefetch((const char *)(w + rows[q] * k + i) + 1024, _MM_HINT_T0);
            wv[q] = _mm512_loadu_si512((const void *)(w + rows[q] * k + i));
            ws[q] = _mm512_dpbusd_epi32(ws[q], ones, wv[q]);
        }
        for (int j = 0; j < m; j++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xu + j * k + i));
            for (int q = 0; q < R; q++) a[q][j] = _mm512_dpbusd_epi32(a[q][j], xv, wv[q]);
        }
    }
    for (int q = 0; q < R; q++) {
        const int8_t *wr = w + rows[q] * k;
        const int32_t wsum = _mm512_reduce_add_epi32(ws[q]);
        for (int j = 0; j < m; j++) {
            int32_t s = _mm512_reduce_add_epi32(a[q][j]) - 128 * wsum;
            for (int64_t i = kv; i < k; i++) s += (int32_t)wr[i] * xq[j * k + i];
            y[j * n + rows[q]] = (float)s * sx[j] * sw[rows[q]];
        }
    }
}
#endif

/* One step of the drivers below: the weight rows rr[0 .. R) against input rows j .. j + mb (mb <= W8_BLOCK), each
 * count its own inlined tile; with xu (the rows offset to unsigned bytes: AVX-512 VNNI only) the byte tile
 * (w8a8_tile_u8) in place of the int16 one. */
#if VL == 16
#define W8_TILE(R, M)                                                                                                \
    if (xu)                                                                                                          \
        SFX(w8a8_tile_u8)(w, sw, xu + j * k, xq + j * k, sx + j, y + j * n, rr, R, M, n, k);                         \
    else                                                                                                             \
        SFX(w8a8_tile)(w, sw, xq + j * k, sx + j, y + j * n, rr, R, M, n, k)
#else
#define W8_TILE(R, M) SFX(w8a8_tile)(w, sw, xq + j * k, sx + j, y + j * n, rr, R, M, n, k)
#endif
#define W8_ROWS(R)                                                                                                   \
    switch (mb) {                                                                                                    \
        case 1: W8_TILE(R, 1); break;                                                                                \
        case 2: W8_TILE(R, 2); break;                                                                                \
        case 3: W8_TILE(R, 3); break;                                                                                \
        default: W8_TILE(R, 4); break;                                                                               \
    }

/* The whole product: each thread takes a contiguous range of W8_STREAMS-row tiles of the weight (read as that many
 * streams) and passes every input row over each tile, W8_BLOCK at a time, while the tile is in cache. */
VI_TARGET static void SFX(w8a8_rows)(const int8_t *w, const float *sw, const int16_t *xq, const uint8_t *xu,
                                     const float *sx, float *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
    const int64_t tiles = (n + W8_STREAMS - 1) / W8_STREAMS;
#if VL == 8
    (void)xu;
#endif
    /* the input rows in blocks of about W8_ROWS_BYTES (whole W8_BLOCKs), each passed over every tile while it stays
     * in the core's cache: a tile met by hundreds of rows at once would read them from further out each pass */
    const int64_t per = (int64_t)(xu ? 1 : 2) * k, fit = W8_ROWS_BYTES / (per * W8_BLOCK) * W8_BLOCK;
    const int64_t block = fit < W8_BLOCK ? W8_BLOCK : fit;
    #pragma omp parallel num_threads((int)(tiles > 1 ? threads : 1))
    for (int64_t j0 = 0; j0 < m; j0 += block) {
        const int64_t j1 = m - j0 < block ? m : j0 + block;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = t * W8_STREAMS;
            const int r = n - first < W8_STREAMS ? (int)(n - first) : W8_STREAMS;
            int64_t rr[W8_STREAMS];
            for (int q = 0; q < W8_STREAMS; q++) rr[q] = first + (q < r ? q : 0);
            for (int64_t j = j0; j < j1; j += W8_BLOCK) {
                const int mb = j1 - j < W8_BLOCK ? (int)(j1 - j) : W8_BLOCK;
                if (r == W8_STREAMS) {
                    W8_ROWS(W8_STREAMS)
                } else {
                    for (int q = 0; q < r; q++) {
                        rr[0] = first + q;
                        W8_ROWS(1)
                    }
                }
            }
        }
    }
}

/* A few input rows (a decode step's rows through one expert): each thread's share of the weight rows read as
 * W8_STREAMS long streams, its parts side by side (long runs the hardware prefetchers follow; the tiles of adjacent
 * rows above streamed about half as fast at these counts), each step's rows met by every input row while they are in
 * cache; the same tiles, so the same bits. A short last stream repeats the share's last row (the same value again). */
VI_TARGET static void SFX(w8a8_streams)(const int8_t *w, const float *sw, const int16_t *xq, const uint8_t *xu,
                                        const float *sx, float *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
#if VL == 8
    (void)xu;
#endif
    #pragma omp parallel num_threads((int)threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt, len = (r1 - r0 + W8_STREAMS - 1) / W8_STREAMS;
        for (int64_t i = 0; i < len; i++) {
            int64_t rr[W8_STREAMS];
            for (int q = 0; q < W8_STREAMS; q++) rr[q] = r0 + q * len + i < r1 ? r0 + q * len + i : r1 - 1;
            for (int64_t j = 0; j < m; j += W8_BLOCK) {
                const int mb = m - j < W8_BLOCK ? (int)(m - j) : W8_BLOCK;
                W8_ROWS(W8_STREAMS)
            }
        }
    }
}
#undef W8_ROWS
#undef W8_TILE

/* Inside a parallel region: this thread's share of the rows of y [n] = alpha (W x) (+ y when add) for one input row
 * xq (scale sx). The share's weight rows are read as two streams, its halves side by side (long runs the hardware
 * prefetchers follow: adjacent rows taken a few at a time, as the tiles take them, stream about half as fast from
 * memory), each output's integer sum exact and scaled as w8a8_tile scales it, so the same bits. No barrier. */
VI_TARGET static void SFX(w8a8_share)(const int8_t *w, const float *sw, const int16_t *xq, float sx, float *y,
                                      int64_t n, int64_t k, float alpha, int add) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = n * t / nt, r1 = n * (t + 1) / nt, half = (r1 - r0 + 1) / 2, kv = k - k % VI_STEP;
    for (int64_t i = 0; i < half; i++) {
        const int64_t ra = r0 + i, rb = r0 + half + i < r1 ? r0 + half + i : ra;  /* an odd range's last row: twice */
        const int8_t *wa = w + ra * k, *wb = w + rb * k;
        VI a = VI_ZERO(), b = VI_ZERO();
        for (int64_t c = 0; c < kv; c += VI_STEP) {
            const VI xv = VI_X16(xq + c);
            a = VI_DOT(a, VI_W8(wa + c), xv);
            b = VI_DOT(b, VI_W8(wb + c), xv);
        }
        int32_t sa = VI_ISUM(a), sb = VI_ISUM(b);
        for (int64_t c = kv; c < k; c++) {
            sa += (int32_t)wa[c] * xq[c];
            sb += (int32_t)wb[c] * xq[c];
        }
        const float va = (float)sa * sx * sw[ra], vb = (float)sb * sx * sw[rb];
        y[ra] = alpha * va + (add ? y[ra] : 0.0f);
        if (rb != ra) y[rb] = alpha * vb + (add ? y[rb] : 0.0f);
    }
}

#undef W8_STREAMS
#undef W8_BLOCK
#undef W8_ROWS_BYTES
