/* The gated delta rule's one-token update of one head's state, written once over the vector vocabulary (the float
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
