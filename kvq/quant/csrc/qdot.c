/* y = x @ W.T with W in GGUF blocks and x quantized to 8 bits per block (kvq.quant.qdot).
 *
 * Written for kvq from the GGUF block layouts (gguf-py's quants.py, ggml's block_* structs).
 * The activations are quantized once per call, symmetric, round to nearest even:
 *   K-quants (Q4_K, Q5_K, Q6_K): per 256 values, d = amax / 127, q = rint(x / d), plus the
 *     sums of q over each run of 16 (the weights' per-sub-block mins and offsets need them);
 *   Q8_0, Q4_0, MXFP4: per 32 values, the same with the sum of the 32 q.
 * A block's dot product is then integers only: sum(qw * qx) per sub-block, times the
 * sub-block's integer scale, exact in int32. Only the per-block combination
 * `acc += dx * (dw * isum - dmin * imin)` is float32, in the same order in every path, so the
 * scalar, AVX2, AVX512-VNNI and AMX paths, and arm64's NEON, sdot and i8mm ones (qdot_arm.h),
 * give the same bits, and each output is computed by one thread: results depend neither on the
 * CPU's features nor on the thread count.
 *
 * Build: cc -O3 -shared -fPIC -ffp-contract=off -fno-math-errno [-fopenmp] qdot.c, at install
 * (setup.py) or at first use (kvq/quant/qdot.py);
 * -fno-math-errno lets lrintf be one instruction.
 * -ffp-contract=off keeps a * b + c from becoming an FMA in one path and not in another.
 */
#define _DEFAULT_SOURCE /* syscall() in unistd.h under -std=c11 (AMX's permission) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 256 /* K-quant super-block */
#define Q0 32  /* Q8_0 / Q4_0 block */
#define RZ 8  /* weight rows per call of the one-row-of-x kernels (qdot_rows_z.h) */

/* ggml type ids */
enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_MXFP4 = 39 };

/* the 32-value block types (x0_t activations) */
static int is_q0(int qtype) {
    return qtype == T_Q8_0 || qtype == T_Q4_0 || qtype == T_Q5_0 || qtype == T_MXFP4;
}
/* bytes of one block of qtype */
static int64_t block_bytes(int qtype) {
    switch (qtype) {
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_Q8_0: return 34;
    case T_Q4_0: return 18;
    case T_Q5_0: return 22;
    default: return 17; /* MXFP4 */
    }
}

/* the paths: x86 ids, then arm64's (qdot_arm.h); a CPU has paths of one kind only */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_VNNI = 2, ISA_AVX512 = 3, ISA_AMX = 4 /* AVX-512 + AMX tiles */,
       ISA_NEON = 5, ISA_DOTPROD = 6 /* NEON + sdot */, ISA_I8MM = 7 /* + smmla */ };

typedef struct { /* 256 activations */
    float d;
    int16_t bsums[16]; /* sum of q over each run of 16 */
    int8_t q[QK];
} xk_t;

typedef struct { /* 32 activations */
    float d;
    int32_t sum;
    int8_t q[Q0];
} x0_t;

static float f16(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    float f;
    if (e == 0) {
        f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    memcpy(&f, &bits, 4);
    return f;
}

/* MXFP4 (OCP microscaling): one E8M0 scale byte, then 16 bytes of FP4 E2M1 nibbles (low:
 * values 0-15, high: 16-31). The values, doubled, are small integers; the scale is taken as
 * half of 2^(e - 127), as ggml's GGML_E8M0_TO_FP32_HALF (subnormal for e < 2), so each
 * block's dot product is integers times one float32 scale, like Q8_0's. */
static const int8_t kv_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* d and q of n values; non-finite input gives d = NaN, so every output it touches is NaN */
static float quantize(const float *x, int n, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = (a > amax || a != a) ? a : amax;
    }
    if (!(amax <= 3.4028235e38f)) {
        memset(q, 0, (size_t)n);
        return NAN;
    }
    if (amax == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = 127.0f / amax;
    for (int i = 0; i < n; i++) {
        long v = lrintf(x[i] * iscale);
        q[i] = (int8_t)(v > 127 ? 127 : (v < -127 ? -127 : v));
    }
    return amax / 127.0f;
}

/* quantize's form on path isa (the SIMD one where there is one: the same bits) */
typedef float (*quantize_fn)(const float *, int, int8_t *);
static quantize_fn pick_quantize(int isa);

static void quantize_k(int isa, const float *x, int64_t k, xk_t *out) {
    const quantize_fn qf = pick_quantize(isa);
    for (int64_t b = 0; b < k / QK; b++) {
        xk_t *o = &out[b];
        o->d = qf(x + b * QK, QK, o->q);
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int i = 0; i < 16; i++) t += o->q[16 * s + i];
            o->bsums[s] = (int16_t)t;
        }
    }
}

