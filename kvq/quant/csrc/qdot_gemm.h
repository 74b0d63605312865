/* Many rows of x against a tile of GT weight rows (AVX512BW + VNNI), included by qdot.c inside
 * its 512-bit section (TGTZ, F16Z).
 *
 * The multi-row dots unpack a weight block once per MX rows of x and reduce each (weight row,
 * x row) pair across lanes. For a prompt (hundreds of rows per matrix, tens per expert) this
 * kernel turns the layout around: a tile of GT = 16 weight rows is unpacked once (for every
 * block of the row) into bytes ordered [4-value group][weight row][4 values], so that one
 * vpdpbusd multiplies 4 values of all 16 rows by 4 activations of one row of x, broadcast,
 * and each int32 lane holds one weight row's sum: no reduction across lanes, and the
 * unpacking is paid once per tile and chunk of x rows instead of once per 8 rows.
 *
 * Same bits as the one-row dots: every weight is stored as an unsigned byte u = v + off
 * (off 0 for the K-quants, which are unsigned already), each block's integers (the scaled
 * sub-block sums, the mins' and offsets' terms from x's sums) are exact in int32 whatever the
 * order, and the float combination is combine_k's / combine_0's, lane by lane, block after
 * block. */

#define GT 16        /* weight rows per tile: one per int32 lane */
#define GEMM_CHUNK 128 /* rows of x per pass over a tile: their activations stay in L2 */
#define GROUP_B 64   /* bytes of one 4-value group of a tile: GT rows x 4 */
#ifndef GR
#define GR 8         /* rows of x per pass over a block (one weight load feeds GR vpdpbusd) */
#endif

/* bytes of one unpacked block of a tile: values, then the K-quants' sub-block scales (16 int32
 * lanes per sub-block), the pairs dotted with x's bsums, d and dmin */
#define KB_VALUES (QK / 4 * GROUP_B)
#define KB_BYTES (KB_VALUES + 16 * GROUP_B + 8 * GROUP_B + 2 * GROUP_B)
#define ZB_BYTES (Q0 / 4 * GROUP_B + GROUP_B)

/* rows of x from which a call (or an expert) takes this kernel: where it beat the multi-row
 * dots, one thread, 2048-2880 wide matrices, on a Xeon with AMX and AVX-512 VNNI (2026-12-06;
 * docs/models.md). Below it the multi-row dots, which give the same bits. */
static int64_t gemm_min(int qtype) {
    switch (qtype) {
    case T_Q6_K: return 12;
    case T_Q4_K:
    case T_Q5_K: return 4;
    default: return 2; /* the 32-value types */
    }
}

static int gemm_covers(int qtype) {
    return qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K || qtype == T_Q8_0 ||
           qtype == T_Q4_0 || qtype == T_Q5_0 || qtype == T_MXFP4;
}

/* bytes of a tile's unpacked blocks for rows of k values */
static size_t gemm_tile_bytes(int qtype, int64_t k) {
    int kq = qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K;
    return kq ? (size_t)(k / QK) * KB_BYTES : (size_t)(k / Q0) * ZB_BYTES;
}

/* the unsigned offset of each type's values (isum = u . x - off * sum(x)) */
static int32_t gemm_off(int qtype) {
    return qtype == T_Q8_0 ? 128 : qtype == T_Q4_0 ? 8 : qtype == T_Q5_0 ? 16 : qtype == T_MXFP4 ? 12 : 0;
}

#define GATHER(idx, p) _mm512_i32gather_epi32((idx), (const void *)(p), 1)
#define STOREG(buf, g, v) _mm512_storeu_si512((void *)((buf) + (size_t)(g) * GROUP_B), (v))

/* the values of one K-quant block of the tile into its groups, in the order x's q holds them
 * (`paired`: quantize_k_paired's order, natural chunk c at position PAIRED[c]) */
