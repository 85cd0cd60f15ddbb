/* The products of gemv_ggml.c (weights in ggml's block types, read as stored), written once over the vector
 * vocabulary (vec_avx2.h, vec_avx512.h) and included once per instruction set. gemv_ggml.c defines GgCall, GgFormat,
 * the bit helpers (gg_bits, gg_nib32, gg_u32) and GG_TILE before the first inclusion.
 *
 * A run of 32 weight values that shares an activation scale meets the prepared row's int8 values in integer vectors
 * (AVX2: a run a 256-bit vector, maddubs and madd; AVX-512: two runs a 512-bit vector, vpdpbusd where no int16
 * multiplier follows, else maddubs and madd): its exact integer sum lands in an int32 lane, eight runs to a vector
 * (gg_run_sums), and the eight sums are scaled in float32 together, one FMA (two with minimums) into an accumulator
 * of eight floats per (weight row, input row). The float operations are 256-bit
 * in both variants and the integer sums are exact, so both give the same bits, and each (weight row, input row) pair
 * sees the same operations whatever rows share the call. */

/* The eight runs of 32 values of a step, prepared once for every input row: kind GG_S8 (Q8_0's signed values w),
 * GG_U8 (unsigned values u, at most 31) or GG_MUL (unsigned values u, at most 63, and int16 multipliers of maddubs'
 * pair sums, sixteen a run). AVX2 keeps a run a vector (S8: |w| and w, whose signs the activations take); AVX-512
 * two runs a vector (S8: |w| and the mask of the negative w). */
#ifndef GG_RUN_KINDS
#define GG_RUN_KINDS
enum { GG_S8, GG_U8, GG_MUL };
#endif
#if VL == 8
typedef struct {
    __m256i v[8], m[8];
} SFX(GgRuns);
#else
typedef struct {
    __m512i v[4], m[4];
    __mmask64 neg[4];
} SFX(GgRuns);
#endif

VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_runs)(SFX(GgRuns) *r, const __m256i *w,
                                                                        const __m256i *mul, const int KIND) {
#if VL == 8
    for (int i = 0; i < 8; i++) {
        r->v[i] = KIND == GG_S8 ? _mm256_sign_epi8(w[i], w[i]) : w[i];
        if (KIND == GG_S8) r->m[i] = w[i];
        if (KIND == GG_MUL) r->m[i] = mul[i];
    }
#else
    for (int q = 0; q < 4; q++) {
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(w[2 * q]), w[2 * q + 1], 1);
        r->v[q] = KIND == GG_S8 ? _mm512_abs_epi8(v) : v;
        if (KIND == GG_S8) r->neg[q] = _mm512_movepi8_mask(v);
        if (KIND == GG_MUL) r->m[q] = _mm512_inserti64x4(_mm512_castsi256_si512(mul[2 * q]), mul[2 * q + 1], 1);
    }
#endif
}

/* The eight runs' exact integer sums against the input row's 256 int8 values at xa: lane i run i's sum of
 * (multiplier) x value x activation. AVX2: maddubs' int16 pair sums (at most 2 x 128 x 127 = 32512), madd by one or
 * by the multipliers, then the eight vectors' lanes summed by hadd; AVX-512: vpdpbusd (S8: the activations negated
 * where w is negative), or maddubs and madd, two runs a vector, their lanes summed by unpacks. */
VI_TARGET static inline __attribute__((always_inline)) __m256i SFX(gg_run_sums)(const SFX(GgRuns) *r, const uint8_t *xa,
                                                                               const int KIND) {
#if VL == 8
    __m256i p[8];
    for (int i = 0; i < 8; i++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(xa + 32 * i));
        const __m256i pairs = _mm256_maddubs_epi16(r->v[i], KIND == GG_S8 ? _mm256_sign_epi8(a, r->m[i]) : a);
        p[i] = _mm256_madd_epi16(pairs, KIND == GG_MUL ? r->m[i] : _mm256_set1_epi16(1));
    }
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
#else
    __m512i z[4];
    for (int q = 0; q < 4; q++) {
        const __m512i a = _mm512_loadu_si512((const void *)(xa + 64 * q));
        if (KIND == GG_S8)
            z[q] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), r->v[q],
                                       _mm512_mask_sub_epi8(a, r->neg[q], _mm512_setzero_si512(), a));
        else if (KIND == GG_U8)
            z[q] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), r->v[q], a);
        else
            z[q] = _mm512_madd_epi16(_mm512_maddubs_epi16(r->v[q], a), r->m[q]);
    }
    /* each 128-bit chunk's sum: u's chunk c holds z[0..3]'s chunk c sums; runs 2q and 2q + 1 are z[q]'s chunks 0, 1
     * and 2, 3 */
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const __m512i c = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#endif
}

/* A step's block of a 32-value type T at p: its 32 values (Q8_0 signed; else unsigned, Q5_0's offset 16 not taken
 * off). */
VI_TARGET static inline __attribute__((always_inline)) __m256i SFX(gg_small_block)(const uint8_t *p, const int T) {
    switch (T) {
        case GG_Q8_0: return _mm256_loadu_si256((const __m256i *)(p + 2));
        case GG_Q5_0: return gg_nib32(p + 6, p + 2);
        case GG_Q4_1: return gg_nib32(p + 4, NULL);
        default: return gg_nib32(p + 8, p + 4);
    }
}

#if VL == 16
/* Two blocks of a 32-value type T other than Q8_0 from p (only the first where `left` is 1, none where it is 0 or
 * less) as one AVX-512 run vector, unsigned values 0..31 then 32..63: each block's 16 bytes broadcast to both
 * 128-bit halves of its 256-bit half, shifted by 0 or 4 and masked to nibbles, the fifth bits (Q5_0, Q5_1) added as
 * 16 through a 64-bit byte mask. */
VI_TARGET static inline __attribute__((always_inline)) __m512i SFX(gg_small_pair)(const uint8_t *p, int left,
                                                                                 const int T) {
    const int bytes = gg_format(T).bytes, qs = T == GG_Q5_0 ? 6 : T == GG_Q4_1 ? 4 : 8, qh = T == GG_Q5_0 ? 2 : 4;
    if (left <= 0) return _mm512_setzero_si512();
    const __m256i b0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + qs)));
    const __m256i b1 = left > 1 ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + bytes + qs)))
                                : _mm256_setzero_si256();
    const __m512i shift = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                            0x0004000400040004LL, 0x0004000400040004LL);
    __m512i v = _mm512_and_si512(_mm512_srlv_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1), shift),
                                 _mm512_set1_epi8(0x0f));
    if (T != GG_Q4_1) {
        const uint64_t high = (uint64_t)gg_u32(p + qh) | (left > 1 ? (uint64_t)gg_u32(p + bytes + qh) << 32 : 0);
        v = _mm512_mask_add_epi8(v, (__mmask64)high, v, _mm512_set1_epi8(16));
    }
    return v;
}
#endif

