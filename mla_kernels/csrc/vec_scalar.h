/* The float part of the vector vocabulary (vec_avx2.h) at one lane, for the portable variant of a kernel that uses
 * only these names (delta_rule.h): V is a float, the operations are C's, V_FMA a fused multiply-add (fmaf, one
 * rounding, as the vector ones), V_EXP C's expf. Any architecture; closed by vec_end.h as the others. */
#define V float
#define VL 1
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_ZERO() 0.0f
#define V_SET1(x) (x)
#define V_FMA(a, b, c) fmaf((a), (b), (c))
#define V_MUL(a, b) ((a) * (b))
#define V_ADD(a, b) ((a) + (b))
#define V_SUB(a, b) ((a) - (b))
#define V_EXP(a) expf(a)
#define V_TARGET
#define SFX(name) name##_generic