static TGTZ void unpack_k_values(int qtype, const uint8_t *blk, __m512i idx, int paired, uint8_t *u) {
    const __m512i m4 = _mm512_set1_epi8(15), m1 = _mm512_set1_epi8(1), m2 = _mm512_set1_epi8(3);
    if (qtype == T_Q6_K) {
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            for (int i4 = 0; i4 < 8; i4++) {
                const __m512i a = GATHER(idx, ql + 4 * i4), b = GATHER(idx, ql + 32 + 4 * i4);
                const __m512i h = GATHER(idx, qh + 4 * i4);
                const int g = 32 * half + i4;
                STOREG(u, g, _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_slli_epi32(_mm512_and_si512(h, m2), 4)));
                STOREG(u, g + 8, _mm512_or_si512(_mm512_and_si512(b, m4),
                                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2), m2), 4)));
                STOREG(u, g + 16, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a, 4), m4),
                                                  _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 4), m2), 4)));
                STOREG(u, g + 24, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(b, 4), m4),
                                                  _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 6), m2), 4)));
            }
        }
        return;
    }
    const int five = qtype == T_Q5_K;
    const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
    for (int i4 = 0; i4 < 8; i4++) {
        const __m512i h = five ? GATHER(idx, qh + 4 * i4) : _mm512_setzero_si512();
        for (int m = 0; m < 4; m++) { /* natural chunks 2m (low nibbles) and 2m + 1 (high) */
            const __m512i v = GATHER(idx, qs + 32 * m + 4 * i4);
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
            if (five) {
                lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * m), m1), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * m + 1), m1), 4));
            }
            const int c0 = paired ? PAIRED[2 * m] : 2 * m, c1 = paired ? PAIRED[2 * m + 1] : 2 * m + 1;
            STOREG(u, 8 * c0 + i4, lo);
            STOREG(u, 8 * c1 + i4, hi);
        }
    }
}

/* 16 float16 values, the low (hi = 0) or high half of each int32 lane, as float32 (exact) */
static TGTZ inline __m512 f16_lanes(__m512i v, int hi) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hi ? _mm512_srli_epi32(v, 16) : v));
}

#define STOREI(p, i, v) _mm512_store_si512((void *)((p) + (size_t)(i) * GT), (v))
#define BYTE(v, i) _mm512_and_si512(_mm512_srli_epi32((v), 8 * (i)), _mm512_set1_epi32(255))

/* a K-quant block's scales (at x's positions), pairs for x's bsums (natural order), d and
 * dmin, per lane (row r of the tile): ggml's 6-bit scales and mins (scale_min), or Q6_K's
 * int8 scales, unpacked in the lanes */
static TGTZ void unpack_k_scalars(int qtype, int paired, const uint8_t *blk, __m512i idx, uint8_t *p) {
    int32_t *sc = (int32_t *)(void *)(p + KB_VALUES), *cp = sc + 16 * GT;
    float *d = (float *)(void *)(cp + 8 * GT);
    if (qtype == T_Q6_K) {
        __m512i s[16];
        for (int i = 0; i < 4; i++) {
            const __m512i v = GATHER(idx, blk + 192 + 4 * i);
            for (int j = 0; j < 4; j++) /* sign-extended byte j */
                s[4 * i + j] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24);
        }
        for (int t = 0; t < 16; t++) STOREI(sc, t, s[t]);
        const __m512i lo16 = _mm512_set1_epi32(0xffff);
        for (int i = 0; i < 8; i++) /* int16 pairs: 32 sc[2i], 32 sc[2i + 1] */
            STOREI(cp, i, _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(s[2 * i], 5), lo16),
                                          _mm512_slli_epi32(s[2 * i + 1], 21)));
        /* d is bytes 208, 209: read with the two before, inside the block */
        _mm512_store_ps(d, f16_lanes(GATHER(idx, blk + 206), 1));
        _mm512_store_ps(d + GT, _mm512_setzero_ps());
        return;
    }
    const __m512i a = GATHER(idx, blk + 4), b = GATHER(idx, blk + 8), c = GATHER(idx, blk + 12);
    const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
    for (int j = 0; j < 8; j++) {
        __m512i sj, mj;
        if (j < 4) {
            sj = _mm512_and_si512(BYTE(a, j), m63);
            mj = _mm512_and_si512(BYTE(b, j), m63);
        } else {
            const int i = j - 4;
            sj = _mm512_or_si512(_mm512_and_si512(BYTE(c, i), m15),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(BYTE(a, i), 6), m3), 4));
            mj = _mm512_or_si512(_mm512_srli_epi32(BYTE(c, i), 4),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(BYTE(b, i), 6), m3), 4));
        }
        STOREI(sc, paired ? PAIRED[j] : j, sj); /* the sub-block at x's position */
        STOREI(cp, j, _mm512_or_si512(mj, _mm512_slli_epi32(mj, 16))); /* min j: bsums 2j, 2j + 1 */
    }
    const __m512i dd = GATHER(idx, blk);
    _mm512_store_ps(d, f16_lanes(dd, 0));
    _mm512_store_ps(d + GT, f16_lanes(dd, 1));
}