/* The float16 fields at offset `at` of a step's nv blocks (`bytes` apart) as eight floats, zero past nv: built in a
 * register (a vector load of eight just-stored halves would wait on the stores). */
VI_TARGET static inline __attribute__((always_inline)) __m256 SFX(gg_halves8)(const uint8_t *p, int bytes, int at, int nv) {
    uint16_t h[8];
    for (int i = 0; i < 8; i++) {
        h[i] = 0;
        if (i < nv) memcpy(h + i, p + bytes * i + at, 2);
    }
    return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                                          (short)h[6], (short)h[7]));
}

/* Rows [r0, r1) of c's matrix in a 32-value type T (Q8_0, Q4_1, Q5_0, Q5_1) times c's prepared rows, read in place:
 * a step takes eight blocks (the row's last step its remaining ones, the rest zero) and sums each block's 32
 * products u a exactly in int32 (gg_run_sums), less Q5_0's 16 x the group's activation
 * sum; block i's float(sum) x (its float16 scale x its activation group's scale) goes into lane i of the input row's
 * one accumulator of eight floats, one FMA for eight blocks, and Q4_1 / Q5_1 add float(the group's activation sum) x
 * (the block's minimum x the group's scale), a second. A row's sum is simd.h's hsum of the eight. Both variants run
 * these same float operations on the same integers. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_small_rows)(const GgCall *c, int64_t r0, int64_t r1,
                                                                              const int T) {
    const int64_t nb = c->k / 32, bytes = gg_format(T).bytes;
    const int mins = T == GG_Q4_1 || T == GG_Q5_1, kind = T == GG_Q8_0 ? GG_S8 : GG_U8;
    for (int64_t t = 0; t < c->m; t += GG_TILE) {
        const int mb = c->m - t < GG_TILE ? (int)(c->m - t) : GG_TILE;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = c->w + r * c->row_stride;
            __m256 acc[GG_TILE];
            for (int j = 0; j < mb; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b += 8) {
                const uint8_t *p = wr + b * bytes;
                const int nv = nb - b < 8 ? (int)(nb - b) : 8;
                for (int l = 0; l < (8 * bytes + 63) / 64; l++)
                    _mm_prefetch((const char *)p + GG_AHEAD + 64 * l, _MM_HINT_T0);
                const __m256 ws = SFX(gg_halves8)(p, (int)bytes, 0, nv);
                const __m256 wm = mins ? SFX(gg_halves8)(p, (int)bytes, 2, nv) : _mm256_setzero_ps();
                SFX(GgRuns) runs;
#if VL == 16
                if (T != GG_Q8_0)
                    for (int q = 0; q < 4; q++) runs.v[q] = SFX(gg_small_pair)(p + 2 * q * bytes, nv - 2 * q, T);
                else
#endif
                {
                    __m256i w[8];
                    for (int i = 0; i < 8; i++)
                        w[i] = i < nv ? SFX(gg_small_block)(p + bytes * i, T) : _mm256_setzero_si256();
                    SFX(gg_runs)(&runs, w, NULL, kind);
                }
                for (int j = 0; j < mb; j++) {
                    const uint8_t *x = c->xp + (t + j) * c->xstride;
                    const uint8_t *xa = x + 32 * b;
                    const __m256 d = _mm256_loadu_ps((const float *)(x + c->kp) + b);
                    __m256i sum = SFX(gg_run_sums)(&runs, xa, kind), as = _mm256_setzero_si256();
                    if (T != GG_Q8_0)  /* the groups' activation sums */
                        as = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(x + c->kp + c->kp / 8 + 4 * b)),
                                               _mm256_set1_epi16(1));
                    if (T == GG_Q5_0) sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(as, 4));
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, d), acc[j]);
                    if (mins) acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(as), _mm256_mul_ps(wm, d), acc[j]);
                }
            }
            for (int j = 0; j < mb; j++) c->y[(t + j) * c->n + r] = hsum(acc[j]);
        }
    }
}

/* A K-quant super-block as eight groups of 32 values (a group: an activation scale's values), in registers: u[g] the
 * unsigned values, sc[g] the sixteen int16 multipliers of maddubs' pair sums (a pair of sub-block v / 16 times that
 * sub-block's integer scale), off the int16 multipliers of the row's sixteen 16-value activation sums that give each
 * group's offset term (Q3_K, Q6_K: the offset times the scale; subtracted from the sum) or minimum term (Q2_K, Q4_K,
 * Q5_K: the integer minimum; scaled by dm = -dmin), and d. */
typedef struct {
    __m256i u[8], sc[8], off;
    float d, dm;
} SFX(GgSuper);

/* sc[g] from the sixteen sub-block scales s16 (int16; 16-value sub-blocks, equal pairs for 32-value ones): lane
 * pair g broadcast, its first in the low half, its second in the high half. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_super_scales)(__m256i s16, __m256i off,
                                                                                SFX(GgSuper) *o) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                          2, 3, 2, 3, 2, 3);
    for (int g = 0; g < 8; g++)
        o->sc[g] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(s16, _mm256_set1_epi32(g)), pick);
    o->off = off;
}

/* Q6_K: in each half n of 128 values, value 32 t + l (l < 32) takes the nibble t / 2 of ql[64 n + 32 (t % 2) + l]
 * and bits 2t, 2t + 1 of qh[32 n + l]; sub-block v / 16 with its int8 scale; offset 32. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_super_q6_k)(const uint8_t *p, SFX(GgSuper) *o) {
    for (int n = 0; n < 2; n++) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * n));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32));
        const __m256i low[4] = {gg_bits(l0, 0, 0x0f), gg_bits(l1, 0, 0x0f), gg_bits(l0, 4, 0x0f), gg_bits(l1, 4, 0x0f)};
        for (int t = 0; t < 4; t++) o->u[4 * n + t] = _mm256_or_si256(low[t], _mm256_slli_epi16(gg_bits(h, 2 * t, 3), 4));
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
    SFX(gg_super_scales)(s16, _mm256_slli_epi16(s16, 5), o);  /* 32 x scale: at most 4096 */
    o->d = gg_f16(p + 208);
    o->dm = 0.0f;
}

