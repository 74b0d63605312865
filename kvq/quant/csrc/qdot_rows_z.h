/* One row of x against 8 weight rows at a time (AVX512BW + VNNI), included by qdot.c after
 * qdot_q4k_z.h inside its 512-bit section (TGTZ, LDZ, LDY, PAIR, F16Z).
 *
 * A decode step is one row of x per matrix, where dot_q4_k_z and dot_q6_k_z reduced each
 * block's 16 int32 lanes to one integer, unpacked its scales through memory and combined it in
 * scalar float: about half of a block's time on one row. Here 8 weight rows go block by block
 * together: their lanes are reduced together (hsum8_vnni), the scales stay in registers, and
 * the combination runs in 8 float lanes, one per weight row, with combine_k's operations in its
 * order. The integers are the same sums and each row's float steps are the scalar path's, so
 * every output has the bits dot_q4_k_z and dot_q6_k_z give it. */

/* the 12 packed bytes at p (k_scales's layout) as bytes 0-7 the scales and 8-15 the mins;
 * reads 16 bytes (a Q4_K or Q5_K block has its values after them) */
static TGTZ inline __m128i k_scales_x(const uint8_t *p) {
    const __m128i u = _mm_loadu_si128((const __m128i *)(const void *)p);
    const __m128i a = _mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)), _mm_set_epi32(4, 0, 0, 0));
    const __m128i b = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0));
    const __m128i lo = _mm_and_si128(a, _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 6), _mm_set_epi32(0x03030303, 0, 0x03030303, 0));
    return _mm_or_si128(lo, _mm_slli_epi32(hi, 4));
}

/* int16 lanes taking byte `lo` of each 128-bit lane in the low 256 bits, byte `hi` in the high */
static TGTZ inline __m512i bytes16_z(int lo, int hi) {
    return PAIR(_mm256_set1_epi16((short)lo), _mm256_set1_epi16((short)hi));
}

/* the float16 at p + j * step for j < nr as float32 lanes (lanes past nr: the one at p) */
static TGTZ inline __m256 f16x8(const uint8_t *p, int64_t step, int nr) {
    uint16_t h[RZ];
    for (int j = 0; j < RZ; j++) memcpy(h + j, p + (j < nr ? j * step : 0), 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)h));
}

/* combine_k in 8 lanes, one weight row each: acc + dx * (d * isum - dmin * imin) */
static TGTZ inline __m256 combine_rows(__m256 acc, float dx, __m256 d, __m256 dmin, __m256i isum, __m256i imin) {
    const __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum));
    const __m256 b = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(imin));
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(dx), _mm256_sub_ps(a, b)));
}

#define RZB 32 /* blocks of a row per pass: is and im hold RZB x RZ x 32 bytes each */

/* one Q4_K block of one weight row against x's block (paired order): its isum and imin lanes */
static TGTZ inline void q4k_rows_block(const uint8_t *w, const __m512i xq[4], __m256i bsums, __m256i *is, __m256i *im) {
    const __m128i o = k_scales_x(w + 4);
    const __m512i v = _mm512_broadcast_i32x4(o);
    __m512i q[4];
    q4k_values_z(w, q);
    __m512i s = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) { /* the scales of paired chunks 2i and 2i + 1, zero-extended */
        const __m512i ctl = _mm512_or_si512(bytes16_z(PAIRED[2 * i], PAIRED[2 * i + 1]), _mm512_set1_epi16((short)0x8000));
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q[i], xq[i]), _mm512_shuffle_epi8(v, ctl));
    }
    *is = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    /* int16 lanes 2j and 2j + 1 = min j (mins_pairs_vnni) */
    const __m256i mctl = _mm256_set_epi8(-128, 15, -128, 15, -128, 14, -128, 14, -128, 13, -128, 13, -128, 12, -128, 12,
                                         -128, 11, -128, 11, -128, 10, -128, 10, -128, 9, -128, 9, -128, 8, -128, 8);
    *im = _mm256_madd_epi16(bsums, _mm256_shuffle_epi8(_mm512_castsi512_si256(v), mctl));
}

/* out[j] = dot_q4_k_z(w + j * rb, x, nb) for j < nr <= RZ. The weights are read in their order,
 * row after row (RZB blocks of a row at a time), as one row at a time reads them; each block's
 * lanes wait in `is` and `im` for the reduction and combination of the 8 rows together. */
