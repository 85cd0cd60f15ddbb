/* The int4 products of gemv_int4.c, written once over the vector vocabulary (vec_avx2.h, vec_avx512.h) and included
 * once per instruction set: a chunk's 64 weight bytes as I4_PARTS parts of 4 VL bytes (AVX2: two halves of 8 lanes;
 * AVX-512: one register of 16), lane l of part h holding bytes 4 (h VL + l) .. + 3 of the chunk's lo and hi values
 * (gemv_int4.c's comment). Both give every (weight row, input row) pair the same integers and the same float
 * operations in the same order, so their results are identical bit for bit. */

#define I4_PARTS (64 / (4 * VL))
#if VL == 8
#define I4_TILE 4       /* input rows a tile: 4 x 2 accumulators */
#define I4_PAIRED 0     /* weight rows a step: one */
#define I4_CASES TILE_CASES4
#define I4_ZP_INSTANCES 1  /* symmetric and zero-point blocks compiled apart (runtime-flagged: 1.12-1.16x the time) */
#else
#define I4_TILE 8       /* 8 accumulators, two weight rows a step: each input chunk loaded once for both */
#define I4_PAIRED 1
#define I4_CASES TILE_CASES8
#define I4_ZP_INSTANCES 0  /* one block for both, the zero-point work under a flag (two instances: 1.06x the time) */
#endif

/* Part h of a chunk (weight bytes wc, their four groups' scales s4 and zeros z4) into the m rows' accumulators
 * acc[j][h]: the nibbles times the prepared values from the lane's bias (for zero points, -z times the lane's
 * activation sum), the int32 lane to float times weight scale * activation scale, one FMA. xc: the first row's chunk
 * (row stride xs bytes). */
VI_TARGET static inline __attribute__((always_inline)) void SFX(i4_part)(const uint8_t *wc, __m128 s4, const int ZP,
                                                                        __m128i z4, const int h, const uint8_t *xc,
                                                                        int64_t xs, V acc[][I4_PARTS], const int m) {
    const VI low = VI_SET1_8(0x0f);
    const VI b = VI_LOAD(wc + 4 * VL * h);
    const VI lo = VI_AND(b, low), hi = VI_AND(VI_SRLI16(b, 4), low);
    const V dw = V_QUARTERS(s4, h);
    const VI zl = ZP ? VI_QUARTERS(z4, h) : VI_ZERO();
    for (int j = 0; j < m; j++) {
        const uint8_t *x = xc + j * xs + 4 * VL * h;
        VI bias = VI_LOAD(x + 128);
        if (ZP) bias = VI_SRAI32(VI_MULLO32(bias, zl), 3);
        const VI s = VI_DOT_U8X2(bias, lo, VI_LOAD(x), hi, VI_LOAD(x + 64));
        acc[j][h] = V_FMA(VI_FLOAT(s), V_MUL(dw, V_LOAD((const float *)(x + 192))), acc[j][h]);
    }
}

/* One chunk (weight bytes wc, scales sc, zeros zc where ZP) into the m rows' accumulators. ZP, whether the weight
 * has zero points, is a constant wherever this is inlined: a symmetric weight's loops carry no zero-point work. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(i4_chunk)(const uint8_t *wc, const uint16_t *sc,
                                                                         const uint8_t *zc, const int ZP,
                                                                         const uint8_t *xc, int64_t xs,
                                                                         V acc[][I4_PARTS], const int m) {
    const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)sc));
    const __m128i z4 = ZP ? _mm_cvtepu8_epi32(_mm_cvtsi32_si128(i4_load4(zc))) : _mm_setzero_si128();
    for (int h = 0; h < I4_PARTS; h++) SFX(i4_part)(wc, s4, ZP, z4, h, xc, xs, acc, m);
}

/* Chunk c of row rw: its weight bytes (*wc), scales (*sc) and zeros (*zc), read in place where the chunk is whole and
 * its groups are the activations' (c < direct: groups of 32), else through i4_chunk_at's buffers. */
