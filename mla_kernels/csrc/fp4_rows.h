/* The FP4 products of gemm_fp4.c (E2M1 weights with a float32 scale per group of a row, against float32 rows),
 * written once over the vector vocabulary (vec_avx2.h, vec_avx512.h) and included once per instruction set. The
 * nibbles are widened by a 16-entry table held in a register (V_E2M1: one byte shuffle), multiplied by half their
 * group's scale (the table holds doubled values, so the weight is e2m1 * scale rounded once, as
 * fp4_format.dequantize_fp4 gives it) and multiplied into each input row's float accumulator. Each output is its own
 * accumulator's sum in the same order whatever the rows beside it, so a row's result does not depend on how many rows
 * share the call. */

#define FP4_BLOCK 4 /* input rows a pass over a weight row */

/* One weight row wr (k / 2 bytes; gs: half of each group's scale) against m <= FP4_BLOCK rows of x (stride k). */
V_TARGET static inline __attribute__((always_inline)) void SFX(fp4_tile)(const uint8_t *wr, const float *gs,
                                                                        const float *x, float *y, const int m,
                                                                        int64_t n, int64_t k, int64_t group,
                                                                        __m128i table) {
    V acc[FP4_BLOCK];
    for (int j = 0; j < m; j++) acc[j] = V_ZERO();
    for (int64_t c = 0, g = 0; c < k; c += group, g++) {
        const V s = V_SET1(gs[g]);
        for (int64_t i = c; i < c + group; i += VL) {
            const V wv = V_MUL(V_E2M1(wr + i / 2, table), s);
            for (int j = 0; j < m; j++) acc[j] = V_FMA(wv, V_LOAD(x + j * k + i), acc[j]);
        }
    }
    for (int j = 0; j < m; j++) y[j * n] = V_HSUM(acc[j]);
}

/* Every weight row (a contiguous range a thread), its group scales decoded once (fp4_scales), every input row
 * passed over it FP4_BLOCK at a time while it is in L1. */
V_TARGET static void SFX(fp4_rows)(int64_t kind, const uint8_t *w, const uint8_t *scales, const float *global,
                                   const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
    const int64_t group = fp4_group(kind), groups = k / group;
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    #pragma omp parallel num_threads((int)(n > 1 ? threads : 1))
    {
        float *gs = (float *)malloc((size_t)groups * sizeof(float));
        if (!gs) abort();
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            fp4_scales(kind, scales + r * groups, global ? global[r] : 1.0f, gs, groups);
            const uint8_t *wr = w + r * (k / 2);
            for (int64_t j = 0; j < m; j += FP4_BLOCK) {
                const int mb = m - j < FP4_BLOCK ? (int)(m - j) : FP4_BLOCK;
                switch (mb) {
                    case 1: SFX(fp4_tile)(wr, gs, x + j * k, y + j * n + r, 1, n, k, group, table); break;
                    case 2: SFX(fp4_tile)(wr, gs, x + j * k, y + j * n + r, 2, n, k, group, table); break;
                    case 3: SFX(fp4_tile)(wr, gs, x + j * k, y + j * n + r, 3, n, k, group, table); break;
                    default: SFX(fp4_tile)(wr, gs, x + j * k, y + j * n + r, 4, n, k, group, table); break;
                }
            }
        }
        free(gs);
    }
}

/* Inside a parallel region: this thread's share of the rows of y [n] = alpha (W x) (+ y when add) for one float32 row
 * x, W the FP4 matrix w with its FP4 table (mla_cpu.h, FP4_FIELDS): each row's scales decoded and its sum taken as
 * fp4_rows takes them, so the same bits. No barrier. */
V_TARGET static void SFX(fp4_share)(const uint8_t *w, const int64_t *fp4, const float *x, float *y, float alpha,
                                    int add) {
    const int64_t kind = fp4[0], n = fp4[1], k = fp4[2], group = fp4_group(kind), groups = k / group;
    const uint8_t *scales = (const uint8_t *)(intptr_t)fp4[3];
    const float *global = (const float *)(intptr_t)fp4[4];
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    float gs[groups], out;
    for (int64_t r = n * t / nt; r < n * (t + 1) / nt; r++) {
        fp4_scales(kind, scales + r * groups, global ? global[r] : 1.0f, gs, groups);
        SFX(fp4_tile)(w + r * (k / 2), gs, x, &out, 1, n, k, group, table);
        y[r] = alpha * out + (add ? y[r] : 0.0f);
    }
}

#undef FP4_BLOCK