/* MXFP4's values plus 12, looked up by nibble */
static const int8_t kv_mxfp4_u[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

static TGTZ void unpack_0_block(int qtype, const uint8_t *const *rows, const uint8_t *blk,
                                __m512i idx, int64_t off, uint8_t *u) {
    const __m512i m4 = _mm512_set1_epi8(15);
    float *d = (float *)(void *)(u + Q0 / 4 * GROUP_B);
    if (qtype == T_Q8_0) {
        for (int i4 = 0; i4 < 8; i4++)
            STOREG(u, i4, _mm512_xor_si512(GATHER(idx, blk + 2 + 4 * i4), _mm512_set1_epi8((char)0x80)));
    } else if (qtype == T_MXFP4) {
        const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)kv_mxfp4_u));
        for (int i4 = 0; i4 < 4; i4++) {
            const __m512i v = GATHER(idx, blk + 1 + 4 * i4);
            STOREG(u, i4, _mm512_shuffle_epi8(tab, _mm512_and_si512(v, m4)));
            STOREG(u, i4 + 4, _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi32(v, 4), m4)));
        }
    } else {
        const int five = qtype == T_Q5_0;
        const uint8_t *qs = blk + (five ? 6 : 2);
        const __m512i qh = five ? GATHER(idx, blk + 2) : _mm512_setzero_si512();
        const __m512i spread = _mm512_set1_epi32(0x00204081), ones = _mm512_set1_epi32(0x01010101);
        for (int i4 = 0; i4 < 4; i4++) {
            const __m512i v = GATHER(idx, qs + 4 * i4);
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), m4);
            if (five) { /* bits 4 i4 .. 4 i4 + 3 (and 16 more) of qh to bit 4 of each byte */
                const __m512i bl = _mm512_and_si512(_mm512_srli_epi32(qh, 4 * i4), _mm512_set1_epi32(15));
                const __m512i bh = _mm512_and_si512(_mm512_srli_epi32(qh, 16 + 4 * i4), _mm512_set1_epi32(15));
                lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_mullo_epi32(bl, spread), ones), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_mullo_epi32(bh, spread), ones), 4));
            }
            STOREG(u, i4, lo);
            STOREG(u, i4 + 4, hi);
        }
    }
    if (qtype != T_MXFP4) {
        _mm512_store_ps(d, f16_lanes(GATHER(idx, blk), 0));
        return;
    }
    for (int r = 0; r < GT; r++) d[r] = e8m0_half(rows[r][off]);
}

/* blocks ahead of the one being unpacked whose bytes are asked for (the gathers read 16 rows
 * at once, a pattern the hardware prefetcher does not follow) */
#define UNPACK_AHEAD 2

/* ask for the lines of bytes [p, p + n) */
static inline void prefetch_span(const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
    if (n > 0) _mm_prefetch((const char *)p + n - 1, _MM_HINT_T0);
}

/* Unpack rows[0 .. GT - 1] (each nb blocks of qtype; a short tile repeats its first row) */
static TGTZ void gemm_unpack(int qtype, int paired, const uint8_t *const *rows, int64_t nb, uint8_t *buf) {
    const int kq = qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K;
    const int64_t bs = block_bytes(qtype);
    int32_t rel[GT]; /* rows as offsets from row 0: the gathers' indices */
    for (int r = 0; r < GT; r++) rel[r] = (int32_t)(rows[r] - rows[0]);
    const __m512i idx = _mm512_loadu_si512((const void *)rel);
    for (int64_t b = 0; b < nb && b < UNPACK_AHEAD; b++)
        for (int r = 0; r < GT; r++) prefetch_span(rows[r] + b * bs, bs);
    for (int64_t b = 0; b < nb; b++) {
        if (b + UNPACK_AHEAD < nb)
            for (int r = 0; r < GT; r++) prefetch_span(rows[r] + (b + UNPACK_AHEAD) * bs, bs);
        if (kq) {
            uint8_t *p = buf + (size_t)b * KB_BYTES;
            unpack_k_values(qtype, rows[0] + b * bs, idx, paired, p);
            unpack_k_scalars(qtype, paired, rows[0] + b * bs, idx, p);
        } else {
            unpack_0_block(qtype, rows, rows[0] + b * bs, idx, b * bs, buf + (size_t)b * ZB_BYTES);
        }
    }
}

