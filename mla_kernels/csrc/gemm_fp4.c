/* Products of float32 rows with FP4 E2M1 weights (mla_kernels/fp4_format.py), for x86-64: MXFP4 (a UE8M0 scale, a
 * power of two, per 32 values of a row) and NVFP4 (an FP8 E4M3 scale per 16 values of a row, divided by the row's
 * float32 global scale). The weight stays at half a byte a value plus its stored scales; the kernel (fp4_rows.h, once
 * per instruction set: AVX2 and AVX-512) widens the nibbles with a table in a register. The two variants sum in
 * their own order (8 or 16 lanes), so they agree to float rounding. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "mla_cpu.h"
#include "simd.h"

static int64_t fp4_group(int64_t kind) { return kind == FP4_MX ? 32 : 16; }

/* an FP8 E4M3 (fn) byte as float32, exactly */
static float e4m3_value(uint8_t b) {
    const int e = (b >> 3) & 15, man = b & 7;
    if (e == 15 && man == 7) return NAN;
    const float v = e == 0 ? ldexpf((float)man, -9) : ldexpf((float)(8 + man), e - 10);
    return b & 0x80 ? -v : v;
}

/* half of each group's scale: MX 2^(e - 127) (255: NaN), NV e4m3 / global (one float32 division) */
static void fp4_scales(int64_t kind, const uint8_t *s, float global, float *out, int64_t groups) {
    for (int64_t g = 0; g < groups; g++) {
        const float v = kind == FP4_MX ? (s[g] == 255 ? NAN : ldexpf(1.0f, (int)s[g] - 127)) : e4m3_value(s[g]) / global;
        out[g] = 0.5f * v;
    }
}

/* 8 (16) nibbles from 4 (8) bytes, in value order, looked up in the doubled-value table t, as floats */
static inline __m128i e2m1_bytes(__m128i v, __m128i t) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    return _mm_shuffle_epi8(t, _mm_unpacklo_epi8(lo, hi));
}

static inline __m256 e2m1_8(const uint8_t *p, __m128i t) {
    int32_t b;
    memcpy(&b, p, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e2m1_bytes(_mm_cvtsi32_si128(b), t)));
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
static inline __m512 e2m1_16(const uint8_t *p, __m128i t) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e2m1_bytes(_mm_loadl_epi64((const __m128i *)p), t)));
}

#include "vec_avx2.h"
#include "fp4_rows.h"
#include "vec_end.h"
#include "vec_avx512.h"
#include "fp4_rows.h"
#include "vec_end.h"

void mla_gemm_fp4(int64_t kind, const uint8_t *w, const uint8_t *scales, const float *global, const float *x,
                  float *y, int64_t m, int64_t n, int64_t k, int64_t threads, int64_t variant) {
    const int wide = variant < 0 ? (int)(mla_float_variants() >> 1 & 1) : variant == 1;
    (wide ? fp4_rows_avx512 : fp4_rows_avx2)(kind, w, scales, global, x, y, m, n, k, threads);
}

/* Inside a parallel region: this thread's share of the rows of y [n] = alpha (W x) (+ y when add) for one float32 row
 * x, W the nibbles w with their FP4 table (mla_cpu.h); the same bits as mla_gemm_fp4's row in that variant. No
 * barrier. */
void mla_fp4_share(int64_t variant, const uint8_t *w, const int64_t *fp4, const float *x, float *y, float alpha,
                   int add) {
    (variant == 1 ? fp4_share_avx512 : fp4_share_avx2)(w, fp4, x, y, alpha, add);
}