/* Q4_K (qh NULL) or Q5_K: value 64 c + l (l < 32) is the low nibble of qs[32 c + l], 64 c + 32 + l its high nibble,
 * with bit 2c or 2c + 1 of qh[l] as the fifth bit; sub-block v / 32 with its 6-bit scale and minimum from the 12 bytes
 * q at p + 4 (j < 4: the low 6 bits of q[j] and q[j + 4]; j >= 4: the low and the high nibble of q[j + 4] with the top
 * 2 bits of q[j - 4] and q[j]), unpacked four at a time: bytes 0..7 the scales, 8..15 the minimums. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_super_q45_k)(const uint8_t *p, const uint8_t *qh,
                                                                               const uint8_t *qs, SFX(GgSuper) *o) {
    const __m256i h = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        o->u[2 * c] = gg_bits(b, 0, 0x0f);
        o->u[2 * c + 1] = gg_bits(b, 4, 0x0f);
        if (qh) {
            o->u[2 * c] = _mm256_or_si256(o->u[2 * c], _mm256_slli_epi16(gg_bits(h, 2 * c, 1), 4));
            o->u[2 * c + 1] = _mm256_or_si256(o->u[2 * c + 1], _mm256_slli_epi16(gg_bits(h, 2 * c + 1, 1), 4));
        }
    }
    const uint32_t q0 = gg_u32(p + 4), q1 = gg_u32(p + 8), q2 = gg_u32(p + 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const __m128i sm = _mm_setr_epi32((int)(q0 & m6), (int)((q2 & m4) | (((q0 >> 6) & m2) << 4)), (int)(q1 & m6),
                                      (int)(((q2 >> 4) & m4) | (((q1 >> 6) & m2) << 4)));
    const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    SFX(gg_super_scales)(_mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, pairs)),
                         _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, _mm_add_epi8(pairs, _mm_set1_epi8(8)))), o);
    o->d = gg_f16(p);
    o->dm = -gg_f16(p + 2);
}

/* Q2_K or Q3_K: in each half n of 128 values, value 32 j + l takes bits 2j, 2j + 1 of qs[32 n + l] (Q3_K: plus 4
 * where bit 4n + j of hm[l] is set, offset 4); sub-block v / 16. Q2_K's scale and minimum: the low and high nibble of
 * byte v / 16; Q3_K's 6-bit scales: the low 4 bits from bytes 0..7 (low nibbles, then high), the top 2 from bytes
 * 8..11, less 32. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_super_q23_k)(const uint8_t *p, const int T,
                                                                               SFX(GgSuper) *o) {
    const uint8_t *qs = T == GG_Q3_K ? p + 32 : p + 16;
    const __m256i h = T == GG_Q3_K ? _mm256_loadu_si256((const __m256i *)p) : _mm256_setzero_si256();
    for (int n = 0; n < 2; n++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        for (int j = 0; j < 4; j++) {
            o->u[4 * n + j] = gg_bits(b, 2 * j, 3);
            if (T == GG_Q3_K)
                o->u[4 * n + j] = _mm256_or_si256(o->u[4 * n + j], _mm256_slli_epi16(gg_bits(h, 4 * n + j, 1), 2));
        }
    }
    if (T == GG_Q3_K) {  /* scales 0..3, 4..7, 8..11, 12..15: a word's low nibbles or high, with 2 bits of word 2 */
        const uint32_t a0 = gg_u32(p + 96), a1 = gg_u32(p + 100), a2 = gg_u32(p + 104), m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
        const __m128i s8 = _mm_setr_epi32((int)((a0 & m4) | ((a2 & m2) << 4)), (int)((a1 & m4) | (((a2 >> 2) & m2) << 4)),
                                          (int)(((a0 >> 4) & m4) | (((a2 >> 4) & m2) << 4)),
                                          (int)(((a1 >> 4) & m4) | (((a2 >> 6) & m2) << 4)));
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_sub_epi8(s8, _mm_set1_epi8(32)));
        SFX(gg_super_scales)(s16, _mm256_slli_epi16(s16, 2), o);
        o->d = gg_f16(p + 108);
        o->dm = 0.0f;
    } else {
        const __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0f);
        SFX(gg_super_scales)(_mm256_cvtepu8_epi16(_mm_and_si128(b, low)),
                             _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low)), o);
        o->d = gg_f16(p + 80);
        o->dm = -gg_f16(p + 82);
    }
}

VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_super)(const uint8_t *p, const int T,
                                                                         SFX(GgSuper) *o) {
    switch (T) {
        case GG_Q2_K: SFX(gg_super_q23_k)(p, GG_Q2_K, o); return;
        case GG_Q3_K: SFX(gg_super_q23_k)(p, GG_Q3_K, o); return;
        case GG_Q4_K: SFX(gg_super_q45_k)(p, NULL, p + 16, o); return;
        case GG_Q5_K: SFX(gg_super_q45_k)(p, p + 16, p + 48, o); return;
        default: SFX(gg_super_q6_k)(p, o); return;
    }
}

/* A super-block's runs (scales applied: maddubs' pair sums times the int16 multipliers) against the input row's 256
 * int8 values at xa, in eight int32 lanes whose sum is the exact integer total (AVX-512: two runs a vector, the
 * halves added). */
VI_TARGET static inline __attribute__((always_inline)) __m256i SFX(gg_run_total)(const SFX(GgRuns) *r,
                                                                                const uint8_t *xa) {
#if VL == 8
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(r->v[i],
                                                  _mm256_loadu_si256((const __m256i *)(xa + 32 * i))), r->m[i]));
    return s;
#else
    __m512i s = _mm512_setzero_si512();
    for (int q = 0; q < 4; q++)
        s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(r->v[q],
                                                  _mm512_loadu_si512((const void *)(xa + 64 * q))), r->m[q]));
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
#endif
}