#define BCAST(p) _mm512_set1_epi32(*(const int32_t *)(const void *)(p))

/* a K-quant block's scalars in its unpacked tile: sub-block scales, pairs for x's bsums, d, dmin */
#define K_SC(u) ((const int32_t *)(const void *)((u) + KB_VALUES))
#define K_CP(u) (K_SC(u) + 16 * GT)
#define K_D(u) ((const float *)(const void *)(K_CP(u) + 8 * GT))

/* acc[j][0 .. 15] += the block of x rows x[j], j < NR, whose scaled sub-block sums are is[j]:
 * the mins' (or Q6_K's offsets') term from x's bsums, then combine_k, lane by lane */
static TGTZ inline __attribute__((always_inline)) void gemm_k_finish(
    int q6, const uint8_t *u, const xk_t *const *x, const __m512i *is, const int NR, float *acc) {
    const int32_t *cp = K_CP(u);
    const float *dd = K_D(u);
    __m512i im[16];
    for (int r = 0; r < NR; r++) im[r] = _mm512_setzero_si512();
    for (int i = 0; i < 8; i++) {
        const __m512i c = _mm512_load_si512((const void *)(cp + i * GT));
        for (int r = 0; r < NR; r++) im[r] = _mm512_dpwssd_epi32(im[r], c, BCAST(x[r]->bsums + 2 * i));
    }
    const __m512 d = _mm512_load_ps(dd), dmin = _mm512_load_ps(dd + GT);
    for (int r = 0; r < NR; r++) {
        __m512i isum = is[r], imin = im[r];
        if (q6) { /* Q6_K: the offsets' term comes off the sums, and it has no mins */
            isum = _mm512_sub_epi32(isum, imin);
            imin = _mm512_setzero_si512();
        }
        const __m512 t = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum)),
                                       _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(imin)));
        float *o = acc + r * GT;
        _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), _mm512_mul_ps(_mm512_set1_ps(x[r]->d), t)));
    }
}

/* acc[j][0 .. 15] += block b of the unpacked tile dotted with NR rows xs[j] of a K-quant's
 * activations (combine_k, lane by lane) */
static TGTZ inline __attribute__((always_inline)) void gemm_k_block(
    int q6, const uint8_t *buf, int64_t b, const xk_t *const *xs, const int NR, float *acc) {
    const int nsub = q6 ? 16 : 8, per = q6 ? 4 : 8; /* sub-blocks, groups per sub-block */
    const uint8_t *u = buf + (size_t)b * KB_BYTES;
    const int32_t *sc = K_SC(u);
    const xk_t *x[GR];
    __m512i is[GR];
    for (int r = 0; r < NR; r++) {
        x[r] = xs[r] + b;
        is[r] = _mm512_setzero_si512();
    }
    for (int s = 0; s < nsub; s++) {
        __m512i a[GR];
        for (int r = 0; r < NR; r++) a[r] = _mm512_setzero_si512();
        for (int gi = 0; gi < per; gi++) {
            const int g = s * per + gi;
            const __m512i wv = _mm512_load_si512((const void *)(u + (size_t)g * GROUP_B));
            for (int r = 0; r < NR; r++) a[r] = _mm512_dpbusd_epi32(a[r], wv, BCAST(x[r]->q + 4 * g));
        }
        const __m512i scv = _mm512_load_si512((const void *)(sc + s * GT));
        for (int r = 0; r < NR; r++) is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(a[r], scv));
    }
    gemm_k_finish(q6, u, x, is, NR, acc);
}

/* acc[j][0 .. 15] += the block b of x rows xs[j], j < NR, whose sums of u * x are a[j]: the
 * offset's term off * sum(x) taken off, then combine_0, lane by lane */
static TGTZ inline __attribute__((always_inline)) void gemm_0_finish(
    int32_t off, const uint8_t *u, int64_t b, const x0_t *const *xs, const __m512i *a, const int NR, float *acc) {
    const __m512 d = _mm512_load_ps((const float *)(const void *)(u + Q0 / 4 * GROUP_B));
    for (int r = 0; r < NR; r++) {
        const x0_t *x = xs[r] + b;
        const __m512i isum = _mm512_sub_epi32(a[r], _mm512_set1_epi32(off * x->sum));
        float *o = acc + r * GT;
        _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(x->d), d),
                                                                           _mm512_cvtepi32_ps(isum))));
    }
}