static void quantize_0(int isa, const float *x, int64_t k, x0_t *out) {
    const quantize_fn qf = pick_quantize(isa);
    for (int64_t b = 0; b < k / Q0; b++) {
        x0_t *o = &out[b];
        o->d = qf(x + b * Q0, Q0, o->q);
        int t = 0;
        for (int i = 0; i < Q0; i++) t += o->q[i];
        o->sum = t;
    }
}

/* ggml's 6-bit scale and min of sub-block j, packed in 12 bytes */
static void scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* the float part, shared by every path (same operations, same order) */
static inline float combine_k(float acc, float dx, float d, float dmin, int32_t isum, int32_t imin) {
    return acc + dx * (d * (float)isum - dmin * (float)imin);
}

static inline float combine_0(float acc, float dx, float d, int32_t isum) {
    return acc + (dx * d) * (float)isum;
}

/* sum over sub-blocks of the Q4_K / Q5_K minimums times the activations' sums */
static int32_t kmins(const uint8_t *scales, const xk_t *x, int *sc) {
    int32_t imin = 0;
    for (int j = 0; j < 8; j++) {
        int m;
        scale_min(scales, j, &sc[j], &m);
        imin += m * (x->bsums[2 * j] + x->bsums[2 * j + 1]);
    }
    return imin;
}

/* ---- scalar reference path ---------------------------------------------------------- */

/* Q4_K and Q5_K share their layout but for Q5_K's 32 bytes of fifth bits (`qh`) before the
   nibbles: `five` adds them */
static float dot_q45_k_scalar(const uint8_t *w, const xk_t *x, int64_t nb, int five) {
    float acc = 0.0f;
    const int64_t size = five ? 176 : 144;
    for (int64_t b = 0; b < nb; b++, w += size, x++) {
        int sc[8];
        int32_t imin = kmins(w + 4, x, sc), isum = 0;
        const uint8_t *qh = w + 16, *qs = five ? w + 48 : w + 16;
        for (int c = 0; c < 4; c++) {
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < 32; i++) {
                int l = qs[32 * c + i] & 15, h = qs[32 * c + i] >> 4;
                if (five) {
                    l |= ((qh[i] >> (2 * c)) & 1) << 4;
                    h |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
                }
                lo += l * x->q[64 * c + i];
                hi += h * x->q[64 * c + 32 + i];
            }
            isum += sc[2 * c] * lo + sc[2 * c + 1] * hi;
        }
        acc = combine_k(acc, x->d, f16(w), f16(w + 2), isum, imin);
    }
    return acc;
}

static float dot_q4_k_scalar(const uint8_t *w, const xk_t *x, int64_t nb) {
    return dot_q45_k_scalar(w, x, nb, 0);
}

static float dot_q5_k_scalar(const uint8_t *w, const xk_t *x, int64_t nb) {
    return dot_q45_k_scalar(w, x, nb, 1);
}

/* Q6_K: ql[128], qh[64], int8 scales[16], d. Value 16t + i (sub-block t) is
 * q - 32 with q 6 bits; isum = sum_t scale_t * (sum q * qx - 32 * bsum_t). */
static int32_t q6_offset(const int8_t *sc, const xk_t *x) {
    int32_t off = 0;
    for (int t = 0; t < 16; t++) off += sc[t] * x->bsums[t];
    return 32 * off;
}

