/* The i8mm path (ISA_I8MM, Armv8.6 FEAT_I8MM, HWCAP2_I8MM), included by qdot_arm.h after the
 * sdot path, whose one-row dots and unpacking it reuses.
 *
 * smmla multiplies a 2x8 matrix of signed bytes by the transpose of another into 2x2 int32:
 * with the rows of two activations as A and the same 8 values of two weight rows as B, one
 * instruction gives the 4 dot products of 2 rows of x with 2 weight rows, where sdot gives 4
 * partial sums of one. So it pays where a call has several rows of x: kvq_qdot takes the
 * weight rows two at a time (qdot_i8mm) and, per block, each pair of x rows; a call of one row
 * keeps the sdot dots (A's second row would be wasted). The int32 lanes are the one-row
 * kernel's integers and each (row, weight row) output its combine_k / combine_0 block after
 * block: the same bits. */

#define TGT8 __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))

/* [first 8 bytes of a, first 8 of b] (lo) or [last 8 of a, last 8 of b] (hi) */
static TGT8 inline int8x16_t zip_lo(int8x16_t a, int8x16_t b) {
    return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
}
static TGT8 inline int8x16_t zip_hi(int8x16_t a, int8x16_t b) {
    return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
}

/* lanes [xa . w0, xa . w1, xb . w0, xb . w1] of 16 values: wl, wh the two weight rows' values
 * zipped (zip_lo, zip_hi) */
static TGT8 inline int32x4_t mmla16(int8x16_t wl, int8x16_t wh, const int8_t *xa, const int8_t *xb) {
    const int8x16_t a = vld1q_s8(xa), c = vld1q_s8(xb);
    return vmmlaq_s32(vmmlaq_s32(vdupq_n_s32(0), zip_lo(a, c), wl), zip_hi(a, c), wh);
}

/* the K-quants on weight rows w0 and w1 and nx <= MX rows of x: out0[j], out1[j] */
static TGT8 inline __attribute__((always_inline)) void rows2_k(int qtype, const uint8_t *w0, const uint8_t *w1,
                                                               const void *const *xs, int nx, int64_t nb,
                                                               float *out0, float *out1) {
    const int64_t size = block_bytes(qtype);
    float acc0[MX] = {0}, acc1[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w0 += size, w1 += size) {
        kblock_t_dot k0, k1;
        if (qtype == T_Q6_K) {
            unpack_q6_k_dot(w0, &k0);
            unpack_q6_k_dot(w1, &k1);
        } else {
            unpack_q45_k_dot(w0, qtype == T_Q5_K, &k0);
            unpack_q45_k_dot(w1, qtype == T_Q5_K, &k1);
        }
        int8x16_t wl[16], wh[16];
        int32x4_t sc[16]; /* run r's scales in the lanes' order: w0, w1, w0, w1 */
        for (int r = 0; r < 16; r++) {
            wl[r] = zip_lo(k0.v[r], k1.v[r]);
            wh[r] = zip_hi(k0.v[r], k1.v[r]);
            const int32_t s[4] = {k0.sc[r], k1.sc[r], k0.sc[r], k1.sc[r]};
            sc[r] = vld1q_s32(s);
        }
        for (int j = 0; j < nx; j += 2) {
            const xk_t *xa = (const xk_t *)xs[j] + b, *xb = (const xk_t *)xs[j + 1 < nx ? j + 1 : j] + b;
            int32x4_t s = vdupq_n_s32(0);
            for (int r = 0; r < 16; r += k0.per) { /* the runs of one scale together */
                int32x4_t t = mmla16(wl[r], wh[r], xa->q + 16 * r, xb->q + 16 * r);
                if (k0.per == 2) t = vaddq_s32(t, mmla16(wl[r + 1], wh[r + 1], xa->q + 16 * r + 16, xb->q + 16 * r + 16));
                s = vmlaq_s32(s, t, sc[r]);
            }
            acc0[j] = finish_k_dot(qtype, w0, &k0, xa, acc0[j], vgetq_lane_s32(s, 0));
            acc1[j] = finish_k_dot(qtype, w1, &k1, xa, acc1[j], vgetq_lane_s32(s, 1));
            if (j + 1 < nx) {
                acc0[j + 1] = finish_k_dot(qtype, w0, &k0, xb, acc0[j + 1], vgetq_lane_s32(s, 2));
                acc1[j + 1] = finish_k_dot(qtype, w1, &k1, xb, acc1[j + 1], vgetq_lane_s32(s, 3));
            }
        }
    }
    memcpy(out0, acc0, sizeof(float) * (size_t)nx);
    memcpy(out1, acc1, sizeof(float) * (size_t)nx);
}