/* the same for the 32-value types (combine_0) */
static TGTZ inline __attribute__((always_inline)) void gemm_0_block(
    int32_t off, const uint8_t *buf, int64_t b, const x0_t *const *xs, const int NR, float *acc) {
    const uint8_t *u = buf + (size_t)b * ZB_BYTES;
    __m512i a[GR];
    for (int r = 0; r < NR; r++) a[r] = _mm512_setzero_si512();
    for (int g = 0; g < Q0 / 4; g++) {
        const __m512i wv = _mm512_load_si512((const void *)(u + (size_t)g * GROUP_B));
        for (int r = 0; r < NR; r++) a[r] = _mm512_dpbusd_epi32(a[r], wv, BCAST(xs[r][b].q + 4 * g));
    }
    gemm_0_finish(off, u, b, xs, a, NR, acc);
}

/* gemm_k_block / gemm_0_block on n < GR rows, n a constant in each case */
static TGTZ void gemm_block_rest(int kq, int q6, int32_t off, const uint8_t *buf, int64_t b,
                                 const void *const *xs, int n, float *acc) {
#define REST(N)                                                                         \
    case N:                                                                             \
        if (kq)                                                                         \
            gemm_k_block(q6, buf, b, (const xk_t *const *)xs, N, acc);                  \
        else                                                                            \
            gemm_0_block(off, buf, b, (const x0_t *const *)xs, N, acc);                 \
        return;
    _Static_assert(GR == 8, "one case per count of rows below GR");
    switch (n) {
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7)
    default: return;
    }
#undef REST
}

#ifdef QDOT_AMX
/* AMX (TGTA): 16 rows of x at a time against the unpacked tile, whose groups of one sub-block
 * are already a B tile (ks / 4 rows of 16 weight rows x 4 values); x's activations of the
 * sub-block are the A tile (16 rows of ks signed bytes, lda apart); TDPBSUD (signed x,
 * unsigned weights) leaves in C row j the 16 weight rows' exact sums that the vpdpbusd loop
 * gives in a[j], so the rest is the same code and the bits are the same.
 * Tiles: 0-3 = C (16 x 16 int32), 4-5 = A (16 x ks bytes), 6-7 = B (ks / 4 x 64 bytes); ks = 32
 * (the 32-value types' blocks, Q4_K's and Q5_K's sub-blocks). Four C tiles let four sub-blocks'
 * products run one behind the other instead of each waiting for the last one's store. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static TGTA void amx_config(int ks) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64;
    for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = (uint16_t)ks;
    for (int t = 6; t < 8; t++) c.rows[t] = (uint8_t)(ks / 4), c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* c[j * 16 + l] = sum over ks of a's row j (signed) times weight row l's values at u */
static TGTA inline __attribute__((always_inline)) void amx_dot(const int8_t *a, size_t lda, const uint8_t *u,
                                                                int32_t *c) {
    _tile_zero(0);
    _tile_loadd(4, a, (long)lda);
    _tile_loadd(6, u, GROUP_B);
    _tile_dpbsud(0, 4, 6);
    _tile_stored(0, c, 64);
}

/* amx_dot of 4 consecutive sub-blocks of ks = 32 values (a 32 bytes apart, u 8 groups apart):
 * c[i * 256 + j * 16 + l] for sub-block i */
