/* 512-bit Q4_K (AVX512BW + VNNI), included by qdot.c inside its 512-bit section (TGTZ, LDZ, F16Z).
 *
 * A 64-byte load of a Q4_K block's nibbles holds, in its low nibbles, values 0-31 and 64-95 of a
 * 128-value half, and in its high nibbles values 32-63 and 96-127. So that each 64-value group
 * meets its activations in one load, these kernels take the activations in the "paired" order
 * (quantize_k_paired): 32-value chunks 0, 2, 1, 3, 4, 6, 5, 7, with the bsums left in natural
 * order. The integers are the same sums, added in another order (exact), and the float part is
 * combine_k's, so the bits are the 256-bit path's. */

/* chunk c of the paired order holds the natural chunk PAIRED[c] */
static const int PAIRED[8] = {0, 2, 1, 3, 4, 6, 5, 7};

static void quantize_k_paired(int isa, const float *x, int64_t k, xk_t *out) {
    quantize_k(isa, x, k, out);
    for (int64_t b = 0; b < k / QK; b++) {
        int8_t nat[QK];
        memcpy(nat, out[b].q, QK);
        for (int c = 0; c < 8; c++) memcpy(out[b].q + 32 * c, nat + 32 * PAIRED[c], 32);
    }
}

/* s16[i]: the scales of paired chunks 2i (int16 lanes 0-15) and 2i + 1 (lanes 16-31) */
static TGTZ inline void q4k_scales_z(const uint8_t sc[8], __m512i s16[4]) {
    const __m512i v = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)sc)));
    for (int i = 0; i < 4; i++) {
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)PAIRED[2 * i])),
                                               _mm256_set1_epi16((short)PAIRED[2 * i + 1]), 1);
        s16[i] = _mm512_permutexvar_epi16(idx, v);
    }
}

/* the block's 256 values as 4 vectors in the paired order */
static TGTZ inline void q4k_values_z(const uint8_t *w, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i v0 = LDZ(w + 16), v1 = LDZ(w + 80);
    q[0] = _mm512_and_si512(v0, m4);
    q[1] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
    q[2] = _mm512_and_si512(v1, m4);
    q[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
}

/* sum over the 4 groups of scale * (values . activations), in 8 int32 lanes */
static TGTZ inline __m256i q4k_row_z(const __m512i q[4], const __m512i s16[4], const int8_t *xq) {
    __m512i s = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q[i], LDZ(xq + 64 * i)), s16[i]);
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

/* a block's mins, values and scales: what every row of it shares */
static TGTZ inline void q4k_block_z(const uint8_t *w, uint8_t mn[8], __m512i q[4], __m512i s16[4]) {
    uint8_t sc[8];
    k_scales_vnni(w + 4, sc, mn);
    q4k_values_z(w, q);
    q4k_scales_z(sc, s16);
}

static TGTZ float dot_q4_k_z(const uint8_t *w, const xk_t *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 144, x++) {
        PREFETCH(w);
        uint8_t mn[8];
        __m512i q[4], s16[4];
        q4k_block_z(w, mn, q, s16);
        acc = combine_k(acc, x->d, F16Z(w), F16Z(w + 2), hsum_vnni(q4k_row_z(q, s16, x->q)),
                        k_mins_vnni(mn, x->bsums));
    }
    return acc;
}

/* dot_q4_k_z on nx <= MX rows. Up to Q4K_FEW rows, each row's sums are reduced and combined
 * on their own, as dot_q4_k_z does; from there on the 8-lane reduction and combination of
 * qdot_simd_multi.h costs less per row (one thread, a 1024x2048 matrix in cache: 2 rows 0.080
 * against 0.100 ms, 3 rows 0.104 against 0.110, 4 rows 0.131 against 0.121). */
#define Q4K_FEW 3

static TGTZ void mdot_q4_k_z_few(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 144) {
        PREFETCH(w);
        uint8_t mn[8];
        __m512i q[4], s16[4];
        q4k_block_z(w, mn, q, s16);
        const float d = F16Z(w), dmin = F16Z(w + 2);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            acc[j] = combine_k(acc[j], x->d, d, dmin, hsum_vnni(q4k_row_z(q, s16, x->q)),
                               k_mins_vnni(mn, x->bsums));
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static TGTZ void mdot_q4_k_z(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    if (nx <= Q4K_FEW) {
        mdot_q4_k_z_few(w, xs, nx, nb, out);
        return;
    }
    /* qdot_simd_multi.h's mdot_q45_k, with these registers */
    static const xk_t zero; /* rows past nx read it: d = 0 and sums 0 fill lanes not returned */
    const xk_t *x0[8];
    for (int j = 0; j < 8; j++) x0[j] = j < nx ? (const xk_t *)xs[j] : &zero;
    __m256i is[8];
    for (int j = 0; j < 8; j++) is[j] = _mm256_setzero_si256();
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 144) {
        PREFETCH(w);
        uint8_t mn[8];
        __m512i q[4], s16[4];
        q4k_block_z(w, mn, q, s16);
        const __m256i mp = mins_pairs_vnni(mn);
        for (int j = 0; j < nx; j++) is[j] = q4k_row_z(q, s16, x0[j][b].q);
        __m256i isum, imin;
        if (nx <= 4) { /* isum and imin of 4 rows in one reduction: lanes 0-3 and 4-7 */
            for (int j = 0; j < 4; j++) is[4 + j] = _mm256_madd_epi16(LDY(x0[j][b].bsums), mp);
            isum = hsum8_vnni(is);
            imin = _mm256_permute2x128_si256(isum, isum, 0x11);
        } else {
            __m256i im[8];
            for (int j = 0; j < 8; j++) im[j] = _mm256_madd_epi16(LDY(x0[j][b].bsums), mp);
            isum = hsum8_vnni(is);
            imin = hsum8_vnni(im);
        }
        const __m256 dx = _mm256_set_ps(x0[7][b].d, x0[6][b].d, x0[5][b].d, x0[4][b].d,
                                        x0[3][b].d, x0[2][b].d, x0[1][b].d, x0[0][b].d);
        acc = combine_k8_vnni(acc, dx, F16Z(w), F16Z(w + 2), isum, imin);
    }
    store_rows_vnni(acc, nx, out);
}
