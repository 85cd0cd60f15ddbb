/* The few-row products of gemv_f32.c (float32, bfloat16 and float16 weights; int8 weights against int16 rows), written
 * once over the vector vocabulary (vec_avx2.h, vec_avx512.h) and included once per instruction set. Each output is
 * its own accumulator's sum in the same order whatever the rows beside it, so a row's result does not depend on how
 * many rows share the call. gemv_f32.c defines the drivers' loops (FOR_STREAM_ROWS, KIND_BLOCKS, MANY_I8_ROWS) and the
 * row-count switches (CASES4, CASES8) before the first inclusion. */

#if VL == 8
/* AVX2's 16 registers: three weight rows by four input rows of float sums (12 accumulators), so that each input
 * vector loaded feeds three multiply-adds; int8: three weight rows by four input rows in the streaming driver, two in
 * the many-row one. */
#define FEW_STREAMS 3
#define I8_FEW_BLOCK 4
#define I8_FEW_STREAMS(M) 3
#define I8_FEW_CASES CASES4
#define I8_MANY_STREAMS 2
#else
/* AVX-512's 32 registers: four weight rows by four input rows (16 accumulators; eight input rows at once kept 32 KB
 * of input rows in a 48 KB L1 beside the streams, and ran eight rows of [32000, 1024] 1.45x slower: bench_gemv on a
 * 2-core Zen 5 EPYC, 5.6 against 3.9 ms). int8: eight input rows at once, the weight rows a step by input rows as
 * measured fastest (three rows at eight input rows took 1.3-1.4x as long as two); four in the many-row driver. */
#define FEW_STREAMS 4
#define I8_FEW_BLOCK 8
#define I8_FEW_STREAMS(M) ((M) > 6 ? 2 : (M) > 4 ? 3 : 4)
#define I8_FEW_CASES CASES8
#define I8_MANY_STREAMS 4
#endif
#define FEW_BLOCK 4  /* float input rows a step */

/* NAME(w, rows, x, y, m, n, k): the FEW_STREAMS weight rows rows[..] (float32, bfloat16 or float16, widened exactly
 * by WIDE) against m <= FEW_BLOCK rows of x (stride k), VL values a step; each weight vector is prefetched PF_BYTES
 * ahead and widened once, each input vector loaded once for all the weight rows. The tail (k not a multiple of VL) is
 * one more step over zero-padded copies: zeros add nothing. */
