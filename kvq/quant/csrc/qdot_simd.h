/* One SIMD path of qdot.c, included once per instruction set with these defined:
 *   TGT            the target attribute of every function here
 *   SFX(name)      name with the path's suffix
 *   MUL_SUM(u, s)  8 int32 lanes, lane i = sum of the 4 products u[4i..4i+3] * s[4i..4i+3]
 *                  (u unsigned, s signed bytes; AVX2: vpmaddubsw + vpmaddwd, VNNI: vpdpbusd)
 * Every integer here is exact, so the result is the scalar path's, bit for bit.
 * No vpmaddubsw pair overflows int16: |u| <= 128 and |s| <= 127, and a pair of a 6-bit
 * weight (<= 63) or a Q8_0 magnitude (<= 128) stays below 32767. */

static TGT inline int32_t SFX(hsum)(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

#define LD(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))

/* Q4_K / Q5_K: the 8 six-bit scales and mins of a block from its 12 packed bytes, as words:
 * scales 0-3 = low 6 bits of bytes 0-3, mins 0-3 = of bytes 4-7; scales 4-7 = low nibbles of
 * bytes 8-11 with bits 6-7 of bytes 0-3 on top, mins 4-7 = high nibbles of 8-11 with bits 6-7
 * of bytes 4-7 on top. */
static TGT inline void SFX(k_scales)(const uint8_t *p, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], o[4];
    memcpy(u, p, 12);
    o[0] = u[0] & 0x3f3f3f3fu;
    o[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    o[2] = u[1] & 0x3f3f3f3fu;
    o[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, o, 8);
    memcpy(mn, o + 2, 8);
}

/* sum_j mn[j] * (bsums[2j] + bsums[2j + 1]) */
static TGT inline int32_t SFX(k_mins)(const uint8_t mn[8], const int16_t *bsums) {
    const __m256i bs = LD(bsums);
    const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    const __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)mn));
    const __m128i p = _mm_madd_epi16(pairs, m);
    __m128i s = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* 8 int32: sc * (pairwise sums of u * s), u unsigned <= 63, s signed */
#define SCALED(u, s, sc16) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), (sc16))

static TGT float SFX(dot_q4_k)(const uint8_t *w, const xk_t *x, int64_t nb) {
    const __m256i m4 = _mm256_set1_epi8(15);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 144, x++) {
        PREFETCH(w);
        uint8_t sc[8], mn[8];
        SFX(k_scales)(w + 4, sc, mn);
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = LD(w + 16 + 32 * c);
            s = _mm256_add_epi32(s, SCALED(_mm256_and_si256(q, m4), LD(x->q + 64 * c),
                                           _mm256_set1_epi16(sc[2 * c])));
            s = _mm256_add_epi32(s, SCALED(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                           LD(x->q + 64 * c + 32), _mm256_set1_epi16(sc[2 * c + 1])));
        }
        acc = combine_k(acc, x->d, F16(w), F16(w + 2), SFX(hsum)(s), SFX(k_mins)(mn, x->bsums));
    }
    return acc;
}

static TGT float SFX(dot_q5_k)(const uint8_t *w, const xk_t *x, int64_t nb) {
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 176, x++) {
        PREFETCH(w);
        uint8_t sc[8], mn[8];
        SFX(k_scales)(w + 4, sc, mn);
        const __m256i qh = LD(w + 16);
        __m256i s = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q = LD(w + 48 + 32 * c);
            __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
            __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
            __m256i l = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi16(h0, 4));
            __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                                        _mm256_slli_epi16(h1, 4));
            s = _mm256_add_epi32(s, SCALED(l, LD(x->q + 64 * c), _mm256_set1_epi16(sc[2 * c])));
            s = _mm256_add_epi32(s, SCALED(h, LD(x->q + 64 * c + 32), _mm256_set1_epi16(sc[2 * c + 1])));
        }
        acc = combine_k(acc, x->d, F16(w), F16(w + 2), SFX(hsum)(s), SFX(k_mins)(mn, x->bsums));
    }
    return acc;
}

/* a group of 32 q covers two 16-value sub-blocks: int16 lanes 0-7 scale j, lanes 8-15 j + 1 */
#define Q6_SCALES(s, j) _mm256_set_m128i(_mm_set1_epi16((s)[(j) + 1]), _mm_set1_epi16((s)[j]))

static TGT float SFX(dot_q6_k)(const uint8_t *w, const xk_t *x, int64_t nb) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 210, x++) {
        PREFETCH(w);
        const int8_t *sc = (const int8_t *)(w + 192);
        __m256i s = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = LD(w + 64 * half), ql1 = LD(w + 64 * half + 32);
            const __m256i qh = LD(w + 128 + 32 * half);
            const int8_t *xq = x->q + 128 * half, *hs = sc + 8 * half;
            __m256i q1 = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                                         _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            __m256i q2 = _mm256_or_si256(
                _mm256_and_si256(ql1, m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            __m256i q3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            __m256i q4 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            s = _mm256_add_epi32(s, SCALED(q1, LD(xq), Q6_SCALES(hs, 0)));
            s = _mm256_add_epi32(s, SCALED(q2, LD(xq + 32), Q6_SCALES(hs, 2)));
            s = _mm256_add_epi32(s, SCALED(q3, LD(xq + 64), Q6_SCALES(hs, 4)));
            s = _mm256_add_epi32(s, SCALED(q4, LD(xq + 96), Q6_SCALES(hs, 6)));
        }
        /* the -32 offset: 32 * sum_t scale_t * bsums_t */
        const __m256i off = _mm256_madd_epi16(LD(x->bsums), _mm256_cvtepi8_epi16(
            _mm_loadu_si128((const __m128i *)(const void *)sc)));
        int32_t isum = SFX(hsum)(s) - 32 * SFX(hsum)(off);
        acc = combine_k(acc, x->d, F16(w + 208), 0.0f, isum, 0);
    }
    return acc;
}