/* Lane i: the sum of v[i]'s eight int32 lanes (exact). */
VI_TARGET static inline __attribute__((always_inline)) __m256i SFX(gg_sum8)(const __m256i *v) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* Eight super-blocks' values (lanes) for one input row: float(isum) x (d x G), plus float(msum) x (dm x G) by an FMA
 * where the type has minimums; isum the exact integer total (Q3_K, Q6_K: the offset term taken off), msum the
 * minimums' term, G the input row's super-block activation scale. A row's result is the sum of its super-blocks'
 * values added in order, in gg_k_tile (lanes: a row's super-blocks) as in gg_k8_rows (lanes: rows). */
VI_TARGET static inline __attribute__((always_inline)) __m256 SFX(gg_k_value)(__m256i isum, __m256i msum, __m256 d,
                                                                             __m256 dm, __m256 g, const int sub) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, g));
    if (!sub) v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dm, g), v);
    __asm__("" : "+x"(v));  /* rounded here: the compiler may not fuse the product into the sum it is added to */
    return v;
}

/* A K-quant super-block's float16 d and (negated) dmin offsets. */
static inline __attribute__((always_inline)) int SFX(gg_k_d_at)(const int T) {
    return T == GG_Q6_K ? 208 : T == GG_Q3_K ? 108 : T == GG_Q2_K ? 80 : 0;
}

/* The K form of prepared row x (gemv_ggml.c): its values, super-block scales and 16-value sums. */
#ifndef GG_KA
#define GG_KA(x, kp) ((x) + GG_K_FORM(kp))
#define GG_KG(x, kp) ((const float *)((x) + GG_K_FORM(kp) + (kp)))
#define GG_KH(x, kp) ((const int16_t *)((x) + GG_K_FORM(kp) + (kp) + (kp) / 64))
#endif

#if VL == 16
/* Q4_K and Q5_K (qh non-NULL) straight into the AVX-512 runs, two groups a vector: run vector q holds groups 2q
 * (the low nibbles of qs[32 q ..]) and 2q + 1 (their high nibbles), Q5_K's fifth bits set by a byte mask; each
 * vector's int16 multipliers permuted from the sixteen scales and minimums at once. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_runs_q45_k)(const uint8_t *p, const uint8_t *qh,
                                                                              const uint8_t *qs, SFX(GgRuns) *r,
                                                                              __m256i *off) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i h = qh ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh)) : _mm512_setzero_si512();
    for (int n = 0; n < 2; n++) {
        const __m512i z = _mm512_loadu_si512((const void *)(qs + 64 * n));
        const __m512i lo = _mm512_and_si512(z, low), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
        r->v[2 * n] = _mm512_shuffle_i64x2(lo, hi, 0x44);
        r->v[2 * n + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
    }
    if (qh)  /* group g takes bit g of qh[l] */
        for (int q = 0; q < 4; q++) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * q))),
                                                   _mm256_set1_epi8((char)(2 << (2 * q))), 1);
            r->v[q] = _mm512_mask_add_epi8(r->v[q], _mm512_test_epi8_mask(h, bit), r->v[q], _mm512_set1_epi8(16));
        }
    /* the 12 bytes q at p + 4 (and four bytes of qs after them, unused) to scales 0..3 = q[0..3] & 63, 4..7 =
     * (q[8..11] & 15) | (q[0..3] >> 6) << 4, minimums 0..3 = q[4..7] & 63,
     * 4..7 = (q[8..11] >> 4) | (q[4..7] >> 6) << 4, in vector registers */
    const __m128i q = _mm_loadu_si128((const __m128i *)(p + 4));
    const __m128i lo = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i sm = _mm_or_si128(
        _mm_and_si128(_mm_srlv_epi32(lo, _mm_setr_epi32(0, 0, 0, 4)), _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f,
                                                                                      0x0f0f0f0f)),
        _mm_and_si128(_mm_srli_epi16(top, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
    const __m256i s16 = _mm256_cvtepu8_epi16(sm);  /* lanes 0..7 the scales, 8..15 the minimums */
    const __m512i z16 = _mm512_castsi256_si512(s16);
    for (int q = 0; q < 4; q++)
        r->m[q] = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)(2 * q)),
                                                              _mm256_set1_epi16((short)(2 * q + 1)), 1), z16);
    *off = _mm256_permutexvar_epi16(_mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15),
                                    s16);
}

/* Q6_K straight into the AVX-512 runs: run vector q holds groups 2q and 2q + 1, the low or high nibbles of
 * ql[64 (q / 2) ..] (already in group order) with their two high bits from qh, shifted into place per half. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_runs_q6_k)(const uint8_t *p, SFX(GgRuns) *r,
                                                                             __m256i *off) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const __m512i qh = _mm512_loadu_si512((const void *)(p + 128));
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int n = 0; n < 2; n++) {
        const __m512i z = _mm512_loadu_si512((const void *)(p + 64 * n));
        const __m512i h = _mm512_shuffle_i64x2(qh, qh, n ? 0xEE : 0x44);  /* qh[32 n ..] in both halves */
        r->v[2 * n] = _mm512_or_si512(_mm512_and_si512(z, low), _mm512_and_si512(_mm512_sllv_epi16(h, up), top));
        r->v[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(z, 4), low),
                                          _mm512_and_si512(_mm512_srlv_epi16(h, down), top));
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
    const __m512i z16 = _mm512_castsi256_si512(s16);
    for (int q = 0; q < 4; q++)
        r->m[q] = _mm512_permutexvar_epi16(_mm512_setr_epi64(  /* lanes 8 j .. 8 j + 7: sub-block 4 q + j */
            0x0001000100010001LL * (4 * q), 0x0001000100010001LL * (4 * q), 0x0001000100010001LL * (4 * q + 1),
            0x0001000100010001LL * (4 * q + 1), 0x0001000100010001LL * (4 * q + 2),
            0x0001000100010001LL * (4 * q + 2), 0x0001000100010001LL * (4 * q + 3),
            0x0001000100010001LL * (4 * q + 3)), z16);
    *off = _mm256_slli_epi16(s16, 5);  /* 32 x scale */
}
#endif

/* Super-block p of type T as runs, with its offset (or minimum) multipliers (d and dm: read eight at a time). */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_k_unpack)(const uint8_t *p, const int T,
                                                                            SFX(GgRuns) *r, __m256i *off) {
#if VL == 16
    if (T == GG_Q4_K || T == GG_Q5_K || T == GG_Q6_K) {
        if (T == GG_Q6_K) SFX(gg_runs_q6_k)(p, r, off);
        else SFX(gg_runs_q45_k)(p, T == GG_Q5_K ? p + 16 : NULL, T == GG_Q5_K ? p + 48 : p + 16, r, off);
        return;
    }
#endif
    SFX(GgSuper) s;
    SFX(gg_super)(p, T, &s);
    SFX(gg_runs)(r, s.u, s.sc, GG_MUL);
    *off = s.off;
}

