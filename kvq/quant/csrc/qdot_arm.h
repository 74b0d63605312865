/* The arm64 paths of qdot.c, included by it after the scalar dots (qdot_neon.h once per
 * extension):
 *   ISA_NEON     Advanced SIMD, which every arm64 CPU has: smull + saddlp for the products;
 *   ISA_DOTPROD  the dot-product extension (Armv8.2 FEAT_DotProd, HWCAP_ASIMDDP): sdot;
 *   ISA_I8MM     sdot, and smmla for calls of several rows (FEAT_I8MM, HWCAP2_I8MM: qdot_i8mm.h).
 * All are compiled into every arm64 build (the extensions through target attributes) and chosen at
 * run time from the kernel's hardware capabilities (Linux: getauxval; macOS: the
 * hw.optional.arm.FEAT_* sysctls), never assumed from the build machine. Same bits as the
 * scalar path: see qdot_neon.h. */

#include <arm_neon.h>
#define QDOT_ARM 1
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
/* Whether this compiler takes the extensions' intrinsics in a function built for them (a
 * target attribute): GCC 10 and later, clang 16 (Apple's 15) and later, or any compiler with
 * the whole file built for them. Otherwise only the NEON path is built. */
#if defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8)
#define QDOT_ARM_EXT 1
#elif defined(__clang__)
#if defined(__apple_build_version__) ? __clang_major__ >= 15 : __clang_major__ >= 16
#define QDOT_ARM_EXT 1
#endif
#elif defined(__GNUC__) && __GNUC__ >= 10
#define QDOT_ARM_EXT 1
#endif
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

#ifdef QDOT_ARM_EXT
#define TGT __attribute__((target("arch=armv8.2-a+dotprod")))
#define SFX(name) name##_dot
#define DOT4(acc, a, b) vdotq_s32((acc), (a), (b))
#include "qdot_neon.h"
#undef TGT
#undef SFX
#undef DOT4

#include "qdot_i8mm.h"
#else /* the _dot names, never picked (arm_best_isa stops at ISA_NEON) */
#define TGT
#define SFX(name) name##_dot
#define DOT4(acc, a, b) dot4_neon((acc), (a), (b))
#include "qdot_neon.h"
#undef TGT
#undef SFX
#undef DOT4
#endif

/* the best arm64 path this CPU has */
static int arm_best_isa(void) {
#ifndef QDOT_ARM_EXT
    return ISA_NEON;
#elif defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP);
    if (!(hw & HWCAP_ASIMD)) return ISA_SCALAR;
    if (!(hw & HWCAP_ASIMDDP)) return ISA_NEON;
    return (getauxval(AT_HWCAP2) & HWCAP2_I8MM) ? ISA_I8MM : ISA_DOTPROD;
#elif defined(__APPLE__)
    int dp = 0, mm = 0;
    size_t n = sizeof dp;
    if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &dp, &n, NULL, 0) != 0 || !dp) return ISA_NEON;
    n = sizeof mm;
    return sysctlbyname("hw.optional.arm.FEAT_I8MM", &mm, &n, NULL, 0) == 0 && mm ? ISA_I8MM : ISA_DOTPROD;
#else
    return ISA_NEON; /* Advanced SIMD is part of arm64; the extensions cannot be asked for here */
#endif
}