static float dot_q6_k_scalar(const uint8_t *w, const xk_t *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 210, x++) {
        const int8_t *sc = (const int8_t *)(w + 192);
        int32_t isum = 0;
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
            const int8_t *xq = x->q + 128 * half;
            const int8_t *s = sc + 8 * half;
            int32_t t[8] = {0};
            for (int l = 0; l < 32; l++) {
                int g = l / 16;
                t[0 + g] += ((ql[l] & 15) | ((qh[l] & 3) << 4)) * xq[l];
                t[2 + g] += ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) * xq[l + 32];
                t[4 + g] += ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) * xq[l + 64];
                t[6 + g] += ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) * xq[l + 96];
            }
            for (int j = 0; j < 8; j++) isum += s[j] * t[j];
        }
        isum -= q6_offset(sc, x);
        acc = combine_k(acc, x->d, f16(w + 208), 0.0f, isum, 0);
    }
    return acc;
}

static float dot_q8_0_scalar(const uint8_t *w, const x0_t *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 34, x++) {
        const int8_t *q = (const int8_t *)(w + 2);
        int32_t isum = 0;
        for (int i = 0; i < 32; i++) isum += q[i] * x->q[i];
        acc = combine_0(acc, x->d, f16(w), isum);
    }
    return acc;
}

static float dot_q4_0_scalar(const uint8_t *w, const x0_t *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 18, x++) {
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) {
            isum += (w[2 + i] & 15) * x->q[i] + (w[2 + i] >> 4) * x->q[16 + i];
        }
        acc = combine_0(acc, x->d, f16(w), isum - 8 * x->sum);
    }
    return acc;
}

/* Q5_0: per 32 values d, 32 fifth bits (qh, little-endian), 16 bytes of nibble pairs; the
 * value of element i is d * ((nibble | bit_i << 4) - 16) */
static float dot_q5_0_scalar(const uint8_t *w, const x0_t *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 22, x++) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) {
            int lo = (w[6 + i] & 15) | (int)(((qh >> i) & 1) << 4);
            int hi = (w[6 + i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
            isum += lo * x->q[i] + hi * x->q[16 + i];
        }
        acc = combine_0(acc, x->d, f16(w), isum - 16 * x->sum);
    }
    return acc;
}

static float dot_mxfp4_scalar(const uint8_t *w, const x0_t *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 17, x++) {
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) {
            isum += kv_mxfp4[w[1 + i] & 15] * x->q[i] + kv_mxfp4[w[1 + i] >> 4] * x->q[16 + i];
        }
        acc = combine_0(acc, x->d, e8m0_half(w[0]), isum);
    }
    return acc;
}

#include "qdot_multi.h"

/* ---- SIMD paths: the same integers, from vpmaddubsw (AVX2) or vpdpbusd (VNNI) --------- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define QDOT_X86 1

/* the weights stream from RAM, mapped in 4 KiB pages, where the hardware prefetcher stops at
 * each page boundary: ask for the bytes PF ahead of the block being read */
#define PF 1536
#define PREFETCH(p)                                                            \
    do {                                                                       \
        _mm_prefetch((const char *)(p) + PF, _MM_HINT_T0);                     \
        _mm_prefetch((const char *)(p) + PF + 64, _MM_HINT_T0);                \
        _mm_prefetch((const char *)(p) + PF + 128, _MM_HINT_T0);               \
        _mm_prefetch((const char *)(p) + PF + 192, _MM_HINT_T0);               \
    } while (0)

#define TGT __attribute__((target("avx2,fma,f16c")))

/* quantize with 8 lanes: the same products x * iscale, rounded to nearest even by vcvtps2dq as
 * lrintf does, so the same d and q */
static TGT float quantize_avx2(const float *x, int n, int8_t *q) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 big = _mm256_set1_ps(3.4028235e38f);
    __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ)); /* infinite or NaN */
        amax = _mm256_max_ps(amax, a);
    }
    if (_mm256_movemask_ps(bad)) {
        memset(q, 0, (size_t)n);
        return NAN;
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0x4e));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0xb1));
    const float mx = _mm_cvtss_f32(m);
    if (mx == 0.0f) {
        memset(q, 0, (size_t)n);
        return 0.0f;
    }
    const __m256 is = _mm256_set1_ps(127.0f / mx);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < n; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(
                _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), is))));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(void *)(q + i), _mm256_permutevar8x32_epi32(p, order));
    }
    return mx / 127.0f;
}