/* K-quant (T) rows [r0, r1) of c's matrix times c's prepared rows (their K form: one activation scale a
 * super-block), read in place a row at a time, eight super-blocks a step: each super-block unpacked once for a tile
 * of input rows, its exact integer total against each (gg_run_total; the offset or minimum term from the 16-value
 * sums), the eight totals gathered into one vector's lanes (gg_sum8), made values (gg_k_value) and added to the
 * row's sum in order, as gg_k8_rows's lanes add them. The same float operations whatever rows share the call, and
 * in both variants. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_k_tile)(const GgCall *c, int64_t r0, int64_t r1,
                                                                          const int T, const int ONE) {
    const int64_t nb = c->k / 256, bytes = gg_format(T).bytes;
    const int sub = T == GG_Q3_K || T == GG_Q6_K;
    for (int64_t t = 0; t < c->m; t += GG_TILE) {
        const int mb = ONE ? 1 : c->m - t < GG_TILE ? (int)(c->m - t) : GG_TILE;
        for (int64_t r = r0; r < r1; r++) {
            float acc[GG_TILE] = {0};
            for (int64_t b0 = 0; b0 < nb; b0 += 8) {
                const int nv = nb - b0 < 8 ? (int)(nb - b0) : 8;
                __m256i tot[GG_TILE][8], mt[GG_TILE][8];
                for (int i = 0; i < 8; i++) {
                    if (i >= nv) {
                        for (int j = 0; j < mb; j++) tot[j][i] = mt[j][i] = _mm256_setzero_si256();
                        continue;
                    }
                    const uint8_t *p = c->w + r * c->row_stride + (b0 + i) * bytes;
                    for (int l = 0; l < 4; l++) _mm_prefetch((const char *)p + GG_AHEAD + 64 * l, _MM_HINT_T0);
                    SFX(GgRuns) runs;
                    __m256i offm;
                    SFX(gg_k_unpack)(p, T, &runs, &offm);
                    for (int j = 0; j < mb; j++) {
                        const uint8_t *x = c->xp + (t + j) * c->xstride;
                        const __m256i a16 = _mm256_loadu_si256((const __m256i *)(GG_KH(x, c->kp) + 16 * (b0 + i)));
                        const __m256i main = SFX(gg_run_total)(&runs, GG_KA(x, c->kp) + 256 * (b0 + i));
                        const __m256i off = _mm256_madd_epi16(offm, a16);
                        tot[j][i] = sub ? _mm256_sub_epi32(main, off) : main;
                        mt[j][i] = off;
                    }
                }
                const uint8_t *p0 = c->w + r * c->row_stride + b0 * bytes;
                const __m256 d = SFX(gg_halves8)(p0, (int)bytes, SFX(gg_k_d_at)(T), nv);
                const __m256 dm = sub ? _mm256_setzero_ps()
                                      : _mm256_sub_ps(_mm256_setzero_ps(),
                                                      SFX(gg_halves8)(p0, (int)bytes, SFX(gg_k_d_at)(T) + 2, nv));
                for (int j = 0; j < mb; j++) {
                    const float *g = GG_KG(c->xp + (t + j) * c->xstride, c->kp) + b0;
                    float v[8];
                    const __m256i msum = sub ? tot[j][0] : SFX(gg_sum8)(mt[j]);
                    _mm256_storeu_ps(v, SFX(gg_k_value)(SFX(gg_sum8)(tot[j]), msum, d, dm, _mm256_loadu_ps(g), sub));
                    for (int i = 0; i < nv; i++) acc[j] += v[i];
                }
            }
            for (int j = 0; j < mb; j++) c->y[(t + j) * c->n + r] = acc[j];
        }
    }
}

/* A call of one input row (a decode step's) takes its own copy, whose sums stay in registers. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_k_rows)(const GgCall *c, int64_t r0, int64_t r1,
                                                                          const int T) {
    if (c->m == 1) SFX(gg_k_tile)(c, r0, r1, T, 1);
    else SFX(gg_k_tile)(c, r0, r1, T, 0);
}

#if VL == 16
/* Q8_0 rows of a call of at least GG_R8_MIN_SMALL input rows (the AVX-512 + VNNI variant): eight weight rows at a
 * time, interleaved into a buffer once (block b: eight vectors of 32 bytes, vector q holding values 4q..4q+3 of each of
 * the eight rows, lane i row i, as unsigned w + 128; then the eight rows' float16 scales as floats), then every input
 * row passes over the buffer: each block's eight rows' exact sums of w a in the int32 lanes of one vector (vpdpbusd
 * against the four activations broadcast, from -128 x the block's activation sum), turned to float and added times
 * (scale x the group's activation scale) into the accumulator of the block's phase b % 8; the eight phases are summed
 * as simd.h's hsum sums the lanes of gg_small_rows's accumulator. Each row sees the same integers and float
 * operations, in the same order, as in gg_small_rows: the same bits, with no sum across lanes per block. */
#define GG_R8_MIN_ROWS 24
#define GG_R8_MIN_SMALL 12  /* Q8_0 and Q5_0: 1.4x the tile path at 12 and 16 rows on this Zen 4, slower at 8 */

/* The 8 x 8 transpose of 32-bit words into o: o[q] word i = v[i] word q. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_r8_transpose)(const __m256i *v, __m256i *o) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    _mm256_store_si256(o + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
    _mm256_store_si256(o + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
    _mm256_store_si256(o + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
    _mm256_store_si256(o + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
    _mm256_store_si256(o + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
    _mm256_store_si256(o + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
    _mm256_store_si256(o + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
    _mm256_store_si256(o + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
}

/* Weight rows r .. r + rows of a Q8_0 or Q5_0 (T) call, interleaved into buf as w + 128 (Q5_0: w = u - 16), their
 * scales into ws. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_r8_pack)(const GgCall *c, int64_t r, int rows,
                                                                           uint8_t *buf, float *ws, const int T) {
    const int64_t nb = c->k / 32, bytes = gg_format(T).bytes;
    const __m256i flip = _mm256_set1_epi8((char)0x80), shift = _mm256_set1_epi8(128 - 16);
    for (int64_t b = 0; b < nb; b++) {
        __m256i v[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = c->w + (r + (i < rows ? i : 0)) * c->row_stride + b * bytes;
            const __m256i w = T == GG_Q8_0 ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)), flip)
                                           : _mm256_add_epi8(SFX(gg_small_block)(p, GG_Q5_0), shift);
            v[i] = i < rows ? w : flip;
            ws[8 * b + i] = i < rows ? gg_f16(p) : 0.0f;
        }
        SFX(gg_r8_transpose)(v, (__m256i *)(buf + 256 * b));
    }
}

/* Block b of the buffer against input row x: the eight rows' exact sums of w a (two chains of vpdpbusd, whose
 * int32 sums are exact in any order). */
