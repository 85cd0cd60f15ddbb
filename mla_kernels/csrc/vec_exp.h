/* e^x lane by lane for x <= 0 at AVX2 (exp8) and AVX-512 (exp16): what V_EXP names in vec_avx2.h and
 * vec_avx512.h. Included once per library source that uses them (mla_decode_f32.c, ops/delta_rule.cpp), x86-64
 * only, after simd.h's <immintrin.h>. */
#ifndef MLA_VEC_EXP_H
#define MLA_VEC_EXP_H
#include <immintrin.h>

/* e^x for eight floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error below
 * 2e-7 on that range), times 2^n built in the exponent bits. Inputs below -87 give 0 (softmax only feeds x <= 0). */
#define EXP_BODY(V, SET1, FMA, FNMA, MUL)                                                                            \
    const V n = ROUND(MUL(x, SET1(1.44269504088896341f)));                                                          \
    V r = FNMA(n, SET1(0.693359375f), x); /* ln2 in two parts: exact n * hi */                                       \
    r = FNMA(n, SET1(-2.12194440e-4f), r);                                                                           \
    V p = SET1(1.0f / 5040);                                                                                         \
    p = FMA(p, r, SET1(1.0f / 720));                                                                                 \
    p = FMA(p, r, SET1(1.0f / 120));                                                                                 \
    p = FMA(p, r, SET1(1.0f / 24));                                                                                  \
    p = FMA(p, r, SET1(1.0f / 6));                                                                                   \
    p = FMA(p, r, SET1(0.5f));                                                                                       \
    p = FMA(p, r, SET1(1.0f));                                                                                       \
    p = FMA(p, r, SET1(1.0f));

#define ROUND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    EXP_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps)
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#undef ROUND

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define ROUND(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);  /* exp8's lanes that are not below -87 */
    x = _mm512_max_ps(x, lo);
    EXP_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps)
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}
#undef ROUND
#pragma GCC pop_options
#endif