#define F16(p) _cvtsh_ss((unsigned short)((p)[0] | ((p)[1] << 8)))
#define SFX(name) name##_avx2
#define MUL_SUM(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#define DPW(acc, p, sc) _mm256_add_epi32((acc), _mm256_madd_epi16((p), (sc)))
#include "qdot_simd.h"
#undef TGT
#undef SFX
#undef MUL_SUM
#undef DPW

#define TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define SFX(name) name##_vnni
#define MUL_SUM(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#define DPW(acc, p, sc) _mm256_dpwssd_epi32((acc), (p), (sc))
#include "qdot_simd.h"
#undef TGT
#undef SFX
#undef MUL_SUM
#undef DPW
#undef F16

/* 512-bit Q6_K (AVX512BW + VNNI): two 32-value groups per instruction, 1.2-1.5x the 256-bit path.
 * 512-bit Q4_K (qdot_q4k_z.h): its activations are stored in the order its loads pair them
 * (gathering them from two places per load made it 1.4x slower than the 256-bit path). */
#define TGTZ __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
/* AMX int8 tiles (GCC 11+: amxtileintrin.h); without them ISA_AMX is never the best */
#if defined(__has_include) && !defined(__clang__)
#if __has_include(<amxtileintrin.h>) && __has_include(<amxint8intrin.h>)
#define QDOT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#ifdef QDOT_AMX
#define TGTA __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#else
#define TGTA TGTZ
#endif
#define F16Z(p) _cvtsh_ss((unsigned short)((p)[0] | ((p)[1] << 8)))
#define LDY(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define LDZ(p) _mm512_loadu_si512((const void *)(p))
#define PAIR(a, b) _mm512_inserti64x4(_mm512_castsi256_si512(a), (b), 1)

static TGTZ float dot_q6_k_z(const uint8_t *w, const xk_t *x, int64_t nb) {
    const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
    /* int16 lane j of a 64-value group takes the scale of its 16-value sub-block, j / 8 */
    const __m512i lo_idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                            1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i four = _mm512_set1_epi16(4), eight = _mm512_set1_epi16(8);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 210, x++) {
        PREFETCH(w);
        const int8_t *sc = (const int8_t *)(w + 192);
        const __m512i sc16 = _mm512_castsi256_si512(
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)sc)));
        __m512i s = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            const __m512i ql = LDZ(w + 64 * half);
            const __m256i qh = LDY(w + 128 + 32 * half);
            const __m512i h01 = PAIR(qh, _mm256_srli_epi16(qh, 2));
            const __m512i h23 = PAIR(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6));
            const __m512i q12 = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                                _mm512_slli_epi16(_mm512_and_si512(h01, m3), 4));
            const __m512i q34 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                                _mm512_slli_epi16(_mm512_and_si512(h23, m3), 4));
            const __m512i base = half ? eight : _mm512_setzero_si512();
            const __m512i s12 = _mm512_permutexvar_epi16(_mm512_add_epi16(lo_idx, base), sc16);
            const __m512i s34 = _mm512_permutexvar_epi16(
                _mm512_add_epi16(_mm512_add_epi16(lo_idx, base), four), sc16);
            const int8_t *xq = x->q + 128 * half;
            s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q12, LDZ(xq)), s12);
            s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q34, LDZ(xq + 64)), s34);
        }
        int32_t isum = _mm512_reduce_add_epi32(s) - q6_offset(sc, x);
        acc = combine_k(acc, x->d, F16Z(w + 208), 0.0f, isum, 0);
    }
    return acc;
}