#define I4_CHUNK_PTRS(rw, c, direct, wbuf, sbuf, zbuf, wc, sc, zc)                                                   \
    if ((c) < (direct)) {                                                                                            \
        wc = (rw).w + (c) * I4_CHUNK_WBYTES;                                                                         \
        sc = (rw).s + (c) * I4_CHUNK_GROUPS;                                                                         \
        zc = ZP ? (rw).z + (c) * I4_CHUNK_GROUPS : NULL;                                                             \
    } else                                                                                                           \
        wc = i4_chunk_at(rw, c, g_n, gshift, wbuf, sbuf, zbuf, &sc, &zc)

/* A row's accumulators summed: its parts lane by lane, then V_HSUM8 (16 lanes folded to 8, then hsum's order). */
VI_TARGET static inline __attribute__((always_inline)) float SFX(i4_total)(const V *parts) {
    V t = parts[0];
    for (int h = 1; h < I4_PARTS; h++) t = V_ADD(t, parts[h]);
    return V_HSUM8(t);
}

/* Weight row rw (g_n groups) times m prepared rows xp (row stride xs bytes): y[j n + r] = the row's dot product.
 * The chunks read in place come first, in a loop with no call in it (a call would make every accumulator a caller-
 * saved register to spill); the rest go through i4_chunk_at's buffers. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(i4_row)(i4_row_ptr rw, int64_t g_n, int gshift,
                                                                       const int ZP, const uint8_t *xp, int64_t xs,
                                                                       float *y, int64_t n, int64_t r, const int m) {
    const int64_t chunks = i4_chunks(g_n * I4_GROUP), direct = gshift ? 0 : g_n / I4_CHUNK_GROUPS;
    V acc[I4_TILE][I4_PARTS];
    uint8_t wbuf[I4_CHUNK_WBYTES], zbuf[I4_CHUNK_GROUPS];
    uint16_t sbuf[I4_CHUNK_GROUPS];
    for (int j = 0; j < m; j++)
        for (int h = 0; h < I4_PARTS; h++) acc[j][h] = V_ZERO();
    int64_t c = 0;
    for (; c < direct; c++) {
        _mm_prefetch((const char *)(rw.w + c * I4_CHUNK_WBYTES) + I4_PREFETCH, _MM_HINT_T0);
        SFX(i4_chunk)(rw.w + c * I4_CHUNK_WBYTES, rw.s + c * I4_CHUNK_GROUPS, ZP ? rw.z + c * I4_CHUNK_GROUPS : NULL,
                      ZP, xp + c * I4_CHUNK_XBYTES, xs, acc, m);
    }
    for (; c < chunks; c++) {
        const uint16_t *sc;
        const uint8_t *zc;
        const uint8_t *wc = i4_chunk_at(rw, c, g_n, gshift, wbuf, sbuf, zbuf, &sc, &zc);
        SFX(i4_chunk)(wc, sc, zc, ZP, xp + c * I4_CHUNK_XBYTES, xs, acc, m);
    }
    for (int j = 0; j < m; j++) y[j * n + r] = SFX(i4_total)(acc[j]);
}

/* Two weight rows pa, pb times m prepared rows xp into y[j n + ra] and y[j n + rb]: every input chunk loaded once
 * for both weight rows (the input rows, 32 KB for 8 rows of 2048 values, are what a tile reads most); each (weight
 * row, input row) pair sees exactly i4_row's operations. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(i4_rows2)(i4_row_ptr pa, i4_row_ptr pb, int64_t g_n,
                                                                         int gshift, const int ZP, const uint8_t *xp,
                                                                         int64_t xs, float *y, int64_t n, int64_t ra,
                                                                         int64_t rb, const int m) {
    const int64_t chunks = i4_chunks(g_n * I4_GROUP), direct = gshift ? 0 : g_n / I4_CHUNK_GROUPS;
    V acc_a[I4_TILE][I4_PARTS], acc_b[I4_TILE][I4_PARTS];
    uint8_t wbuf[2][I4_CHUNK_WBYTES], zbuf[2][I4_CHUNK_GROUPS];
    uint16_t sbuf[2][I4_CHUNK_GROUPS];
    for (int j = 0; j < m; j++)
        for (int h = 0; h < I4_PARTS; h++) acc_a[j][h] = acc_b[j][h] = V_ZERO();
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *qa, *qb;
        const uint8_t *za, *zb, *ca, *cb;
        I4_CHUNK_PTRS(pa, c, direct, wbuf[0], sbuf[0], zbuf[0], ca, qa, za);
        I4_CHUNK_PTRS(pb, c, direct, wbuf[1], sbuf[1], zbuf[1], cb, qb, zb);
        _mm_prefetch((const char *)(pa.w + c * I4_CHUNK_WBYTES) + I4_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(pb.w + c * I4_CHUNK_WBYTES) + I4_PREFETCH, _MM_HINT_T0);
        const __m128 sa4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)qa));
        const __m128 sb4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)qb));
        const __m128i za4 = ZP ? _mm_cvtepu8_epi32(_mm_cvtsi32_si128(i4_load4(za))) : _mm_setzero_si128();
        const __m128i zb4 = ZP ? _mm_cvtepu8_epi32(_mm_cvtsi32_si128(i4_load4(zb))) : _mm_setzero_si128();
        for (int h = 0; h < I4_PARTS; h++) {
            const VI low = VI_SET1_8(0x0f);
            const VI ba = VI_LOAD(ca + 4 * VL * h), bb = VI_LOAD(cb + 4 * VL * h);
            const VI lo_a = VI_AND(ba, low), hi_a = VI_AND(VI_SRLI16(ba, 4), low);
            const VI lo_b = VI_AND(bb, low), hi_b = VI_AND(VI_SRLI16(bb, 4), low);
            const V dwa = V_QUARTERS(sa4, h), dwb = V_QUARTERS(sb4, h);
            const VI zla = ZP ? VI_QUARTERS(za4, h) : VI_ZERO(), zlb = ZP ? VI_QUARTERS(zb4, h) : VI_ZERO();
            for (int j = 0; j < m; j++) {
                const uint8_t *x = xp + c * I4_CHUNK_XBYTES + j * xs + 4 * VL * h;
                const VI x0 = VI_LOAD(x), x1 = VI_LOAD(x + 64), bias = VI_LOAD(x + 128);
                const VI bias_a = ZP ? VI_SRAI32(VI_MULLO32(bias, zla), 3) : bias;
                const VI bias_b = ZP ? VI_SRAI32(VI_MULLO32(bias, zlb), 3) : bias;
                const V sx = V_LOAD((const float *)(x + 192));
                acc_a[j][h] = V_FMA(VI_FLOAT(VI_DOT_U8X2(bias_a, lo_a, x0, hi_a, x1)), V_MUL(dwa, sx), acc_a[j][h]);
                acc_b[j][h] = V_FMA(VI_FLOAT(VI_DOT_U8X2(bias_b, lo_b, x0, hi_b, x1)), V_MUL(dwb, sx), acc_b[j][h]);
            }
        }
    }
    for (int j = 0; j < m; j++) {
        y[j * n + ra] = SFX(i4_total)(acc_a[j]);
        y[j * n + rb] = SFX(i4_total)(acc_b[j]);
    }
}

/* Two weight rows pa, pb times one prepared row xp: ya, yb. The rows' chunks interleaved, two sequential weight
 * streams a thread (one leaves memory bandwidth unused), each activation chunk read once for both; each row sees
 * exactly the operations i4_row gives it. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(i4_pair_zp)(i4_row_ptr pa, i4_row_ptr pb, int64_t g_n,
                                                                           int gshift, const int ZP,
                                                                           const uint8_t *xp, float *ya, float *yb) {
    const int64_t chunks = i4_chunks(g_n * I4_GROUP), direct = gshift ? 0 : g_n / I4_CHUNK_GROUPS;
    V acc_a[1][I4_PARTS], acc_b[1][I4_PARTS];
    for (int h = 0; h < I4_PARTS; h++) acc_a[0][h] = acc_b[0][h] = V_ZERO();
    uint8_t wbuf[2][I4_CHUNK_WBYTES], zbuf[2][I4_CHUNK_GROUPS];
    uint16_t sbuf[2][I4_CHUNK_GROUPS];
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *qa, *qb;
        const uint8_t *za, *zb, *ca, *cb;
        I4_CHUNK_PTRS(pa, c, direct, wbuf[0], sbuf[0], zbuf[0], ca, qa, za);
        I4_CHUNK_PTRS(pb, c, direct, wbuf[1], sbuf[1], zbuf[1], cb, qb, zb);
        _mm_prefetch((const char *)(pa.w + c * I4_CHUNK_WBYTES) + I4_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(pb.w + c * I4_CHUNK_WBYTES) + I4_PREFETCH, _MM_HINT_T0);
        SFX(i4_chunk)(ca, qa, za, ZP, xp + c * I4_CHUNK_XBYTES, 0, acc_a, 1);
        SFX(i4_chunk)(cb, qb, zb, ZP, xp + c * I4_CHUNK_XBYTES, 0, acc_b, 1);
    }
    *ya = SFX(i4_total)(acc_a[0]);
    *yb = SFX(i4_total)(acc_b[0]);
}

VI_TARGET static void SFX(i4_pair)(i4_row_ptr pa, i4_row_ptr pb, int64_t g_n, int gshift, const uint8_t *xp,
                                   float *ya, float *yb) {
    if (pa.z) SFX(i4_pair_zp)(pa, pb, g_n, gshift, 1, xp, ya, yb);
    else SFX(i4_pair_zp)(pa, pb, g_n, gshift, 0, xp, ya, yb);
}

/* Weight rows [r0, r1) times `rows` prepared rows xp (stride xs): y [rows, n], I4_TILE input rows a tile; ZP a
 * constant in each instance. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(i4_block_zp)(const i4_mat *w, const int ZP,
                                                                            const uint8_t *xp, int64_t xs, float *y,
                                                                            int64_t rows, int64_t n, int64_t r0,
                                                                            int64_t r1) {
    for (int64_t c = 0; c < rows; c += I4_TILE) {
        const int m = rows - c < I4_TILE ? (int)(rows - c) : I4_TILE;
#define I4_CALL(M)                                                                                                   \
    for (int64_t r = r0; r < r1; r += 1 + I4_PAIRED)                                                                 \
        if (I4_PAIRED && r + 1 < r1)                                                                                 \
            SFX(i4_rows2)(i4_row_at(w, r), i4_row_at(w, r + 1), w->g_n, w->gshift, ZP, xp + c * xs, xs, y + c * n, n, \
                          r, r + 1, M);                                                                              \
        else                                                                                                         \
            SFX(i4_row)(i4_row_at(w, r), w->g_n, w->gshift, ZP, xp + c * xs, xs, y + c * n, n, r, M)
        I4_CASES(I4_CALL)
#undef I4_CALL
    }
}

VI_TARGET static void SFX(i4_block)(const i4_mat *w, const uint8_t *xp, int64_t xs, float *y, int64_t rows,
                                    int64_t n, int64_t r0, int64_t r1) {
#if I4_ZP_INSTANCES
    if (w->z) SFX(i4_block_zp)(w, 1, xp, xs, y, rows, n, r0, r1);
    else SFX(i4_block_zp)(w, 0, xp, xs, y, rows, n, r0, r1);
#else
    SFX(i4_block_zp)(w, w->z != NULL, xp, xs, y, rows, n, r0, r1);
#endif
}

#undef I4_PARTS
#undef I4_TILE
#undef I4_PAIRED
#undef I4_CASES
#undef I4_ZP_INSTANCES
#undef I4_CHUNK_PTRS
