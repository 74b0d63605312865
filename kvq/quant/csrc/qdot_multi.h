/* Multi-row dots, scalar path (kvq_qdot_moe_batch in qdot_moe.h), included by qdot.c after
 * the one-row scalar dots.
 *
 * out[j] = the one-row dot of w with xs[j] (j < nx <= MX), bit for bit: a block is unpacked
 * once into small integers and dotted with every row; a row's block sums are the one-row
 * kernel's integers (exact, so any order gives them) and its float combination is the same
 * call of combine_k / combine_0, block after block. The SIMD paths (qdot_simd_multi.h) do the
 * same with their registers. */

#define MX 8 /* rows per multi-row call: the caller splits an expert's rows into groups of MX */

/* xs[j]: row j's activation blocks (xk_t or x0_t) */
typedef void (*mdot_k_fn)(const uint8_t *, const void *const *, int, int64_t, float *);
typedef void (*mdot_0_fn)(const uint8_t *, const void *const *, int, int64_t, float *);

/* sum over sub-blocks s of sc[s] * (v . q) over its `size` values */
static int32_t scaled_sums(const uint8_t *v, const int8_t *q, const int *sc, int subs, int size) {
    int32_t isum = 0;
    for (int s = 0; s < subs; s++) {
        int32_t t = 0;
        for (int i = 0; i < size; i++) t += v[size * s + i] * q[size * s + i];
        isum += sc[s] * t;
    }
    return isum;
}

/* a Q4_K / Q5_K block as 256 values in x's order (0..31) */
static void unpack_q45_k(const uint8_t *w, int five, uint8_t *v) {
    const uint8_t *qh = w + 16, *qs = five ? w + 48 : w + 16;
    for (int c = 0; c < 4; c++) {
        for (int i = 0; i < 32; i++) {
            int l = qs[32 * c + i] & 15, h = qs[32 * c + i] >> 4;
            if (five) {
                l |= ((qh[i] >> (2 * c)) & 1) << 4;
                h |= ((qh[i] >> (2 * c + 1)) & 1) << 4;
            }
            v[64 * c + i] = (uint8_t)l;
            v[64 * c + 32 + i] = (uint8_t)h;
        }
    }
}

static void mdot_q45_k_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb,
                              float *out, int five) {
    float acc[MX] = {0};
    const int64_t size = five ? 176 : 144;
    for (int64_t b = 0; b < nb; b++, w += size) {
        uint8_t v[QK];
        int sc[8];
        unpack_q45_k(w, five, v);
        const float d = f16(w), dmin = f16(w + 2);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            const int32_t imin = kmins(w + 4, x, sc);
            acc[j] = combine_k(acc[j], x->d, d, dmin, scaled_sums(v, x->q, sc, 8, 32), imin);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static void mdot_q4_k_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    mdot_q45_k_scalar(w, xs, nx, nb, out, 0);
}

static void mdot_q5_k_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    mdot_q45_k_scalar(w, xs, nx, nb, out, 1);
}

static void mdot_q6_k_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 210) {
        uint8_t v[QK]; /* value 16t + i: 6 bits, sub-block t */
        int sc[16];
        const int8_t *s8 = (const int8_t *)(w + 192);
        for (int t = 0; t < 16; t++) sc[t] = s8[t];
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
            uint8_t *o = v + 128 * half;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        const float d = f16(w + 208);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            const int32_t isum = scaled_sums(v, x->q, sc, 16, 16) - q6_offset(s8, x);
            acc[j] = combine_k(acc[j], x->d, d, 0.0f, isum, 0);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static void mdot_q8_0_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2);
        const float d = f16(w);
        for (int j = 0; j < nx; j++) {
            const x0_t *x = (const x0_t *)xs[j] + b;
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) isum += q[i] * x->q[i];
            acc[j] = combine_0(acc[j], x->d, d, isum);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static void mdot_q4_0_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 18) {
        uint8_t v[Q0];
        for (int i = 0; i < 16; i++) {
            v[i] = w[2 + i] & 15;
            v[16 + i] = w[2 + i] >> 4;
        }
        const float d = f16(w);
        const int one = 1;
        for (int j = 0; j < nx; j++) {
            const x0_t *x = (const x0_t *)xs[j] + b;
            acc[j] = combine_0(acc[j], x->d, d, scaled_sums(v, x->q, &one, 1, Q0) - 8 * x->sum);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static void mdot_q5_0_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 22) {
        uint32_t qh;
        memcpy(&qh, w + 2, 4);
        int q[Q0];
        for (int i = 0; i < 16; i++) {
            q[i] = (w[6 + i] & 15) | (int)(((qh >> i) & 1) << 4);
            q[16 + i] = (w[6 + i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4);
        }
        const float d = f16(w);
        for (int j = 0; j < nx; j++) {
            const x0_t *x = (const x0_t *)xs[j] + b;
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) isum += q[i] * x->q[i];
            acc[j] = combine_0(acc[j], x->d, d, isum - 16 * x->sum);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static void mdot_mxfp4_scalar(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 17) {
        int8_t q[Q0];
        for (int i = 0; i < 16; i++) {
            q[i] = kv_mxfp4[w[1 + i] & 15];
            q[16 + i] = kv_mxfp4[w[1 + i] >> 4];
        }
        const float d = e8m0_half(w[0]);
        for (int j = 0; j < nx; j++) {
            const x0_t *x = (const x0_t *)xs[j] + b;
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) isum += q[i] * x->q[i];
            acc[j] = combine_0(acc[j], x->d, d, isum);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}