/* dot_q6_k_z on nx <= MX rows (qdot_simd_multi.h) */
static TGTZ void mdot_q6_k_z(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
    const __m512i lo_idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                            1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i four = _mm512_set1_epi16(4), eight = _mm512_set1_epi16(8);
    __m256i is[8];
    for (int j = nx; j < 8; j++) is[j] = _mm256_setzero_si256();
    float dx[8] = {0};
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        PREFETCH(w);
        const int8_t *sc = (const int8_t *)(w + 192);
        const __m256i sc8 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)sc));
        const __m512i sc16 = _mm512_castsi256_si512(sc8);
        __m512i q[4], s16[4]; /* x's q[64i .. 64i + 63]: values and scales */
        for (int half = 0; half < 2; half++) {
            const __m512i ql = LDZ(w + 64 * half);
            const __m256i qh = LDY(w + 128 + 32 * half);
            const __m512i h01 = PAIR(qh, _mm256_srli_epi16(qh, 2));
            const __m512i h23 = PAIR(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6));
            q[2 * half] = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                          _mm512_slli_epi16(_mm512_and_si512(h01, m3), 4));
            q[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                              _mm512_slli_epi16(_mm512_and_si512(h23, m3), 4));
            const __m512i base = _mm512_add_epi16(lo_idx, half ? eight : _mm512_setzero_si512());
            s16[2 * half] = _mm512_permutexvar_epi16(base, sc16);
            s16[2 * half + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(base, four), sc16);
        }
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            __m512i s = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q[i], LDZ(x->q + 64 * i)), s16[i]);
            const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
            is[j] = _mm256_sub_epi32(s8, _mm256_slli_epi32(_mm256_madd_epi16(LDY(x->bsums), sc8), 5));
            dx[j] = x->d;
        }
        acc = combine_k8_vnni(acc, _mm256_loadu_ps(dx), F16Z(w + 208), 0.0f, hsum8_vnni(is),
                              _mm256_setzero_si256());
    }
    store_rows_vnni(acc, nx, out);
}

#include "qdot_q4k_z.h"
#include "qdot_rows_z.h"
#include "qdot_gemm.h"
#undef TGTZ
#undef TGTA
#undef F16Z
#undef LDY
#undef LDZ
#undef PAIR
#endif

#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include "qdot_arm.h"
#endif

/* ---- dispatch -------------------------------------------------------------------------- */

#ifdef QDOT_X86
/* AMX tiles: the CPU has them and Linux lets this process use their state (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process; a VM or kernel without it refuses) */
static int amx_usable(void) {
#ifdef QDOT_AMX
    static int usable = -1;
    if (usable < 0)
        usable = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                 syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return usable;
#else
    return 0;
#endif
}
#endif

/* The hash of the sources this library was built from, where the build says it (setup.py
 * defines it at install; kvq.quant.qdot compares it with the sources it has), else "". */
#ifndef KVQ_SOURCES_KEY
#define KVQ_SOURCES_KEY ""
#endif
const char *kvq_qdot_sources_key(void) { return KVQ_SOURCES_KEY; }