static TGTA inline __attribute__((always_inline)) void amx_dot4(const int8_t *a, size_t lda, const uint8_t *u,
                                                                 int32_t *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a, (long)lda);
    _tile_loadd(6, u, GROUP_B);
    _tile_dpbsud(0, 4, 6);
    _tile_loadd(5, a + 32, (long)lda);
    _tile_loadd(7, u + 8 * GROUP_B, GROUP_B);
    _tile_dpbsud(1, 5, 7);
    _tile_loadd(4, a + 64, (long)lda);
    _tile_loadd(6, u + 16 * GROUP_B, GROUP_B);
    _tile_dpbsud(2, 4, 6);
    _tile_loadd(5, a + 96, (long)lda);
    _tile_loadd(7, u + 24 * GROUP_B, GROUP_B);
    _tile_dpbsud(3, 5, 7);
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* the distance between consecutive rows of xs[0 .. 15] where they are evenly spaced (a
 * matrix's rows, a prompt's pairs in order), so that the A tile is read in place; 0 where they
 * are not (an expert's tokens), so that each block's activations are copied (amx_rows) */
static int64_t amx_stride(const void *const *xs) {
    const ptrdiff_t step = (const char *)xs[1] - (const char *)xs[0];
    for (int j = 2; j < 16; j++)
        if ((const char *)xs[j] - (const char *)xs[j - 1] != step) return 0;
    return step > 0 ? (int64_t)step : 0;
}

/* where the q of block b of rows xs[0 .. 15] are, as one base and *lda: in place with stride,
 * else copied into stage */
static TGTA const int8_t *amx_rows(int kq, const void *const *xs, int64_t b, int64_t stride, int8_t *stage,
                                   size_t *lda) {
    const size_t bytes = kq ? QK : Q0;
    if (stride) {
        *lda = (size_t)stride;
        return kq ? ((const xk_t *)xs[0] + b)->q : ((const x0_t *)xs[0] + b)->q;
    }
    for (int j = 0; j < 16; j++)
        memcpy(stage + bytes * (size_t)j, kq ? ((const xk_t *)xs[j] + b)->q : ((const x0_t *)xs[j] + b)->q, bytes);
    *lda = bytes;
    return stage;
}

static TGTA void gemm_k_block_amx(const uint8_t *buf, int64_t b, const xk_t *const *xs, int64_t stride,
                                  int8_t *stage, int32_t *c, float *acc) { /* Q4_K, Q5_K: 8 sub-blocks of 32 */
    const int nsub = 8, per = 8, ks = 32;
    const uint8_t *u = buf + (size_t)b * KB_BYTES;
    const int32_t *sc = K_SC(u);
    size_t lda;
    const int8_t *a = amx_rows(1, (const void *const *)xs, b, stride, stage, &lda);
    const xk_t *x[16];
    __m512i is[16];
    for (int r = 0; r < 16; r++) {
        x[r] = xs[r] + b;
        is[r] = _mm512_setzero_si512();
    }
    for (int s0 = 0; s0 < nsub; s0 += 4) {
        amx_dot4(a + ks * s0, lda, u + (size_t)(s0 * per) * GROUP_B, c);
        for (int s = s0; s < s0 + 4; s++) { /* the sub-blocks in order, as the vpdpbusd loop adds them */
            const __m512i scv = _mm512_load_si512((const void *)(sc + s * GT));
            const int32_t *cs = c + 256 * (s - s0);
            for (int r = 0; r < 16; r++)
                is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(_mm512_load_si512((const void *)(cs + 16 * r)), scv));
        }
    }
    gemm_k_finish(0, u, x, is, 16, acc);
}

static TGTA void gemm_0_block_amx(int32_t off, const uint8_t *buf, int64_t b, const x0_t *const *xs,
                                  int64_t stride, int8_t *stage, int32_t *c, float *acc) {
    const uint8_t *u = buf + (size_t)b * ZB_BYTES;
    size_t lda;
    const int8_t *q = amx_rows(0, (const void *const *)xs, b, stride, stage, &lda);
    amx_dot(q, lda, u, c);
    __m512i a[16];
    for (int r = 0; r < 16; r++) a[r] = _mm512_load_si512((const void *)(c + 16 * r));
    gemm_0_finish(off, u, b, xs, a, 16, acc);
}
#endif

/* out + j * ldo [0 .. nr - 1] = the dots of the unpacked tile's rows with xs[j], j < nx <=
 * GEMM_CHUNK: block after block over all the rows, so that the block stays in L1; with amx,
 * 16 rows of x at a time through the AMX tiles (TDPBSUD), the rest through vpdpbusd */
