/* The gated delta rule over one head's state: the one-token update (delta_head) and a block of tokens in the chunked
 * (WY) form (wy_block, below). The one-token update, written once over the vector vocabulary (the float
 * names of vec_avx2.h) and included once per instruction set (ops/delta_rule.cpp: AVX2, AVX-512 and vec_scalar.h's
 * portable one). For state S [d_k, d_v] (row i: key channel i), decay e = exp(g) [d_k], q, k [d_k], v [d_v], beta:
 *
 *     kv = sum_i k_i (e_i S[i, :])                 pass 1, reading S
 *     u = beta (v - kv)
 *     S[i, :] = e_i S[i, :] + k_i u;  o = sum_i q_i S[i, :]   pass 2, reading and writing S
 *
 * the products of layers/delta_rule.recurrent_step in the same order per element (the decayed row, then the sums over
 * i in order of i), so the results differ from torch's only by its summation order. Each pass streams the state's
 * rows front to back; the d_v-wide sums live in scratch (kv, u, o: d_v floats each, in L1). */

V_TARGET static void SFX(delta_head)(float *S, const float *q, const float *k, const float *decay, const float *v,
                                     float beta, float *o, float *scratch, int64_t dk, int64_t dv) {
    float *kv = scratch, *u = scratch + dv;
    const int64_t vec = dv - dv % VL;
    for (int64_t j = 0; j < dv; ++j) kv[j] = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
        const float *row = S + i * dv;
        const V e = V_SET1(decay[i]), ki = V_SET1(k[i]);
        int64_t j = 0;
        for (; j < vec; j += VL) V_STORE(kv + j, V_FMA(ki, V_MUL(V_LOAD(row + j), e), V_LOAD(kv + j)));
        for (; j < dv; ++j) kv[j] = fmaf(k[i], row[j] * decay[i], kv[j]);
    }
    for (int64_t j = 0; j < dv; ++j) {
        u[j] = (v[j] - kv[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; ++i) {
        float *row = S + i * dv;
        const V e = V_SET1(decay[i]), ki = V_SET1(k[i]), qi = V_SET1(q[i]);
        int64_t j = 0;
        for (; j < vec; j += VL) {
            const V s = V_FMA(ki, V_LOAD(u + j), V_MUL(V_LOAD(row + j), e));
            V_STORE(row + j, s);
            V_STORE(o + j, V_FMA(qi, s, V_LOAD(o + j)));
        }
        for (; j < dv; ++j) {
            row[j] = fmaf(k[i], u[j], row[j] * decay[i]);
            o[j] = fmaf(q[i], row[j], o[j]);
        }
    }
}

/* The chunked (WY) form of layers/delta_rule.chunked: one block of c tokens of one head (WyBlock, ops/delta_rule.cpp:
 * the block's q, k, g copied into zero-padded rows, the state S padded to [dkp, dvp]). With G_t the running sum of
 * the block's gates (per key channel) and D_ts = exp(G_t - G_s):
 *
 *     gates   kd_t = k_t exp(G_t), qd_t = q_t exp(G_t), kl_s = k_s exp(G_c - G_s), egc = exp(G_c)
 *     pairs   A_ts = sum_i k_ti D_ts,i k_si (s < t), B_ts = sum_i q_ti D_ts,i k_si (s <= t): the keys k_s decayed
 *             token by token (D_ts = the product of exp(g_r), s < r <= t), so no exp of a difference per pair
 *     start   U = beta (V - kd S), O = qd S                  one pass over S for both products
 *     solve   U_t -= beta_t sum_{s<t} A_ts U_s (forward substitution of the unit-lower-triangular system, row by
 *             row), then O_t += sum_{s<=t} B_ts U_s
 *     state   S = egc * S + kl^T U
 *
 * The products over the state take tiles of WY_ROWS rows and WY_COLS vectors of columns in registers; the padding
 * (rows to a multiple of 4, key channels to 16, state columns to 32) keeps every loop whole and adds zeros only. */

#define WY_ROWS (VL >= 16 ? 4 : 2)  // a tile's rows: its accumulators fit the registers (32 zmm, 16 ymm)
#define WY_COLS (VL > 1 ? 2 : 32)   // a tile's vectors of columns (one lane: 32, for the compiler to vectorize)

V_TARGET static void SFX(wy_gates)(const WyBlock &w) {
    for (int64_t i = 0; i < w.dkp; i += VL) {
        V G = V_ZERO();
        for (int64_t t = 0; t < w.cr; ++t) {
            const V g = V_LOAD(w.gs + t * w.dkp + i);
            G = V_ADD(G, g);
            V_STORE(w.kd + t * w.dkp + i, G);  // G_t until the pass below
            V_STORE(w.e + t * w.dkp + i, V_EXP(g));
        }
        V_STORE(w.egc + i, V_EXP(G));
        for (int64_t t = 0; t < w.cr; ++t) {
            const int64_t at = t * w.dkp + i;
            const V Gt = V_LOAD(w.kd + at), kt = V_LOAD(w.ks + at), grown = V_EXP(Gt);
            V_STORE(w.kd + at, V_MUL(kt, grown));
            V_STORE(w.qd + at, V_MUL(V_LOAD(w.qs + at), grown));
            V_STORE(w.kl + at, V_MUL(kt, V_EXP(V_SUB(G, Gt))));
        }
    }
}

/* A and B ([cr, cw], zeroed by the caller), the keys decayed in wt [dkp, cw] (zeroed; column s: key s), two vectors of
 * columns a pass over the key channels. */
V_TARGET static void SFX(wy_pairs)(const WyBlock &w) {
    for (int64_t t = 0; t < w.c; ++t) {
        const float *e = w.e + t * w.dkp, *kt = w.ks + t * w.dkp, *qt = w.qs + t * w.dkp;
        for (int64_t i = 0; VL == 1 && i < w.dkp; ++i) {  // one lane: rows of columns, for the compiler to vectorize
            float *col = w.wt + i * w.cw, *a = w.a + t * w.cw, *b = w.b + t * w.cw;
            for (int64_t s = 0; s < t; ++s) {
                col[s] *= e[i];
                a[s] = fmaf(kt[i], col[s], a[s]);
                b[s] = fmaf(qt[i], col[s], b[s]);
            }
        }
        for (int64_t s = 0; VL > 1 && s < t; s += 2 * VL) {  // the columns s < t (the later ones are still zero)
            const bool two = s + VL < t;
            V a0 = V_ZERO(), b0 = V_ZERO(), a1 = V_ZERO(), b1 = V_ZERO();
            for (int64_t i = 0; i < w.dkp; ++i) {
                float *col = w.wt + i * w.cw + s;
                const V ei = V_SET1(e[i]), ki = V_SET1(kt[i]), qi = V_SET1(qt[i]);
                const V d0 = V_MUL(V_LOAD(col), ei);
                V_STORE(col, d0);
                a0 = V_FMA(ki, d0, a0);
                b0 = V_FMA(qi, d0, b0);
                if (two) {
                    const V d1 = V_MUL(V_LOAD(col + VL), ei);
                    V_STORE(col + VL, d1);
                    a1 = V_FMA(ki, d1, a1);
                    b1 = V_FMA(qi, d1, b1);
                }
            }
            V_STORE(w.a + t * w.cw + s, a0);
            V_STORE(w.b + t * w.cw + s, b0);
            if (two) {
                V_STORE(w.a + t * w.cw + s + VL, a1);
                V_STORE(w.b + t * w.cw + s + VL, b1);
            }
        }
        float own = 0.0f;
        for (int64_t i = 0; i < w.dkp; ++i) {
            own = fmaf(qt[i], kt[i], own);
            w.wt[i * w.cw + t] = kt[i];
        }
        w.b[t * w.cw + t] = own;
    }
}

/* U = kd S and O = qd S over tiles of rows (tokens) and WY_COLS vectors of columns; then U = beta (V - U) on the real
 * rows. */
V_TARGET static void SFX(wy_start)(const WyBlock &w) {
    constexpr int R = WY_ROWS, N = WY_COLS;
    for (int64_t j = 0; j < w.dvp; j += N * VL) {
        for (int64_t t = 0; t < w.cr; t += R) {
            V u[R][N], o[R][N];
            for (int r = 0; r < R; ++r)
                for (int n = 0; n < N; ++n) u[r][n] = o[r][n] = V_ZERO();
            for (int64_t i = 0; i < w.dkp; ++i) {
                const float *row = w.S + i * w.dvp + j;
                for (int r = 0; r < R; ++r) {
                    const V kb = V_SET1(w.kd[(t + r) * w.dkp + i]), qb = V_SET1(w.qd[(t + r) * w.dkp + i]);
                    for (int n = 0; n < N; ++n) {
                        u[r][n] = V_FMA(kb, V_LOAD(row + n * VL), u[r][n]);
                        o[r][n] = V_FMA(qb, V_LOAD(row + n * VL), o[r][n]);
                    }
                }
            }
            for (int r = 0; r < R; ++r)
                for (int n = 0; n < N; ++n) {
                    V_STORE(w.u + (t + r) * w.dvp + j + n * VL, u[r][n]);
                    V_STORE(w.o + (t + r) * w.dvp + j + n * VL, o[r][n]);
                }
        }
    }
    for (int64_t t = 0; t < w.c; ++t) {
        float *u = w.u + t * w.dvp;
        const float *v = w.v + t * w.v_stride, beta = w.beta[t * w.beta_stride];
        for (int64_t j = 0; j < w.dv; ++j) u[j] = (v[j] - u[j]) * beta;
    }
}

/* The deltas U by forward substitution and the outputs O_t += sum_{s<=t} B_ts U_s, row after row. */
V_TARGET static void SFX(wy_solve)(const WyBlock &w) {
    for (int64_t t = 0; t < w.c; ++t) {
        const float beta = w.beta[t * w.beta_stride], *a = w.a + t * w.cw, *b = w.b + t * w.cw;
        float *ut = w.u + t * w.dvp, *ot = w.o + t * w.dvp;
        for (int64_t s = 0; VL == 1 && s <= t; ++s) {  // one lane: whole rows, for the compiler to vectorize
            const float *us = w.u + s * w.dvp, coef = s < t ? -beta * a[s] : 0.0f;
            for (int64_t j = 0; s < t && j < w.dvp; ++j) ut[j] = fmaf(coef, us[j], ut[j]);
            for (int64_t j = 0; j < w.dvp; ++j) ot[j] = fmaf(b[s], us[j], ot[j]);
        }
        for (int64_t j = 0; VL > 1 && j < w.dvp; j += VL) {
            V u = V_LOAD(w.u + t * w.dvp + j);
            for (int64_t s = 0; s < t; ++s) u = V_FMA(V_SET1(-beta * a[s]), V_LOAD(w.u + s * w.dvp + j), u);
            V_STORE(w.u + t * w.dvp + j, u);
            V o = V_LOAD(w.o + t * w.dvp + j);
            for (int64_t s = 0; s <= t; ++s) o = V_FMA(V_SET1(b[s]), V_LOAD(w.u + s * w.dvp + j), o);
            V_STORE(w.o + t * w.dvp + j, o);
        }
    }
}

/* S = egc * S + kl^T U over tiles of rows (key channels) and WY_COLS vectors of columns. */
V_TARGET static void SFX(wy_state)(const WyBlock &w) {
    constexpr int R = WY_ROWS, N = WY_COLS;
    for (int64_t i = 0; i < w.dkp; i += R) {
        for (int64_t j = 0; j < w.dvp; j += N * VL) {
            V acc[R][N];
            for (int r = 0; r < R; ++r) {
                const V e = V_SET1(w.egc[i + r]);
                for (int n = 0; n < N; ++n) acc[r][n] = V_MUL(V_LOAD(w.S + (i + r) * w.dvp + j + n * VL), e);
            }
            for (int64_t s = 0; s < w.c; ++s) {
                const float *u = w.u + s * w.dvp + j;
                for (int r = 0; r < R; ++r) {
                    const V kb = V_SET1(w.kl[s * w.dkp + i + r]);
                    for (int n = 0; n < N; ++n) acc[r][n] = V_FMA(kb, V_LOAD(u + n * VL), acc[r][n]);
                }
            }
            for (int r = 0; r < R; ++r)
                for (int n = 0; n < N; ++n) V_STORE(w.S + (i + r) * w.dvp + j + n * VL, acc[r][n]);
        }
    }
}

/* One block: its outputs in w.o (rows < c, columns < dv), the state after it in w.S. */
V_TARGET static void SFX(wy_block)(const WyBlock &w) {
    SFX(wy_gates)(w);
    SFX(wy_pairs)(w);
    SFX(wy_start)(w);
    SFX(wy_solve)(w);
    SFX(wy_state)(w);
}

#undef WY_ROWS
#undef WY_COLS