int kvq_qdot_best_isa(void) {
#ifdef QDOT_ARM
    return arm_best_isa();
#endif
#ifdef QDOT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return !__builtin_cpu_supports("avx512bw") ? ISA_VNNI : amx_usable() ? ISA_AMX : ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* The path a call asking for `isa` runs: the best this CPU has for -1 or for a path it
 * lacks (a higher one, or one of the other kind of CPU), else `isa`. */
static int clamp_isa(int isa) {
    const int best = kvq_qdot_best_isa();
    if (isa < 0 || isa > best) return best;
#ifdef QDOT_ARM
    if (isa != ISA_SCALAR && isa < ISA_NEON) return best;
#endif
    return isa;
}

int kvq_qdot_isa(int asked) { return clamp_isa(asked); }

/* isa is clamped to the CPU's by the callers */
static quantize_fn pick_quantize(int isa) {
#ifdef QDOT_ARM
    if (isa >= ISA_NEON) return quantize_neon;
#endif
#ifdef QDOT_X86
    if (isa >= ISA_AVX2) return quantize_avx2;
#else
    (void)isa;
#endif
    return quantize;
}

int kvq_qdot_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

typedef float (*dot_k_fn)(const uint8_t *, const xk_t *, int64_t);

/* whether pick_k's kernel for `qtype` on `isa` (already clamped) takes its activations in the
 * paired order (quantize_k_paired) */
static int k_paired(int qtype, int isa) {
#ifdef QDOT_X86
    return qtype == T_Q4_K && isa >= ISA_AVX512;
#else
    (void)qtype, (void)isa;
    return 0;
#endif
}

/* the activations of one row of x in the order pick_k's kernel takes them */
static void quantize_for(int qtype, int isa, const float *x, int64_t k, xk_t *out) {
#ifdef QDOT_X86
    if (k_paired(qtype, isa)) {
        quantize_k_paired(isa, x, k, out);
        return;
    }
#else
    (void)qtype;
#endif
    quantize_k(isa, x, k, out);
}
typedef float (*dot_0_fn)(const uint8_t *, const x0_t *, int64_t);

/* the kernel of a K-quant `qtype` among PRE_q4_k_P4, PRE_q5_k_P5 and PRE_q6_k_P6 (dot_q4_k_avx2,
 * ...), 0 for another type; and of a 32-value block type among PRE_q8_0_PATH, PRE_mxfp4_PATH,
 * PRE_q5_0_PATH and PRE_q4_0_PATH */
#define K_KERNEL(PRE, P4, P5, P6)                                                                 \
    (qtype == T_Q4_K   ? PRE##_q4_k_##P4                                                         \
     : qtype == T_Q5_K ? PRE##_q5_k_##P5                                                         \
     : qtype == T_Q6_K ? PRE##_q6_k_##P6                                                         \
                       : 0)
#define Q0_KERNEL(PRE, PATH)                                                                      \
    (qtype == T_Q8_0    ? PRE##_q8_0_##PATH                                                      \
     : qtype == T_MXFP4 ? PRE##_mxfp4_##PATH                                                     \
     : qtype == T_Q5_0  ? PRE##_q5_0_##PATH                                                      \
                        : PRE##_q4_0_##PATH)

/* the kernels of one path for a weight type: for one row of x, and the multi-row form
 * (qdot_multi.h), chosen together so that a row gets the same bits either way */
typedef struct {
    dot_k_fn one;
    mdot_k_fn many;
} k_pick;
typedef struct {
    dot_0_fn one;
    mdot_0_fn many;
} q0_pick;
#define K_PICK(P4, P5, P6) ((k_pick){K_KERNEL(dot, P4, P5, P6), K_KERNEL(mdot, P4, P5, P6)})
#define Q0_PICK(PATH) ((q0_pick){Q0_KERNEL(dot, PATH), Q0_KERNEL(mdot, PATH)})

/* the path of a K-quant `qtype` on `isa` (already clamped), by type: Q4_K, Q5_K, Q6_K */
static k_pick pick_k(int qtype, int isa) {
#ifdef QDOT_ARM
    if (isa >= ISA_DOTPROD) return K_PICK(dot, dot, dot);
    if (isa >= ISA_NEON) return K_PICK(neon, neon, neon);
#endif
#ifdef QDOT_X86
    if (isa >= ISA_AVX512) return K_PICK(z, vnni, z); /* no AVX-512 Q5_K kernel: VNNI's */
    if (isa == ISA_VNNI) return K_PICK(vnni, vnni, vnni);
    if (isa == ISA_AVX2) return K_PICK(avx2, avx2, avx2);
#endif
    return K_PICK(scalar, scalar, scalar);
}

/* the path of a 32-value block `qtype` on `isa` (already clamped) */
static q0_pick pick_0(int qtype, int isa) {
#ifdef QDOT_ARM
    if (isa >= ISA_DOTPROD) return Q0_PICK(dot);
    if (isa == ISA_NEON) return Q0_PICK(neon);
#endif
#ifdef QDOT_X86
    if (isa >= ISA_VNNI) return Q0_PICK(vnni);
    if (isa == ISA_AVX2) return Q0_PICK(avx2);
#endif
    return Q0_PICK(scalar);
}

/* pick_k's choice on RZ weight rows at a time for one row of x (qdot_rows_z.h), where there is
 * one: out[j] = fk(w + j * rb, x, nb) for j < nr <= RZ */
typedef void (*rdot_k_fn)(const uint8_t *w, int64_t rb, int nr, const xk_t *x, int64_t nb, float *out);

static rdot_k_fn pick_rk(int qtype, int isa) {
#ifdef QDOT_X86
    if (isa >= ISA_AVX512) {
        if (qtype == T_Q4_K) return rdot_q4_k_z;
        if (qtype == T_Q6_K) return rdot_q6_k_z;
    }
#else
    (void)qtype, (void)isa;
#endif
    return 0;
}

/* out[b, n] = x[b, :] . W[n, :] for W [n_rows, k] encoded in `w` (row_bytes per row) and
 * x [n_x, k] float32; each weight row is unpacked once per MX rows of x (the multi-row dots,
 * which give every row the bits it gets alone). isa < 0: the best this CPU has; a higher one than it has is lowered.
 * Returns 0, or -1 (unknown type), -2 (k not a multiple of the block), -3 (out of memory). */
int kvq_qdot(int qtype, const uint8_t *w, int64_t n_rows, int64_t row_bytes, const float *x,
             int64_t n_x, int64_t k, float *out, int threads, int isa) {
    isa = clamp_isa(isa);
    int kq = qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K;
    if (!kq && !is_q0(qtype)) return -1;
    int64_t bs = kq ? QK : Q0, nb = k / bs;
    if (k % bs) return -2;
    size_t per = kq ? sizeof(xk_t) : sizeof(x0_t);
    void *xq = malloc(per * (size_t)(nb * n_x) + 1);
    if (!xq) return -3;
    for (int64_t r = 0; r < n_x; r++) {
        if (kq)
            quantize_for(qtype, isa, x + r * k, k, (xk_t *)xq + r * nb);
        else
            quantize_0(isa, x + r * k, k, (x0_t *)xq + r * nb);
    }
#ifdef QDOT_X86
    if (isa >= ISA_AVX512 && n_x >= gemm_min(qtype)) { /* many rows: tiles of weight rows (qdot_gemm.h) */
        int rc = gemm_matmul(qtype, k_paired(qtype, isa), isa == ISA_AMX, w, n_rows, row_bytes, xq, per * (size_t)nb,
                             n_x, nb, out, threads < 1 ? 1 : threads);
        free(xq);
        return rc;
    }
#endif
    const k_pick pk = kq ? pick_k(qtype, isa) : (k_pick){0, 0};
    const q0_pick p0 = kq ? (q0_pick){0, 0} : pick_0(qtype, isa);
    dot_k_fn fk = pk.one;
    dot_0_fn f0 = p0.one;
    mdot_k_fn mk = pk.many;
    mdot_0_fn m0 = p0.many;
    rdot_k_fn rk = kq && n_x == 1 ? pick_rk(qtype, isa) : 0;
    if (threads < 1) threads = 1;
#ifdef QDOT_ARM_EXT
    if (isa == ISA_I8MM && n_x > 1) { /* weight rows two at a time (qdot_i8mm.h) */
        qdot_i8mm(qtype, w, n_rows, row_bytes, xq, per, nb, n_x, out, threads, kq ? mk : m0);
        free(xq);
        return 0;
    }
#endif
    (void)threads;
    if (rk) { /* one row of x (a decode step): RZ weight rows at a time */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < n_rows; n += RZ)
            rk(w + n * row_bytes, row_bytes, (int)(n_rows - n < RZ ? n_rows - n : RZ), xq, nb, out + n);
        free(xq);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_rows; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t r0 = 0; r0 < n_x; r0 += MX) { /* MX rows of x per unpacking of the row */
            const int nx = (int)(n_x - r0 < MX ? n_x - r0 : MX);
            const void *xs[MX];
            float y[MX];
            for (int j = 0; j < nx; j++) xs[j] = (const char *)xq + per * (size_t)((r0 + j) * nb);
            if (nx == 1)
                y[0] = kq ? fk(row, xs[0], nb) : f0(row, xs[0], nb);
            else if (kq)
                mk(row, xs, nx, nb, y);
            else
                m0(row, xs, nx, nb, y);
            for (int j = 0; j < nx; j++) out[(r0 + j) * n_rows + n] = y[j];
        }
    }
    free(xq);
    return 0;
}

/* A plain read of n bytes on `threads` threads, the words xored (kvq bench model's memory
 * roof beside the kernels, on their threads): returns the low bit, so the read is not dropped. */
int kvq_stream_read(const uint8_t *p, int64_t n, int threads) {
    uint64_t acc = 0;
    const int64_t words = n / 8;
    if (threads < 1) threads = 1;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(^ : acc)
    for (int64_t i = 0; i < words; i++) {
        uint64_t v;
        memcpy(&v, p + 8 * i, 8);
        acc ^= v;
    }
    return (int)(acc & 1);
}

#include "qdot_moe.h"
#include "qdot_rows.h"
#include "attn_decode.h"