/* MXFP4's 32 values as signed bytes: each nibble looked up in the E2M1 table (pshufb) */
static TGT inline __m256i SFX(mxfp4_values)(const uint8_t *w) {
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i tbl = _mm_loadu_si128((const __m128i *)(const void *)kv_mxfp4);
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(w + 1));
    return _mm256_set_m128i(_mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(v, 4), m4)),
                            _mm_shuffle_epi8(tbl, _mm_and_si128(v, m4)));
}

/* Q5_0's 32 values 0..31: the nibbles as Q4_0's, plus 16 where the element's fifth bit is set
 * (byte j of the broadcast qh picked per 8 lanes, each lane testing its own bit) */
static TGT inline __m256i SFX(q5_0_values)(const uint8_t *w) {
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(w + 6));
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    uint32_t qh;
    memcpy(&qh, w + 2, 4);
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
    return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

#include "qdot_simd_multi.h"

/* The dots of the 32-value types (Q8_0, Q4_0, Q5_0, MXFP4) for 1 to MX rows of x. A block's
 * integer sum is left in 8 int32 lanes (the offsets of Q4_0 / Q5_0 taken off lane by lane);
 * per row, 8 blocks' lanes are reduced together (hsum8) and their products with the scales
 * formed in 8 float lanes, then added to the row's acc block after block: the operations of
 * combine_0 in its order, so every row gets the scalar path's bits, at a fraction of a
 * reduction per block. The weights of 8 blocks are unpacked once for all the rows. */

/* a block's values: signed (Q8_0, MXFP4) or unsigned with an offset (Q4_0, Q5_0) */
static TGT inline __attribute__((always_inline)) __m256i SFX(values_0)(int qtype, const uint8_t *w) {
    if (qtype == T_Q8_0) return LD(w + 2);
    if (qtype == T_MXFP4) return SFX(mxfp4_values)(w);
    if (qtype == T_Q4_0) {
        const __m128i m4 = _mm_set1_epi8(15);
        const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(w + 2));
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    }
    return SFX(q5_0_values)(w);
}

/* the block's 8 lanes against x's block (u = |q| for the signed types) */
static TGT inline __attribute__((always_inline)) __m256i SFX(lanes_0)(int qtype, __m256i q, __m256i u,
                                                                       const x0_t *x) {
    if (qtype == T_Q8_0 || qtype == T_MXFP4) /* |w| as unsigned, and x with w's sign */
        return MUL_SUM(u, _mm256_sign_epi8(LD(x->q), q));
    /* minus off * sum: the sum from each lane, off / 8 times */
    return _mm256_sub_epi32(MUL_SUM(q, LD(x->q)), _mm256_set1_epi32(qtype == T_Q4_0 ? x->sum : 2 * x->sum));
}

static TGT inline __attribute__((always_inline)) float SFX(scale_0)(int qtype, const uint8_t *w) {
    return qtype == T_MXFP4 ? e8m0_half(w[0]) : F16(w);
}

static TGT inline __attribute__((always_inline)) void SFX(rows_0)(int qtype, const uint8_t *w,
                                                                  const x0_t *const *xs, int nx,
                                                                  int64_t nb, float *out) {
    const int64_t size = block_bytes(qtype);
    const int sgn = qtype == T_Q8_0 || qtype == T_MXFP4;
    float acc[MX] = {0};
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8, w += 8 * size) {
        __m256i q[8], u[8];
        float d[8];
        for (int i = 0; i < 8; i++) {
            q[i] = SFX(values_0)(qtype, w + i * size);
            u[i] = sgn ? _mm256_sign_epi8(q[i], q[i]) : q[i];
            d[i] = SFX(scale_0)(qtype, w + i * size);
        }
        for (int j = 0; j < nx; j++) {
            const x0_t *x = xs[j] + b;
            __m256i v[8];
            float s[8], p[8];
            for (int i = 0; i < 8; i++) {
                v[i] = SFX(lanes_0)(qtype, q[i], u[i], x + i);
                s[i] = x[i].d * d[i];
            }
            _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_cvtepi32_ps(SFX(hsum8)(v))));
            float a = acc[j];
            for (int i = 0; i < 8; i++) a += p[i];
            acc[j] = a;
        }
    }
    for (; b < nb; b++, w += size) {
        const __m256i q = SFX(values_0)(qtype, w), u = sgn ? _mm256_sign_epi8(q, q) : q;
        const float d = SFX(scale_0)(qtype, w);
        for (int j = 0; j < nx; j++) {
            const x0_t *x = xs[j] + b;
            acc[j] = combine_0(acc[j], x->d, d, SFX(hsum)(SFX(lanes_0)(qtype, q, u, x)));
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

/* the one-row and multi-row entries of each type (`one` and `many` of pick_0) */
#define DOTS_0(name, qtype)                                                                    \
    static TGT float SFX(dot_##name)(const uint8_t *w, const x0_t *x, int64_t nb) {            \
        float y;                                                                               \
        SFX(rows_0)(qtype, w, &x, 1, nb, &y);                                                  \
        return y;                                                                              \
    }                                                                                          \
    static TGT void SFX(mdot_##name)(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) { \
        SFX(rows_0)(qtype, w, (const x0_t *const *)xs, nx, nb, out);                           \
    }
DOTS_0(q8_0, T_Q8_0)
DOTS_0(q4_0, T_Q4_0)
DOTS_0(q5_0, T_Q5_0)
DOTS_0(mxfp4, T_MXFP4)
#undef DOTS_0

#undef LD
#undef Q6_SCALES
#undef SCALED
