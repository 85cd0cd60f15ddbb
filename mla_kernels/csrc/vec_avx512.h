/* The vector vocabulary of AVX-512 (F, BW, VL, DQ; the integer kernels also VNNI): the names of vec_avx2.h, with 16
 * float lanes. An integer step is 32 int16 values, one vpdpwssd; VI_SUM adds lane l and lane l + 8 as integers (the
 * even and odd steps of AVX2's lane l) before the float conversion, so integer sums equal AVX2's. */
#define V __m512
#define VL 16
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_ZERO _mm512_setzero_ps
#define V_SET1 _mm512_set1_ps
#define V_FMA _mm512_fmadd_ps
#define V_MUL _mm512_mul_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_MAX _mm512_max_ps
#define V_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define V_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define V_FP8(p) _mm512_cvtph_ps(e4m3_half16(p))
#define V_HSUM _mm512_reduce_add_ps
#define V_HMAX _mm512_reduce_max_ps
#define V_EXP exp16
#define VI __m512i
#define VI_STEP 32
#define VI_W8(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define VI_X16(p) _mm512_loadu_si512((const void *)(p))
#define VI_DOT(a, w, x) _mm512_dpwssd_epi32(a, w, x)
#define VI_ZERO _mm512_setzero_si512
#define VI_SUM(a) hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1))))
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VI_AND _mm512_and_si512
#define VI_SRLI16 _mm512_srli_epi16
#define VI_SET1_8 _mm512_set1_epi8
#define VI_MULLO32 _mm512_mullo_epi32
#define VI_SRAI32 _mm512_srai_epi32
#define V_FROM_I32 _mm512_cvtepi32_ps
#define VI_DOT_U8(a, u0, s0, u1, s1) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a, u0, s0), u1, s1)
#define QUARTER_LANES(h) _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)  /* h: 0, the only part */
#define V_QUARTERS(f4, h) _mm512_permutexvar_ps(QUARTER_LANES(h), _mm512_castps128_ps512(f4))
#define VI_QUARTERS(i4, h) _mm512_permutexvar_epi32(QUARTER_LANES(h), _mm512_castsi128_si512(i4))
#define V_HSUM8(v) hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))))
#define V_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define VI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define SFX(name) name##_avx512
