/* The products of gemv_ggml.c (weights in ggml's block types, read as stored), written once over the vector
 * vocabulary (vec_avx2.h, vec_avx512.h) and included once per instruction set. gemv_ggml.c defines GgUnit, GgCall,
 * the decoders (gg_decode) and GG_TILE before the first inclusion.
 *
 * A unit's decoded values u (unsigned bytes, or signed for Q8_0) meet a prepared row's int8 values a four at a time in
 * int32 lanes: lane l of a step sums u a over values 4l..4l+3 (VI_DOT_U8 / VI_DOT_S8), less the format's offset
 * times the lane's activation sum (an exact shift: Q6_K's 32, Q5_0's 16, Q3_K's 4), and is added as a float into the
 * lane's accumulator times (the lane's weight scale x its activation scale), one FMA; formats with minimums add the
 * lane's activation sum times (the lane's minimum x its activation scale), a second FMA. A step is 64 values: AVX-512
 * one vector of 16 lanes (groups g and g + 1 in its halves), AVX2 two vectors of 8 lanes into two accumulators (even
 * and odd groups), so that lane l of AVX2's two accumulators receives the float operations lanes l and l + 8 of
 * AVX-512's one receives; a row's sum adds those two first, then the eight in simd.h's hsum order. Both variants thus
 * give the same bits, and each (weight row, input row) pair has its own accumulators and sees the same operations
 * whatever rows share the call. */

#if VL == 8
#define GG_ACCS 2
#define GG_FOLD(acc) hsum(_mm256_add_ps(acc[0], acc[1]))
#else
#define GG_ACCS 1
#define GG_FOLD(acc) \
    hsum(_mm256_add_ps(_mm512_castps512_ps256(acc[0]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[0]), 1))))
#endif

/* One decoded unit (values 0 .. nv) against one prepared row (xa: its int8 values, xs: the lane sums, xd: the lane
 * scales, each at the unit's first value), into acc. SGN, SHIFT and MINS are constants of the format. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_dot)(const GgUnit *b, const int8_t *xa,
                                                                       const int32_t *xs, const float *xd, int nv,
                                                                       V *acc, const int SGN, const int SHIFT,
                                                                       const int MINS) {
    for (int i = 0; i < nv; i += 4 * VL) {
        V *ac = acc + (i / (4 * VL)) % GG_ACCS;
        const VI u = VI_LOAD(b->u + i), a = VI_LOAD(xa + i);
        VI s = SGN ? VI_DOT_S8(VI_ZERO(), u, a) : VI_DOT_U8(VI_ZERO(), u, a);
        if (SHIFT) s = VI_SUB32(s, VI_SLLI32(VI_LOAD(xs + i / 4), SHIFT));
        const V d = V_LOAD(xd + i / 4);
        *ac = V_FMA(VI_FLOAT(s), V_MUL(V_LOAD(b->ws + i / 4), d), *ac);
        if (MINS) *ac = V_FMA(VI_FLOAT(VI_LOAD(xs + i / 4)), V_MUL(V_LOAD(b->wm + i / 4), d), *ac);
    }
}

/* Weight rows [r0, r1) of c's matrix, type T (a constant), times c's prepared rows: each row decoded a unit at a
 * time, once per tile of GG_TILE input rows, each decoded unit multiplied into every row of the tile. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_rows_t)(const GgCall *c, int64_t r0, int64_t r1,
                                                                          const int T) {
    const GgFormat f = gg_format(T);
    GgUnit unit __attribute__((aligned(64)));
    for (int64_t t = 0; t < c->m; t += GG_TILE) {
        const int mb = c->m - t < GG_TILE ? (int)(c->m - t) : GG_TILE;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = c->w + r * c->row_stride;
            V acc[GG_TILE][GG_ACCS];
            for (int j = 0; j < mb; j++)
                for (int q = 0; q < GG_ACCS; q++) acc[j][q] = V_ZERO();
            for (int64_t v = 0; v < c->kp; v += f.unit) {
                const int64_t blocks = (c->k - v) / f.block;
                _mm_prefetch((const char *)(wr + v / f.block * f.bytes) + 1024, _MM_HINT_T0);
                gg_decode(T, wr + v / f.block * f.bytes, blocks < f.unit / f.block ? blocks : f.unit / f.block, &unit);
                for (int j = 0; j < mb; j++) {
                    const uint8_t *x = c->xp + (t + j) * c->xstride;
                    SFX(gg_dot)(&unit, (const int8_t *)x + v, (const int32_t *)(x + c->kp) + v / 4,
                                (const float *)(x + 2 * c->kp) + v / 4, f.unit, acc[j], f.sgn, f.shift, f.mins);
                }
            }
            for (int j = 0; j < mb; j++) c->y[(t + j) * c->n + r] = GG_FOLD(acc[j]);
        }
    }
}

/* The same for the call's type, chosen at run time (each case a copy specialised to its type). */
VI_TARGET static void SFX(gg_rows)(const GgCall *c, int64_t r0, int64_t r1) {
    switch (c->type) {
        case GG_Q8_0: SFX(gg_rows_t)(c, r0, r1, GG_Q8_0); break;
        case GG_Q4_1: SFX(gg_rows_t)(c, r0, r1, GG_Q4_1); break;
        case GG_Q5_0: SFX(gg_rows_t)(c, r0, r1, GG_Q5_0); break;
        case GG_Q5_1: SFX(gg_rows_t)(c, r0, r1, GG_Q5_1); break;
        case GG_Q2_K: SFX(gg_rows_t)(c, r0, r1, GG_Q2_K); break;
        case GG_Q3_K: SFX(gg_rows_t)(c, r0, r1, GG_Q3_K); break;
        case GG_Q4_K: SFX(gg_rows_t)(c, r0, r1, GG_Q4_K); break;
        case GG_Q5_K: SFX(gg_rows_t)(c, r0, r1, GG_Q5_K); break;
        default: SFX(gg_rows_t)(c, r0, r1, GG_Q6_K); break;
    }
}

#undef GG_ACCS
#undef GG_FOLD