static TGTZ void rdot_q4_k_z(const uint8_t *w, int64_t rb, int nr, const xk_t *x, int64_t nb, float *out) {
    __m256 acc = _mm256_setzero_ps();
    __m256i is[RZB][RZ], im[RZB][RZ];
    for (int64_t b0 = 0; b0 < nb; b0 += RZB) {
        const int nbc = (int)(nb - b0 < RZB ? nb - b0 : RZB);
        for (int j = 0; j < RZ; j++) {
            const uint8_t *p = w + j * rb + b0 * 144;
            for (int b = 0; b < nbc; b++, p += 144) {
                if (j >= nr) { /* lanes not returned */
                    is[b][j] = im[b][j] = _mm256_setzero_si256();
                    continue;
                }
                PREFETCH(p);
                const xk_t *xb = x + b0 + b;
                const __m512i xq[4] = {LDZ(xb->q), LDZ(xb->q + 64), LDZ(xb->q + 128), LDZ(xb->q + 192)};
                q4k_rows_block(p, xq, LDY(xb->bsums), &is[b][j], &im[b][j]);
            }
        }
        for (int b = 0; b < nbc; b++) {
            const uint8_t *p = w + (b0 + b) * 144;
            const __m256 d = f16x8(p, rb, nr), dmin = f16x8(p + 2, rb, nr);
            acc = combine_rows(acc, x[b0 + b].d, d, dmin, hsum8_vnni(is[b]), hsum8_vnni(im[b]));
        }
    }
    store_rows_vnni(acc, nr, out);
}

/* one Q6_K block of one weight row against x's block: its isum lanes, q6_offset taken off */
static TGTZ inline __m256i q6k_rows_block(const uint8_t *p, const xk_t *xb) {
    const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
    /* int16 lane j of a 64-value group takes the scale of its 16-value sub-block, j / 8 */
    const __m512i lo_idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                            1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i four = _mm512_set1_epi16(4), eight = _mm512_set1_epi16(8);
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(p + 192)));
    const __m512i sc16 = _mm512_castsi256_si512(sc);
    __m512i s = _mm512_setzero_si512();
    for (int half = 0; half < 2; half++) {
        const __m512i ql = LDZ(p + 64 * half);
        const __m256i qh = LDY(p + 128 + 32 * half);
        const __m512i h01 = PAIR(qh, _mm256_srli_epi16(qh, 2));
        const __m512i h23 = PAIR(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6));
        const __m512i q12 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(h01, m3), 4));
        const __m512i q34 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                            _mm512_slli_epi16(_mm512_and_si512(h23, m3), 4));
        const __m512i idx = half ? _mm512_add_epi16(lo_idx, eight) : lo_idx;
        const __m512i s12 = _mm512_permutexvar_epi16(idx, sc16);
        const __m512i s34 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, four), sc16);
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q12, LDZ(xb->q + 128 * half)), s12);
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q34, LDZ(xb->q + 128 * half + 64)), s34);
    }
    /* q6_offset: 32 * the sum of scale * bsum, exact in int32 */
    const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc, LDY(xb->bsums)), 5);
    return _mm256_sub_epi32(_mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1)), off);
}

/* out[j] = dot_q6_k_z(w + j * rb, x, nb) for j < nr <= RZ, read as rdot_q4_k_z reads */
static TGTZ void rdot_q6_k_z(const uint8_t *w, int64_t rb, int nr, const xk_t *x, int64_t nb, float *out) {
    __m256 acc = _mm256_setzero_ps();
    __m256i is[RZB][RZ];
    for (int64_t b0 = 0; b0 < nb; b0 += RZB) {
        const int nbc = (int)(nb - b0 < RZB ? nb - b0 : RZB);
        for (int j = 0; j < RZ; j++) {
            const uint8_t *p = w + j * rb + b0 * 210;
            for (int b = 0; b < nbc; b++, p += 210) {
                if (j >= nr) {
                    is[b][j] = _mm256_setzero_si256();
                    continue;
                }
                PREFETCH(p);
                is[b][j] = q6k_rows_block(p, x + b0 + b);
            }
        }
        for (int b = 0; b < nbc; b++) {
            const __m256 d = f16x8(w + (b0 + b) * 210 + 208, rb, nr);
            acc = combine_rows(acc, x[b0 + b].d, d, _mm256_setzero_ps(), hsum8_vnni(is[b]), _mm256_setzero_si256());
        }
    }
    store_rows_vnni(acc, nr, out);
}