static TGTA void gemm_tile(int qtype, int amx, const uint8_t *buf, int64_t nb, const void *const *xs,
                           int64_t nx, int nr, float *out, int64_t ldo) {
    const __mmask16 mask = (__mmask16)((1u << nr) - 1u);
    const int kq = qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K, q6 = qtype == T_Q6_K;
    const int32_t off = gemm_off(qtype);
    float acc[GEMM_CHUNK * GT] __attribute__((aligned(64))); /* [nx, GT] */
    memset(acc, 0, sizeof(float) * GT * (size_t)nx);
#ifdef QDOT_AMX
    int8_t stage[16 * QK] __attribute__((aligned(64)));
    int32_t c[4 * 16 * GT] __attribute__((aligned(64))); /* amx_dot4's four C tiles */
    /* not Q6_K: its 16-value sub-blocks make tiles too small to beat vpdpbusd (measured) */
    amx = amx && !q6 && nx >= 16;
    int64_t stride[GEMM_CHUNK / 16]; /* per group of 16 rows (amx_stride) */
    for (int64_t g = 0; amx && g < nx / 16; g++) stride[g] = amx_stride(xs + 16 * g);
    if (amx) amx_config(32);
#else
    (void)amx;
#endif
    for (int64_t b = 0; b < nb; b++) {
        int64_t j = 0;
#ifdef QDOT_AMX
        for (; amx && j + 16 <= nx; j += 16) {
            if (kq)
                gemm_k_block_amx(buf, b, (const xk_t *const *)(xs + j), stride[j / 16], stage, c, acc + j * GT);
            else
                gemm_0_block_amx(off, buf, b, (const x0_t *const *)(xs + j), stride[j / 16], stage, c, acc + j * GT);
        }
#endif
        for (; j + GR <= nx; j += GR) {
            if (kq)
                gemm_k_block(q6, buf, b, (const xk_t *const *)(xs + j), GR, acc + j * GT);
            else
                gemm_0_block(off, buf, b, (const x0_t *const *)(xs + j), GR, acc + j * GT);
        }
        if (j < nx) /* the last nx - j < GR rows in one pass: each weight load feeds them all */
            gemm_block_rest(kq, q6, off, buf, b, xs + j, (int)(nx - j), acc + j * GT);
    }
#ifdef QDOT_AMX
    if (amx) _tile_release();
#endif
    for (int64_t j = 0; j < nx; j++) _mm512_mask_storeu_ps(out + j * ldo, mask, _mm512_load_ps(acc + j * GT));
}

/* rows[r] of a tile of nr <= GT rows starting at w, each row_bytes long (a short tile repeats
 * its first row, whose outputs are not stored) */
static void tile_rows(const uint8_t *w, int64_t row_bytes, int nr, const uint8_t **rows) {
    for (int r = 0; r < GT; r++) rows[r] = w + (r < nr ? r : 0) * row_bytes;
}

/* out [n_x, n_rows] = x @ W.T from x's activations xq (n_x rows of xbytes, in the order
 * quantize_for gives) for W [n_rows, row_bytes] of qtype: tiles of GT weight rows, each unpacked
 * once per GEMM_CHUNK rows of x, shared out dynamically. Returns 0 or -3 (out of memory). */
static TGTZ int gemm_matmul(int qtype, int paired, int amx, const uint8_t *w, int64_t n_rows, int64_t row_bytes,
                            const char *xq, size_t xbytes, int64_t n_x, int64_t nb, float *out, int threads) {
    const int64_t tiles = (n_rows + GT - 1) / GT, chunks = (n_x + GEMM_CHUNK - 1) / GEMM_CHUNK;
    const size_t tile_n = gemm_tile_bytes(qtype, nb * (qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K ? QK : Q0));
    const void **xs = malloc(sizeof(void *) * (size_t)n_x + 1);
    if (!xs) return -3;
    for (int64_t j = 0; j < n_x; j++) xs[j] = xq + xbytes * (size_t)j;
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *buf = aligned_alloc(64, tile_n);
        int64_t have = -1; /* the tile unpacked in buf */
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tiles * chunks; i++) { /* chunk-major: the threads share x's chunk */
            if (!buf) continue;
            const int64_t c = i / tiles, t = i % tiles, n0 = t * GT, j0 = c * GEMM_CHUNK;
            const int nr = (int)(n_rows - n0 < GT ? n_rows - n0 : GT);
            if (have != t) {
                const uint8_t *rows[GT];
                tile_rows(w + n0 * row_bytes, row_bytes, nr, rows);
                gemm_unpack(qtype, paired, rows, nb, buf);
                have = t;
            }
            const int64_t nx = n_x - j0 < GEMM_CHUNK ? n_x - j0 : GEMM_CHUNK;
            gemm_tile(qtype, amx, buf, nb, xs + j0, nx, nr, out + j0 * n_rows + n0, n_rows);
        }
        free(buf);
    }
    free(xs);
    return failed ? -3 : 0;
}

#undef GATHER
#undef STOREG
#undef BCAST
#undef STOREI
#undef BYTE
#undef K_SC
#undef K_CP
#undef K_D