VI_TARGET static inline __attribute__((always_inline)) __m256i SFX(gg_r8_block)(const uint8_t *buf, const uint8_t *x,
                                                                               const int16_t *h, int64_t b) {
    const __m256i *w = (const __m256i *)(buf + 256 * b);
    const uint8_t *a = x + 32 * b;
    __m256i s0 = _mm256_set1_epi32(-128 * ((int32_t)h[2 * b] + (int32_t)h[2 * b + 1])), s1 = _mm256_setzero_si256();
    for (int q = 0; q < 8; q += 2) {
        s0 = _mm256_dpbusd_epi32(s0, _mm256_load_si256(w + q), _mm256_set1_epi32((int32_t)gg_u32(a + 4 * q)));
        s1 = _mm256_dpbusd_epi32(s1, _mm256_load_si256(w + q + 1), _mm256_set1_epi32((int32_t)gg_u32(a + 4 * q + 4)));
    }
    return _mm256_add_epi32(s0, s1);
}

/* The eight phases of a row's accumulators summed as simd.h's hsum sums lanes: ((0 + 4) + (1 + 5)) + ((2 + 6) +
 * (3 + 7)); the first `rows` lanes (weight rows) stored at y. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_r8_store)(const __m256 *acc, float *y, int rows) {
    const __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[1], acc[5])),
                                   _mm256_add_ps(_mm256_add_ps(acc[2], acc[6]), _mm256_add_ps(acc[3], acc[7])));
    float out[8];
    _mm256_storeu_ps(out, t);
    for (int i = 0; i < rows; i++) y[i] = out[i];
}

/* NR (1 or 2) input rows from row j against the packed rows: block b into phase b % 8. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_r8_rows)(const GgCall *c, const uint8_t *buf,
                                                                           const float *ws, int64_t r, int rows,
                                                                           int64_t j, const int NR) {
    const int64_t nb = c->k / 32;
    const uint8_t *x[2];
    const float *g[2];
    const int16_t *h[2];
    __m256 acc[2][8];
    for (int t = 0; t < NR; t++) {
        x[t] = c->xp + (j + t) * c->xstride;
        g[t] = (const float *)(x[t] + c->kp);
        h[t] = (const int16_t *)(x[t] + c->kp + c->kp / 8);
        for (int i = 0; i < 8; i++) acc[t][i] = _mm256_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const int64_t b = b0 + i;
            if (b >= nb) break;
            const __m256 scale = _mm256_load_ps(ws + 8 * b);
            for (int t = 0; t < NR; t++) {
                const __m256i s = SFX(gg_r8_block)(buf, x[t], h[t], b);
                acc[t][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, _mm256_set1_ps(g[t][b])),
                                            acc[t][i]);
            }
        }
    }
    for (int t = 0; t < NR; t++) SFX(gg_r8_store)(acc[t], c->y + (j + t) * c->n + r, rows);
}

/* Q8_0 or Q5_0 (T) rows of a call of at least GG_R8_MIN_SMALL input rows, eight weight rows at a time. Q5_0's block
 * sum is Q8_0's over w = u - 16: the integer gg_small_rows takes (its sum of u a less 16 times the activation sum). */
VI_TARGET static void SFX(gg_r8_call)(const GgCall *c, int64_t r0, int64_t r1, const int T) {
    const int64_t nb = c->k / 32;
    uint8_t *buf = (uint8_t *)alloc_lines((size_t)(nb * 256));
    float *ws = (float *)alloc_lines((size_t)(nb * 8 * 4));
    if (!buf || !ws) abort();
    for (int64_t r = r0; r < r1; r += 8) {
        const int rows = r1 - r < 8 ? (int)(r1 - r) : 8;
        SFX(gg_r8_pack)(c, r, rows, buf, ws, T);
        int64_t j = 0;
        for (; j + 2 <= c->m; j += 2) SFX(gg_r8_rows)(c, buf, ws, r, rows, j, 2);
        if (j < c->m) SFX(gg_r8_rows)(c, buf, ws, r, rows, j, 1);
    }
    free(buf);
    free(ws);
}

/* A K-quant call's weight rows r .. r + rows (T), unpacked (gg_super) and interleaved eight rows at a time into one
 * super-block's part of the buffer: its 256 values as eight groups of eight vectors (vector q of group g: values
 * 32 g + 4 q .. + 3 of each row, a row a lane, unsigned), then the sixteen 16-value sub-blocks' integer scales and
 * offset (or minimum) multipliers as int32 vectors, then d and dm as float vectors. */
#define GG_K8_BYTES (2048 + 2 * 16 * 32 + 2 * 32)

VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_k8_pack)(const GgCall *c, int64_t r, int rows,
                                                                           int64_t b, uint8_t *out, const int T) {
    const int64_t bytes = gg_format(T).bytes;
    int32_t *sc = (int32_t *)(out + 2048), *off = sc + 16 * 8;
    float *d = (float *)(off + 16 * 8), *dm = d + 8;
    __m256i v[8][8];
    for (int i = 0; i < 8; i++) {
        SFX(GgSuper) sup;
        SFX(gg_super)(c->w + (r + (i < rows ? i : 0)) * c->row_stride + b * bytes, T, &sup);
        int16_t s16[16], o16[16];
        _mm256_storeu_si256((__m256i *)o16, sup.off);
        for (int g = 0; g < 8; g++) {
            int16_t m[16];
            _mm256_storeu_si256((__m256i *)m, sup.sc[g]);
            s16[2 * g] = m[0];
            s16[2 * g + 1] = m[8];
            v[g][i] = i < rows ? sup.u[g] : _mm256_setzero_si256();
        }
        for (int l = 0; l < 16; l++) {
            sc[8 * l + i] = i < rows ? s16[l] : 0;
            off[8 * l + i] = i < rows ? o16[l] : 0;
        }
        d[i] = i < rows ? sup.d : 0.0f;
        dm[i] = i < rows ? sup.dm : 0.0f;
    }
    for (int g = 0; g < 8; g++) SFX(gg_r8_transpose)(v[g], (__m256i *)(out + 256 * g));
}

