/* The vector vocabulary of AVX2 (with FMA and F16C: the build's baseline). A kernel is written once over these names
 * (decode_attention.h, few_rows.h) and included once per instruction set, after this header or vec_avx512.h, and
 * before vec_end.h, which undefines them again:
 *
 *     V, VL                        the float vector and its lanes
 *     V_LOAD, V_STORE, V_ZERO, V_SET1, V_FMA, V_MUL, V_ADD, V_SUB, V_MAX   the usual operations
 *     V_BF16(p), V_F16(p)          VL bfloat16 / float16 values from p, widened to float32 (exactly)
 *     V_I8(p), V_FP8(p)            VL int8 values as floats; VL float8_e4m3fn values as floats / 2^8 (exactly; the
 *                                  including file defines e4m3_half8/16)
 *     V_E2M1(p, t)                 VL FP4 E2M1 values from the VL / 2 bytes at p (value 2i in byte i's low nibble),
 *                                  doubled, as floats (exactly; t: the 16 doubled values as int8 in an __m128i; the
 *                                  including file defines e2m1_8/16)
 *     V_HSUM(v), V_HMAX(v)         the sum and the largest of the lanes
 *     V_EXP(v)                     e^v lane by lane (for v <= 0: exp8 / exp16 of vec_exp.h, included first)
 *     VI, VI_STEP                  the integer vector, and the int16 values one step of a dot product takes
 *     VI_W8(p), VI_X16(p)          VI_STEP int8 values from p as int16; VI_STEP int16 values from p
 *     VI_DOT(a, w, x)              a plus the products w x summed in pairs (int32 lanes)
 *     VI_ZERO(), VI_SUM(a)         a zero vector; the sum of a's int32 lanes as a float
 *     VI_LOAD(p)                   VL int32 lanes (4 VL bytes) from p
 *     VI_AND, VI_SRLI16, VI_SET1_8, VI_MULLO32, VI_SRAI32, VI_SUB32, VI_SLLI32   bytes and int32 lanes
 *     VI_FLOAT(a)                  int32 lanes as floats
 *     VI_DOT_U8(a, u, s)           a plus, in each int32 lane, its four unsigned bytes of u times the signed bytes of s
 *                                  (AVX2 sums pairs in int16 first: the kernels keep u <= 128)
 *     VI_DOT_U8X2(a, u0, s0, u1, s1)   the same for two pairs (AVX2: their int16 pair sums added before widening, exact
 *                                  where u0 s0 + u1 s1 fits in int16, as 4-bit u does)
 *     VI_DOT_S8(a, w, s)           the same with signed bytes w (w = -128 included)
 *     V_QUARTERS(f4, h), VI_QUARTERS(i4, h)   the vector whose lane l holds value h VL / 4 + l / 4 of four floats
 *                                  (__m128) or four int32 (__m128i): a value per four lanes, part h of a 16-lane run
 *     V_HSUM8(v)                   the lanes' sum folded to eight lanes first (lane l plus lane l + 8), then in hsum's
 *                                  order: the same bits at either width for sums laid out as 16 lanes
 *     VI_ISUM(a)                   the sum of a's int32 lanes as an int32 (exact where it fits)
 *     V_TARGET, VI_TARGET          the function attribute of a float / an integer kernel at this instruction set
 *     SFX(name)                    name with the instruction set's suffix */
#define V __m256
#define VL 8
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_ZERO _mm256_setzero_ps
#define V_SET1 _mm256_set1_ps
#define V_FMA _mm256_fmadd_ps
#define V_MUL _mm256_mul_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_MAX _mm256_max_ps
#define V_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define V_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define V_FP8(p) _mm256_cvtph_ps(e4m3_half8(p))
#define V_E2M1 e2m1_8
#define V_HSUM hsum
#define V_HMAX hmax8
#define V_EXP exp8
#define VI __m256i
#define VI_STEP 16
#define VI_W8(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define VI_X16(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_DOT(a, w, x) _mm256_add_epi32(a, _mm256_madd_epi16(w, x))
#define VI_ZERO _mm256_setzero_si256
#define VI_SUM(a) hsum(_mm256_cvtepi32_ps(a))
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_AND _mm256_and_si256
#define VI_SRLI16 _mm256_srli_epi16
#define VI_SET1_8 _mm256_set1_epi8
#define VI_MULLO32 _mm256_mullo_epi32
#define VI_SRAI32 _mm256_srai_epi32
#define VI_SUB32 _mm256_sub_epi32
#define VI_SLLI32 _mm256_slli_epi32
#define VI_FLOAT _mm256_cvtepi32_ps
#define VI_DOT_U8(a, u, s) _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define VI_DOT_U8X2(a, u0, s0, u1, s1)                                                                               \
    _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)), \
                                          _mm256_set1_epi16(1)))
#define VI_DOT_S8(a, w, s) VI_DOT_U8(a, _mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w))
#define QUARTER_LANES(h) _mm256_setr_epi32(2 * (h), 2 * (h), 2 * (h), 2 * (h), 2 * (h) + 1, 2 * (h) + 1, 2 * (h) + 1, 2 * (h) + 1)
#define V_QUARTERS(f4, h) _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f4), QUARTER_LANES(h))
#define VI_QUARTERS(i4, h) _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(i4), QUARTER_LANES(h))
#define V_HSUM8 hsum
#define VI_ISUM(a) hsum_i32(a)
#define V_TARGET
#define VI_TARGET
#define SFX(name) name##_avx2
