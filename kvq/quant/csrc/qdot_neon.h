/* One arm64 path of qdot.c, included once per extension with these defined:
 *   TGT              the target attribute of every function here
 *   SFX(name)        name with the path's suffix
 *   DOT4(acc, a, b)  int32x4: acc + lane i = sum of a[4i..4i+3] * b[4i..4i+3], signed bytes
 *                    (NEON: smull + saddlp + addp, dotprod: sdot)
 * A block's weights are unpacked into signed bytes (every unsigned value kvq stores is below
 * 64, so it fits), dotted with each row's activations 16 bytes at a time, and scaled per
 * 16-value run in int32 lanes: exact integers, whatever the order, so the scalar path's. The
 * float part is the scalar path's own combine_k / combine_0, row by row, block after block:
 * the same bits. The one-row dots are the multi-row ones with one row. */

/* a K-quant block's 256 values in x's order as 16 runs of 16, and each run's scale */
typedef struct {
    int8x16_t v[16];
    int sc[16];
    int per;   /* runs per scale: 2 (Q4_K, Q5_K: 32-value sub-blocks) or 1 (Q6_K) */
    int mn[8]; /* Q4_K / Q5_K: the sub-blocks' minimums */
    float d, dmin;
} SFX(kblock_t);

static TGT inline void SFX(unpack_q45_k)(const uint8_t *w, int five, SFX(kblock_t) *o) {
    const uint8x16_t m4 = vdupq_n_u8(15), one = vdupq_n_u8(1), two = vdupq_n_u8(2);
    const uint8_t *qs = five ? w + 48 : w + 16;
    uint8x16_t h[2] = {vld1q_u8(w + 16), vld1q_u8(w + 32)}; /* Q5_K: bit 2c / 2c + 1 of chunk c */
    for (int c = 0; c < 4; c++) {
        for (int i = 0; i < 2; i++) {
            const uint8x16_t q = vld1q_u8(qs + 32 * c + 16 * i);
            uint8x16_t lo = vandq_u8(q, m4), hi = vshrq_n_u8(q, 4);
            if (five) {
                lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(h[i], one), 4));
                hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(h[i], two), 3));
                h[i] = vshrq_n_u8(h[i], 2);
            }
            o->v[4 * c + i] = vreinterpretq_s8_u8(lo);
            o->v[4 * c + 2 + i] = vreinterpretq_s8_u8(hi);
        }
    }
    for (int j = 0; j < 8; j++) {
        int s;
        scale_min(w + 4, j, &s, &o->mn[j]);
        o->sc[2 * j] = o->sc[2 * j + 1] = s;
    }
    o->per = 2;
    o->d = f16(w);
    o->dmin = f16(w + 2);
}

/* Q6_K: value 16t + i of run t is q - 32 (the -32 comes off through q6_offset) */
static TGT inline void SFX(unpack_q6_k)(const uint8_t *w, SFX(kblock_t) *o) {
    const uint8x16_t m4 = vdupq_n_u8(15), m3 = vdupq_n_u8(3);
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
        int8x16_t *v = o->v + 8 * half;
        for (int g = 0; g < 2; g++) {
            const uint8x16_t l0 = vld1q_u8(ql + 16 * g), l1 = vld1q_u8(ql + 32 + 16 * g);
            const uint8x16_t h = vld1q_u8(qh + 16 * g);
            v[0 + g] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(h, m3), 4)));
            v[2 + g] = vreinterpretq_s8_u8(
                vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 2), m3), 4)));
            v[4 + g] = vreinterpretq_s8_u8(
                vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 4), m3), 4)));
            v[6 + g] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(h, 6), 4)));
        }
    }
    const int8_t *s8 = (const int8_t *)(w + 192);
    for (int t = 0; t < 16; t++) o->sc[t] = s8[t];
    o->per = 1;
    o->d = f16(w + 208);
    o->dmin = 0.0f;
}

/* sum over runs r of sc[r] * (v[r] . q[16r ..]), the runs of one scale dotted together */
static TGT inline int32_t SFX(scaled_runs)(const SFX(kblock_t) *k, const int8_t *q) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int r = 0; r < 16; r += k->per) {
        int32x4_t s = DOT4(vdupq_n_s32(0), k->v[r], vld1q_s8(q + 16 * r));
        if (k->per == 2) s = DOT4(s, k->v[r + 1], vld1q_s8(q + 16 * r + 16));
        acc = vmlaq_n_s32(acc, s, k->sc[r]);
    }
    return vaddvq_s32(acc);
}

/* acc after block w (unpacked into k) of row x whose sum of scaled runs is isum: combine_k
 * with the minimums (Q4_K, Q5_K) or the -32 offset (Q6_K), as the scalar path */
static TGT inline float SFX(finish_k)(int qtype, const uint8_t *w, const SFX(kblock_t) *k, const xk_t *x,
                                      float acc, int32_t isum) {
    if (qtype == T_Q6_K)
        return combine_k(acc, x->d, k->d, 0.0f, isum - q6_offset((const int8_t *)(w + 192), x), 0);
    int32_t imin = 0;
    for (int s = 0; s < 8; s++) imin += k->mn[s] * (x->bsums[2 * s] + x->bsums[2 * s + 1]);
    return combine_k(acc, x->d, k->d, k->dmin, isum, imin);
}