/* Group g of a packed super-block against input row x's super-block (a: its 256 values, h: its sixteen 16-value
 * sums): the eight rows' integer sum (scales applied) and offset (or minimum) term, as gg_k_rows's lane g. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_k8_group)(const uint8_t *sb, const uint8_t *a,
                                                                            const int16_t *h, int g, __m256i *sum,
                                                                            __m256i *off, const int T) {
    const __m256i *w = (const __m256i *)(sb + 256 * g), *sc = (const __m256i *)(sb + 2048), *of = sc + 16;
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int q = 0; q < 4; q++) {
        lo = _mm256_dpbusd_epi32(lo, _mm256_load_si256(w + q), _mm256_set1_epi32((int32_t)gg_u32(a + 32 * g + 4 * q)));
        hi = _mm256_dpbusd_epi32(hi, _mm256_load_si256(w + 4 + q),
                                 _mm256_set1_epi32((int32_t)gg_u32(a + 32 * g + 16 + 4 * q)));
    }
    if (T == GG_Q4_K || T == GG_Q5_K) {  /* 32-value sub-blocks: both halves share the scale and the minimum */
        *sum = _mm256_mullo_epi32(_mm256_add_epi32(lo, hi), _mm256_load_si256(sc + 2 * g));
        *off = _mm256_mullo_epi32(_mm256_load_si256(of + 2 * g), _mm256_set1_epi32(h[2 * g] + h[2 * g + 1]));
        return;
    }
    *sum = _mm256_add_epi32(_mm256_mullo_epi32(lo, _mm256_load_si256(sc + 2 * g)),
                            _mm256_mullo_epi32(hi, _mm256_load_si256(sc + 2 * g + 1)));
    *off = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_load_si256(of + 2 * g), _mm256_set1_epi32(h[2 * g])),
                            _mm256_mullo_epi32(_mm256_load_si256(of + 2 * g + 1), _mm256_set1_epi32(h[2 * g + 1])));
}

/* NR (1 or 2) input rows from row j against the packed super-blocks: each super-block's eight groups' integer sums
 * added in int32 (exact), its value (gg_k_value) added to each row's sum as gg_k_tile adds a row's. */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_k8_rows)(const GgCall *c, const uint8_t *buf,
                                                                           int64_t r, int rows, int64_t j,
                                                                           const int T, const int NR) {
    const int64_t nb = c->k / 256;
    const int sub = T == GG_Q3_K || T == GG_Q6_K;
    const uint8_t *x[2];
    __m256 acc[2];
    for (int t = 0; t < NR; t++) {
        x[t] = c->xp + (j + t) * c->xstride;
        acc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = buf + b * GG_K8_BYTES;
        const __m256 d = _mm256_load_ps((const float *)(sb + 3072)), dm = _mm256_load_ps((const float *)(sb + 3104));
        __m256i isum[2], osum[2];
        for (int t = 0; t < NR; t++) isum[t] = osum[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++)
            for (int t = 0; t < NR; t++) {
                __m256i sum, off;
                SFX(gg_k8_group)(sb, GG_KA(x[t], c->kp) + 256 * b, GG_KH(x[t], c->kp) + 16 * b, g, &sum, &off, T);
                isum[t] = _mm256_add_epi32(isum[t], sum);
                osum[t] = _mm256_add_epi32(osum[t], off);
            }
        for (int t = 0; t < NR; t++)
            acc[t] = _mm256_add_ps(acc[t], SFX(gg_k_value)(sub ? _mm256_sub_epi32(isum[t], osum[t]) : isum[t], osum[t],
                                                           d, dm, _mm256_set1_ps(GG_KG(x[t], c->kp)[b]), sub));
    }
    for (int t = 0; t < NR; t++) {
        float out[8];
        _mm256_storeu_ps(out, acc[t]);
        for (int i = 0; i < rows; i++) c->y[(j + t) * c->n + r + i] = out[i];
    }
}

/* K-quant rows of a call of at least GG_R8_MIN_ROWS input rows, eight weight rows at a time (gg_k8_pack): each group
 * g's sums for eight rows in one vector, added as gg_k_rows adds lane g (the same integers, the same float operations
 * in the same order), the eight groups' accumulators summed in simd.h's hsum order: the same bits. */
VI_TARGET static void SFX(gg_k_r8)(const GgCall *c, int64_t r0, int64_t r1, const int T) {
    const int64_t nb = c->k / 256;
    uint8_t *buf = (uint8_t *)alloc_lines((size_t)(nb * GG_K8_BYTES));
    if (!buf) abort();
    for (int64_t r = r0; r < r1; r += 8) {
        const int rows = r1 - r < 8 ? (int)(r1 - r) : 8;
        for (int64_t b = 0; b < nb; b++) SFX(gg_k8_pack)(c, r, rows, b, buf + b * GG_K8_BYTES, T);
        int64_t j = 0;
        for (; j + 2 <= c->m; j += 2) SFX(gg_k8_rows)(c, buf, r, rows, j, T, 2);
        if (j < c->m) SFX(gg_k8_rows)(c, buf, r, rows, j, T, 1);
    }
    free(buf);
}
#endif

/* GG_Q4_K_R8: Q4_K rows repacked at load eight at a time (gemv_ggml.c, mla_ggml_repack_q4_k), an eight-row
 * super-block of GG_Q4R8_BYTES read as one stream:
 *
 *     [0, 1024)     group g (32 values) at 128 g: four vectors of 32 bytes, vector q's byte 4 i + j holding row i's
 *                   value 4 q + j in its low nibble and value 16 + 4 q + j in its high nibble
 *     [1024, 1088)  byte 8 g + i: row i's scale of group g
 *     [1088, 1152)  byte 16 p + 2 i + e: row i's minimum of group 2 p + e
 *     [1152, 1168)  the rows' float16 d; [1168, 1184) their float16 dmin
 *
 * A nibble vector masked or shifted is a vector of eight rows' four values (a row a lane), met by four activations
 * broadcast: each group's eight rows' exact sums in one vector, with no sum across lanes, at any count of input rows
 * and with no packing per call. The integers are gg_k8_rows's and gg_k_tile's (the scales applied in int32, the
 * minimums' term from the 16-value sums), and each super-block's value is gg_k_value's, added in order: the bits of
 * a stored Q4_K row's product. */