#define FEW_FLOAT(NAME, T, WIDE)                                                                                     \
    V_TARGET static inline __attribute__((always_inline)) void SFX(NAME)(const T *w, const int64_t *rows,            \
                                                                         const float *x, float *y, const int m,      \
                                                                         int64_t n, int64_t k) {                      \
        const int64_t kv = k - k % VL;                                                                               \
        const T *wr[FEW_STREAMS];                                                                                    \
        for (int q = 0; q < FEW_STREAMS; q++) wr[q] = w + rows[q] * k;                                               \
        V acc[FEW_STREAMS][FEW_BLOCK];                                                                               \
        for (int q = 0; q < FEW_STREAMS; q++)                                                                        \
            for (int j = 0; j < m; j++) acc[q][j] = V_ZERO();                                                        \
        for (int64_t i = 0; i < kv; i += VL) {                                                                       \
            V wv[FEW_STREAMS];                                                                                       \
            for (int q = 0; q < FEW_STREAMS; q++) {                                                                  \
                _mm_prefetch((const char *)(wr[q] + i) + PF_BYTES(T), _MM_HINT_T0);                                  \
                wv[q] = WIDE(wr[q] + i);                                                                             \
            }                                                                                                        \
            for (int j = 0; j < m; j++) {                                                                            \
                const V xv = V_LOAD(x + j * k + i);                                                                  \
                for (int q = 0; q < FEW_STREAMS; q++) acc[q][j] = V_FMA(wv[q], xv, acc[q][j]);                       \
            }                                                                                                        \
        }                                                                                                            \
        if (kv < k) {                                                                                                \
            T wt[VL] = {0};                                                                                          \
            float xt[VL] = {0.0f};                                                                                   \
            for (int q = 0; q < FEW_STREAMS; q++) {                                                                  \
                memcpy(wt, wr[q] + kv, (size_t)(k - kv) * sizeof(T));                                               \
                const V wv = WIDE(wt);                                                                               \
                for (int j = 0; j < m; j++) {                                                                        \
                    memcpy(xt, x + j * k + kv, (size_t)(k - kv) * sizeof(float));                                   \
                    acc[q][j] = V_FMA(wv, V_LOAD(xt), acc[q][j]);                                                    \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int q = 0; q < FEW_STREAMS; q++)                                                                        \
            for (int j = 0; j < m; j++) y[j * n + rows[q]] = V_HSUM(acc[q][j]);                                      \
    }
FEW_FLOAT(few_f32, float, V_LOAD)
FEW_FLOAT(few_bf16, uint16_t, V_BF16)
FEW_FLOAT(few_f16, uint16_t, V_F16)
#undef FEW_FLOAT

/* Y [m, n] = X [m, k] W^T for the weight kind, each thread's rows as FEW_STREAMS streams (stream_split), the input rows
 * FEW_BLOCK at a time: the weight rows are read from memory for the first block and again from cache for the next. */
V_TARGET static void SFX(few_float)(const void *w, int64_t kind, const float *x, float *y, int64_t m, int64_t n,
                                    int64_t k, int64_t threads) {
    const float *wf = (const float *)w;
    const uint16_t *wh = (const uint16_t *)w;
#define FEW_CALL(FN, W, M) SFX(FN)(W, rows, x + c * k, y + c * n, M, n, k)
#define FEW_F32(M) FEW_CALL(few_f32, wf, M)
#define FEW_BF16(M) FEW_CALL(few_bf16, wh, M)
#define FEW_F16(M) FEW_CALL(few_f16, wh, M)
    KIND_BLOCKS(FEW_STREAMS, FEW_BLOCK, FEW_F32, FEW_BF16, FEW_F16)
#undef FEW_CALL
#undef FEW_F32
#undef FEW_BF16
#undef FEW_F16
}

/* Int8 weights against m <= I8_FEW_BLOCK rows already rounded to int16 (xq, m rows of k, one scale per row in sx), R
 * (at most 4) weight rows rows[0..R) at once: integer multiply-adds (VI_DOT), the int32 sums moved to float every
 * I16_CHUNK values, each chunk's sum added in dot2_i16's order, so every result is the one-row product's exactly. With
 * first_sets, a chunk's first step sets the sums instead of adding to zeros set before (a zero vector held through the
 * loop made GCC spill an accumulator at two weight rows by four input rows; the streaming driver's VNNI tiles ran ten-odd
 * percent slower with it). AVX-512 steps 32 values; a 16-value step left over takes AVX2's instruction, its sums in the
 * low lanes. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(few_i8)(const int8_t *w, const float *scale,
                                                                       const int64_t *rows, const int R,
                                                                       const int16_t *xq, const float *sx, float *y,
                                                                       const int m, int64_t n, int64_t k,
                                                                       const int first_sets) {
    const int64_t k16 = k - k % 16;
    const int8_t *wr[4];
    for (int q = 0; q < R; q++) wr[q] = w + rows[q] * k;
    float sums[4][I8_FEW_BLOCK] = {{0.0f}};  /* in memory: only the integer sums stay in registers through the loop */
    for (int64_t c = 0; c < k16; c += I16_CHUNK) {
        const int64_t end = c + I16_CHUNK < k16 ? c + I16_CHUNK : k16;
        VI a[4][I8_FEW_BLOCK];
        if (!first_sets)
            for (int q = 0; q < R; q++)
                for (int j = 0; j < m; j++) a[q][j] = VI_ZERO();
        int64_t i = c;
        for (; i + VI_STEP <= end; i += VI_STEP) {
            VI wv[4];
            for (int q = 0; q < R; q++) {
                if (!(i & 63)) _mm_prefetch((const char *)(wr[q] + i) + 1024, _MM_HINT_T0);
                wv[q] = VI_W8(wr[q] + i);
            }
            for (int j = 0; j < m; j++) {
                const VI xv = VI_X16(xq + j * k + i);
                for (int q = 0; q < R; q++) a[q][j] = VI_DOT(first_sets && i == c ? VI_ZERO() : a[q][j], wv[q], xv);
            }
        }
#if VI_STEP > 16
        if (i < end) {
            for (int q = 0; q < R; q++) {
                const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr[q] + i)));
                for (int j = 0; j < m; j++) {
                    const VI p = _mm512_zextsi256_si512(
                        _mm256_madd_epi16(wv, _mm256_loadu_si256((const __m256i *)(xq + j * k + i))));
                    a[q][j] = first_sets && i == c ? p : _mm512_add_epi32(a[q][j], p);
                }
            }
        }