/* the K-quants (qtype Q4_K, Q5_K or Q6_K) on nx <= MX rows */
static TGT inline __attribute__((always_inline)) void SFX(rows_k)(int qtype, const uint8_t *w,
                                                                  const void *const *xs, int nx,
                                                                  int64_t nb, float *out) {
    const int64_t size = block_bytes(qtype);
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += size) {
        SFX(kblock_t) k;
        if (qtype == T_Q6_K)
            SFX(unpack_q6_k)(w, &k);
        else
            SFX(unpack_q45_k)(w, qtype == T_Q5_K, &k);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            acc[j] = SFX(finish_k)(qtype, w, &k, x, acc[j], SFX(scaled_runs)(&k, x->q));
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

/* a 32-value block's values (Q8_0 and MXFP4 signed, Q4_0 and Q5_0 unsigned with an offset) */
static TGT inline void SFX(unpack_0)(int qtype, const uint8_t *w, int8x16_t v[2]) {
    const uint8x16_t m4 = vdupq_n_u8(15);
    if (qtype == T_Q8_0) {
        v[0] = vld1q_s8((const int8_t *)(w + 2));
        v[1] = vld1q_s8((const int8_t *)(w + 18));
        return;
    }
    const uint8x16_t q = vld1q_u8(w + (qtype == T_Q5_0 ? 6 : qtype == T_MXFP4 ? 1 : 2));
    uint8x16_t lo = vandq_u8(q, m4), hi = vshrq_n_u8(q, 4);
    if (qtype == T_MXFP4) {
        const int8x16_t tbl = vld1q_s8(kv_mxfp4);
        v[0] = vqtbl1q_s8(tbl, lo);
        v[1] = vqtbl1q_s8(tbl, hi);
        return;
    }
    if (qtype == T_Q5_0) { /* + 16 where element i's bit i of qh is set */
        static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
        const uint8x16_t bits = vld1q_u8(bit), sixteen = vdupq_n_u8(16);
        const uint8x16_t h0 = vcombine_u8(vdup_n_u8(w[2]), vdup_n_u8(w[3]));
        const uint8x16_t h1 = vcombine_u8(vdup_n_u8(w[4]), vdup_n_u8(w[5]));
        lo = vorrq_u8(lo, vandq_u8(vtstq_u8(h0, bits), sixteen));
        hi = vorrq_u8(hi, vandq_u8(vtstq_u8(h1, bits), sixteen));
    }
    v[0] = vreinterpretq_s8_u8(lo);
    v[1] = vreinterpretq_s8_u8(hi);
}

/* Q8_0, Q4_0, Q5_0 and MXFP4 on nx <= MX rows */
static TGT inline __attribute__((always_inline)) void SFX(rows_0)(int qtype, const uint8_t *w,
                                                                  const void *const *xs, int nx,
                                                                  int64_t nb, float *out) {
    const int64_t size = block_bytes(qtype);
    const int off = qtype == T_Q4_0 ? 8 : qtype == T_Q5_0 ? 16 : 0;
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += size) {
        int8x16_t v[2];
        SFX(unpack_0)(qtype, w, v);
        const float d = qtype == T_MXFP4 ? e8m0_half(w[0]) : f16(w);
        for (int j = 0; j < nx; j++) {
            const x0_t *x = (const x0_t *)xs[j] + b;
            const int32x4_t s = DOT4(DOT4(vdupq_n_s32(0), v[0], vld1q_s8(x->q)), v[1], vld1q_s8(x->q + 16));
            acc[j] = combine_0(acc[j], x->d, d, vaddvq_s32(s) - off * x->sum);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

/* the one-row and multi-row entries of each type (`one` and `many` of pick_k and pick_0) */
#define DOTS(name, qtype, rows, xt)                                                              \
    static TGT float SFX(dot_##name)(const uint8_t *w, const xt *x, int64_t nb) {                \
        float y;                                                                                 \
        const void *xs = x;                                                                      \
        SFX(rows)(qtype, w, &xs, 1, nb, &y);                                                     \
        return y;                                                                                \
    }                                                                                            \
    static TGT void SFX(mdot_##name)(const uint8_t *w, const void *const *xs, int nx, int64_t nb, \
                                     float *out) {                                               \
        SFX(rows)(qtype, w, xs, nx, nb, out);                                                    \
    }
DOTS(q4_k, T_Q4_K, rows_k, xk_t)
DOTS(q5_k, T_Q5_K, rows_k, xk_t)
DOTS(q6_k, T_Q6_K, rows_k, xk_t)
DOTS(q8_0, T_Q8_0, rows_0, x0_t)
DOTS(q4_0, T_Q4_0, rows_0, x0_t)
DOTS(q5_0, T_Q5_0, rows_0, x0_t)
DOTS(mxfp4, T_MXFP4, rows_0, x0_t)
#undef DOTS