VI_TARGET static inline __attribute__((always_inline)) __m256i SFX(gg_dpbusd)(__m256i acc, __m256i u, __m256i a) {
#if VL == 16
    return _mm256_dpbusd_epi32(acc, u, a);
#else  /* u at most 15: maddubs' pair sums stay far from int16's bounds */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}

#define GG_Q4R8_NR 4  /* input rows a pass over an eight-row group (AVX2 too: at four rows 1.7x two passes of two) */

/* NR input rows from row j against the eight weight rows from r (a multiple of 8). */
VI_TARGET static inline __attribute__((always_inline)) void SFX(gg_q4r8_rows)(const GgCall *c, int64_t r, int64_t j,
                                                                             const int NR) {
    const int64_t nb = c->k / 256;
    const uint8_t *grp = c->w + r * c->row_stride, *xa[GG_Q4R8_NR];
    const int16_t *xh[GG_Q4R8_NR];
    const float *xg[GG_Q4R8_NR];
    __m256 acc[GG_Q4R8_NR];
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int t = 0; t < NR; t++) {
        const uint8_t *x = c->xp + (j + t) * c->xstride;
        xa[t] = GG_KA(x, c->kp);
        xh[t] = GG_KH(x, c->kp);
        xg[t] = GG_KG(x, c->kp);
        acc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = grp + b * GG_Q4R8_BYTES;
        for (int l = 0; l < (GG_Q4R8_BYTES + 63) / 64; l++)
            _mm_prefetch((const char *)sb + GG_AHEAD + 64 * l, _MM_HINT_T0);
        __m256i isum[GG_Q4R8_NR], msum[GG_Q4R8_NR];
        for (int t = 0; t < NR; t++) isum[t] = msum[t] = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            __m256i s0[GG_Q4R8_NR], s1[GG_Q4R8_NR];
            for (int t = 0; t < NR; t++) s0[t] = s1[t] = _mm256_setzero_si256();
            for (int q = 0; q < 4; q++) {
                const __m256i n = _mm256_loadu_si256((const __m256i *)(sb + 128 * g + 32 * q));
                const __m256i lo = _mm256_and_si256(n, low), hi = _mm256_and_si256(_mm256_srli_epi16(n, 4), low);
                for (int t = 0; t < NR; t++) {
                    const uint8_t *a = xa[t] + 256 * b + 32 * g + 4 * q;
                    s0[t] = SFX(gg_dpbusd)(s0[t], lo, _mm256_set1_epi32((int32_t)gg_u32(a)));
                    s1[t] = SFX(gg_dpbusd)(s1[t], hi, _mm256_set1_epi32((int32_t)gg_u32(a + 16)));
                }
            }
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 1024 + 8 * g)));
            for (int t = 0; t < NR; t++)
                isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(_mm256_add_epi32(s0[t], s1[t]), sc));
        }
        for (int p = 0; p < 4; p++) {  /* lane i: row i's minimums of groups 2p, 2p + 1 times their 32-value sums */
            const __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sb + 1088 + 16 * p)));
            for (int t = 0; t < NR; t++) {
                const int16_t *h = xh[t] + 16 * b + 4 * p;
                const uint32_t pair = (uint32_t)(uint16_t)(h[0] + h[1]) | (uint32_t)(uint16_t)(h[2] + h[3]) << 16;
                msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(m, _mm256_set1_epi32((int32_t)pair)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 1152)));
        const __m256 dm = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 1168))));
        for (int t = 0; t < NR; t++)
            acc[t] = _mm256_add_ps(acc[t], SFX(gg_k_value)(isum[t], msum[t], d, dm, _mm256_set1_ps(xg[t][b]), 0));
    }
    for (int t = 0; t < NR; t++) _mm256_storeu_ps(c->y + (j + t) * c->n + r, acc[t]);
}

/* Rows [r0, r1) of a GG_Q4_K_R8 call (both multiples of 8), GG_Q4R8_NR input rows a pass. */
VI_TARGET static void SFX(gg_q4r8_call)(const GgCall *c, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r += 8) {
        int64_t j = 0;
        for (; j + GG_Q4R8_NR <= c->m; j += GG_Q4R8_NR) SFX(gg_q4r8_rows)(c, r, j, GG_Q4R8_NR);
        for (; j < c->m; j++) SFX(gg_q4r8_rows)(c, r, j, 1);
    }
}

/* The same for the call's type, chosen at run time (each case a copy specialised to its type). */
VI_TARGET static void SFX(gg_rows)(const GgCall *c, int64_t r0, int64_t r1) {
    switch (c->type) {
#if VL == 16
        case GG_Q8_0:
            if (c->m >= GG_R8_MIN_SMALL) SFX(gg_r8_call)(c, r0, r1, GG_Q8_0);
            else SFX(gg_small_rows)(c, r0, r1, GG_Q8_0);
            break;
        case GG_Q5_0:
            if (c->m >= GG_R8_MIN_SMALL) SFX(gg_r8_call)(c, r0, r1, GG_Q5_0);
            else SFX(gg_small_rows)(c, r0, r1, GG_Q5_0);
            break;
#else
        case GG_Q8_0: SFX(gg_small_rows)(c, r0, r1, GG_Q8_0); break;
        case GG_Q5_0: SFX(gg_small_rows)(c, r0, r1, GG_Q5_0); break;
#endif
        case GG_Q4_1: SFX(gg_small_rows)(c, r0, r1, GG_Q4_1); break;
        case GG_Q5_1: SFX(gg_small_rows)(c, r0, r1, GG_Q5_1); break;
#if VL == 16
#define GG_K_CASE(T) if (c->m >= GG_R8_MIN_ROWS) SFX(gg_k_r8)(c, r0, r1, T); else SFX(gg_k_rows)(c, r0, r1, T)
#else
#define GG_K_CASE(T) SFX(gg_k_rows)(c, r0, r1, T)
#endif
        case GG_Q4_K_R8: SFX(gg_q4r8_call)(c, r0, r1); break;
        case GG_Q2_K: GG_K_CASE(GG_Q2_K); break;
        case GG_Q3_K: GG_K_CASE(GG_Q3_K); break;
        case GG_Q4_K: GG_K_CASE(GG_Q4_K); break;
        case GG_Q5_K: GG_K_CASE(GG_Q5_K); break;
        default: GG_K_CASE(GG_Q6_K); break;
#undef GG_K_CASE
    }
}