#endif
        for (int q = 0; q < R; q++)
            for (int j = 0; j < m; j++) sums[q][j] += VI_SUM(a[q][j]);
    }
    for (int q = 0; q < R; q++)
        for (int j = 0; j < m; j++) {
            float s = sums[q][j];
            for (int64_t i = k16; i < k; i++) s += (float)wr[q][i] * xq[j * k + i];
            y[j * n + rows[q]] = s * sx[j] * scale[rows[q]];
        }
}

/* A decode step's int8 product (at most I8_STREAM_ROWS rows): each thread's weight rows as R streams, every input
 * row, I8_FEW_BLOCK at a time, against each step's weight rows. */
VI_TARGET static void SFX(few_i8_rows)(const int8_t *w, const float *scale, const int16_t *xq, const float *sx,
                                       float *y, int64_t rows_in, int64_t n, int64_t k, int64_t threads) {
    const int R = I8_FEW_STREAMS(rows_in < I8_FEW_BLOCK ? rows_in : I8_FEW_BLOCK);
#define I8_FEW_R(M, RR) SFX(few_i8)(w, scale, rows, RR, xq + c * k, sx + c, y + c * n, M, n, k, VI_STEP == 16)
#define I8_FEW_ROW(M) (R == 2 ? I8_FEW_R(M, 2) : R == 3 ? I8_FEW_R(M, 3) : I8_FEW_R(M, 4))
    FOR_STREAM_ROWS(n, R,
        for (int64_t c = 0; c < rows_in; c += I8_FEW_BLOCK) {
            const int64_t mb = rows_in - c < I8_FEW_BLOCK ? rows_in - c : I8_FEW_BLOCK;
            I8_FEW_CASES(mb, I8_FEW_ROW)
        })
#undef I8_FEW_R
#undef I8_FEW_ROW
}

/* A prefill chunk's int8 product: blocks of weight rows kept in L2, I8_MANY_STREAMS rows a step (MANY_I8_ROWS). */
VI_TARGET static void SFX(many_i8_rows)(const int8_t *w, const float *scale, const int16_t *xq, const float *sx,
                                        float *y, int64_t rows_in, int64_t n, int64_t k, int64_t threads) {
#define I8_MANY_TILE(M) SFX(few_i8)(w, scale, rows, I8_MANY_STREAMS, xq + c * k, sx + c, y + c * n, M, n, k, 1)
    MANY_I8_ROWS(I8_MANY_STREAMS, I8_MANY_TILE)
#undef I8_MANY_TILE
}

#undef FEW_STREAMS
#undef FEW_BLOCK
#undef I8_FEW_BLOCK
#undef I8_FEW_STREAMS
#undef I8_FEW_CASES
#undef I8_MANY_STREAMS