/* Q8_0, Q4_0, Q5_0 and MXFP4 on weight rows w0 and w1 and nx <= MX rows of x */
static TGT8 inline __attribute__((always_inline)) void rows2_0(int qtype, const uint8_t *w0, const uint8_t *w1,
                                                               const void *const *xs, int nx, int64_t nb,
                                                               float *out0, float *out1) {
    const int64_t size = block_bytes(qtype);
    const int off = qtype == T_Q4_0 ? 8 : qtype == T_Q5_0 ? 16 : 0;
    float acc0[MX] = {0}, acc1[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w0 += size, w1 += size) {
        int8x16_t v0[2], v1[2];
        unpack_0_dot(qtype, w0, v0);
        unpack_0_dot(qtype, w1, v1);
        const int8x16_t wl0 = zip_lo(v0[0], v1[0]), wh0 = zip_hi(v0[0], v1[0]);
        const int8x16_t wl1 = zip_lo(v0[1], v1[1]), wh1 = zip_hi(v0[1], v1[1]);
        const float d0 = qtype == T_MXFP4 ? e8m0_half(w0[0]) : f16(w0);
        const float d1 = qtype == T_MXFP4 ? e8m0_half(w1[0]) : f16(w1);
        for (int j = 0; j < nx; j += 2) {
            const x0_t *xa = (const x0_t *)xs[j] + b, *xb = (const x0_t *)xs[j + 1 < nx ? j + 1 : j] + b;
            const int32x4_t s = vaddq_s32(mmla16(wl0, wh0, xa->q, xb->q), mmla16(wl1, wh1, xa->q + 16, xb->q + 16));
            acc0[j] = combine_0(acc0[j], xa->d, d0, vgetq_lane_s32(s, 0) - off * xa->sum);
            acc1[j] = combine_0(acc1[j], xa->d, d1, vgetq_lane_s32(s, 1) - off * xa->sum);
            if (j + 1 < nx) {
                acc0[j + 1] = combine_0(acc0[j + 1], xb->d, d0, vgetq_lane_s32(s, 2) - off * xb->sum);
                acc1[j + 1] = combine_0(acc1[j + 1], xb->d, d1, vgetq_lane_s32(s, 3) - off * xb->sum);
            }
        }
    }
    memcpy(out0, acc0, sizeof(float) * (size_t)nx);
    memcpy(out1, acc1, sizeof(float) * (size_t)nx);
}

/* out0[j] = the dot of weight row w0 with xs[j], out1[j] of w1, j < nx <= MX */
typedef void (*mdot2_fn)(const uint8_t *, const uint8_t *, const void *const *, int, int64_t, float *, float *);

#define DOTS2(name, qtype, rows)                                                                         \
    static TGT8 void mdot2_##name##_i8mm(const uint8_t *w0, const uint8_t *w1, const void *const *xs, int nx, \
                                         int64_t nb, float *out0, float *out1) {                         \
        rows(qtype, w0, w1, xs, nx, nb, out0, out1);                                                     \
    }
DOTS2(q4_k, T_Q4_K, rows2_k)
DOTS2(q5_k, T_Q5_K, rows2_k)
DOTS2(q6_k, T_Q6_K, rows2_k)
DOTS2(q8_0, T_Q8_0, rows2_0)
DOTS2(q4_0, T_Q4_0, rows2_0)
DOTS2(q5_0, T_Q5_0, rows2_0)
DOTS2(mxfp4, T_MXFP4, rows2_0)
#undef DOTS2

static mdot2_fn pick_m2(int qtype) {
    switch (qtype) {
    case T_Q4_K: return mdot2_q4_k_i8mm;
    case T_Q5_K: return mdot2_q5_k_i8mm;
    case T_Q6_K: return mdot2_q6_k_i8mm;
    case T_Q8_0: return mdot2_q8_0_i8mm;
    case T_Q4_0: return mdot2_q4_0_i8mm;
    case T_Q5_0: return mdot2_q5_0_i8mm;
    default: return mdot2_mxfp4_i8mm;
    }
}

/* kvq_qdot's products on the i8mm path: out[b, n] for the n_rows weight rows of w two at a
 * time (an odd last one through `one`, the sdot path's multi-row dot), xq the quantized rows
 * of x (per bytes each) */
static void qdot_i8mm(int qtype, const uint8_t *w, int64_t n_rows, int64_t row_bytes, const char *xq, size_t per,
                      int64_t nb, int64_t n_x, float *out, int threads, void (*one)(const uint8_t *, const void *const *, int, int64_t, float *)) {
    const mdot2_fn two = pick_m2(qtype);
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < (n_rows + 1) / 2; i++) {
        const int64_t n = 2 * i;
        const uint8_t *row = w + n * row_bytes;
        for (int64_t r0 = 0; r0 < n_x; r0 += MX) {
            const int nx = (int)(n_x - r0 < MX ? n_x - r0 : MX);
            const void *xs[MX];
            float y0[MX], y1[MX];
            for (int j = 0; j < nx; j++) xs[j] = xq + per * (size_t)((r0 + j) * nb);
            if (n + 1 < n_rows)
                two(row, row + row_bytes, xs, nx, nb, y0, y1);
            else
                one(row, xs, nx, nb, y0);
            for (int j = 0; j < nx; j++) {
                out[(r0 + j) * n_rows + n] = y0[j];
                if (n + 1 < n_rows) out[(r0 + j) * n_rows + n + 1] = y1[j];
            }
        }
    }
}
