/* The arm64 paths of qdot.c, included by it after the scalar dots (qdot_neon.h once per
 * extension):
 *   ISA_NEON     Advanced SIMD, which every arm64 CPU has: smull + saddlp for the products;
 *   ISA_DOTPROD  the dot-product extension (Armv8.2 FEAT_DotProd, HWCAP_ASIMDDP): sdot;
 *   ISA_I8MM     sdot, and smmla for calls of several rows (FEAT_I8MM, HWCAP2_I8MM: qdot_i8mm.h).
 * All are compiled into every arm64 build (the extensions through target attributes) and chosen at
 * run time from the kernel's hardware capabilities (getauxval), never assumed from the build
 * machine. Same bits as the scalar path: see qdot_neon.h. */

#include <arm_neon.h>
#include <sys/auxv.h>
#define QDOT_ARM 1
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif

/* quantize with 4 lanes: the same products x * iscale, rounded to nearest even by fcvtns as
 * lrintf does, so the same d and q (fmax keeps a NaN, as quantize's amax does) */
static float quantize_neon(const float *x, int n, int8_t *q) {
    float32x4_t amax = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 4) amax = vmaxq_f32(amax, vabsq_f32(vld1q_f32(x + i)));
    const float mx = vmaxvq_f32(amax);
    if (!(mx <= 3.4028235e38f)) {
        memset(q, 0, (size_t)n);
        return NAN;
    }
    if (mx == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    const float32x4_t is = vdupq_n_f32(127.0f / mx);
    const int32x4_t hi = vdupq_n_s32(127), lo = vdupq_n_s32(-127);
    for (int i = 0; i < n; i += 16) {
        int16x4_t h[4];
        for (int j = 0; j < 4; j++) {
            const int32x4_t v = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x + i + 4 * j), is));
            h[j] = vmovn_s32(vmaxq_s32(lo, vminq_s32(hi, v)));
        }
        vst1q_s8(q + i, vcombine_s8(vmovn_s16(vcombine_s16(h[0], h[1])), vmovn_s16(vcombine_s16(h[2], h[3]))));
    }
    return mx / 127.0f;
}

/* sdot's lanes from Advanced SIMD alone: 16 int16 products (exact: |a b| <= 128 * 128), added
 * pairwise into int32 twice */
static inline int32x4_t dot4_neon(int32x4_t acc, int8x16_t a, int8x16_t b) {
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_high_s8(a, b);
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
}

#define TGT
#define SFX(name) name##_neon
#define DOT4(acc, a, b) dot4_neon((acc), (a), (b))
#include "qdot_neon.h"
#undef TGT
#undef SFX
#undef DOT4

#define TGT __attribute__((target("arch=armv8.2-a+dotprod")))
#define SFX(name) name##_dot
#define DOT4(acc, a, b) vdotq_s32((acc), (a), (b))
#include "qdot_neon.h"
#undef TGT
#undef SFX
#undef DOT4

#include "qdot_i8mm.h"

/* the best arm64 path this CPU has */
static int arm_best_isa(void) {
    const unsigned long hw = getauxval(AT_HWCAP);
    if (!(hw & HWCAP_ASIMD)) return ISA_SCALAR;
    if (!(hw & HWCAP_ASIMDDP)) return ISA_NEON;
    return (getauxval(AT_HWCAP2) & HWCAP2_I8MM) ? ISA_I8MM : ISA_DOTPROD;
}
