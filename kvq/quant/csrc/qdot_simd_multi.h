/* Multi-row dots of one SIMD path (kvq_qdot_moe_batch), included at the end of qdot_simd.h
 * with its macros: out[j] = SFX(dot_*)(w, xs[j], nb), bit for bit, for j < nx <= MX. A block's
 * weights are unpacked into registers once and multiplied with every row; each row's integers
 * are the one-row function's (exact: any order of exact additions gives them), and the float
 * combination runs 8 rows wide with the same operations in the same order as combine_k /
 * combine_0 (lane j computes what the one-row call does for row j), block after block.
 * Also uses DPW(acc, p, sc): acc + the pairwise products of the int16 p and sc (vpdpwssd, or
 * vpmaddwd + vpaddd). */

/* lane j = the sum of v[j]'s 8 lanes */
static TGT inline __m256i SFX(hsum8)(const __m256i *v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* combine_k in 8 lanes */
static TGT inline __m256 SFX(combine_k8)(__m256 acc, __m256 dx, float d, float dmin, __m256i isum,
                                         __m256i imin) {
    const __m256 a = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum));
    const __m256 b = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(imin));
    return _mm256_add_ps(acc, _mm256_mul_ps(dx, _mm256_sub_ps(a, b)));
}

/* combine_0 in 8 lanes */
static TGT inline __m256 SFX(combine_08)(__m256 acc, __m256 dx, float d, __m256i isum) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dx, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(isum)));
}

static TGT inline void SFX(store_rows)(__m256 acc, int nx, float *out) {
    float a[8];
    _mm256_storeu_ps(a, acc);
    memcpy(out, a, sizeof(float) * (size_t)nx);
}

/* s16[i] = sc[i] in every int16 lane */
static TGT inline void SFX(bcast16)(const uint8_t sc[8], __m256i *s16) {
    const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)sc));
    const __m256i b = _mm256_broadcastsi128_si256(v);
    for (int i = 0; i < 8; i++) s16[i] = _mm256_shuffle_epi8(b, _mm256_set1_epi16((short)(0x0100 + 0x0202 * i)));
}

/* int16 lanes 2j and 2j + 1 = mn[j]: vpmaddwd with the bsums gives mn[j] * (bsums[2j] + bsums[2j + 1]) */
static TGT inline __m256i SFX(mins_pairs)(const uint8_t mn[8]) {
    const __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)mn));
    return _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
}

/* Q4_K (five = 0) and Q5_K (five = 1) */
static TGT inline __attribute__((always_inline)) void SFX(mdot_q45_k)(const uint8_t *w, const void *const *xs, int nx, int64_t nb,
                                       float *out, int five) {
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const int64_t size = five ? 176 : 144;
    static const xk_t zero; /* rows past nx read it: d = 0 and sums 0 fill lanes not returned */
    const xk_t *x0[8];
    for (int j = 0; j < 8; j++) x0[j] = j < nx ? (const xk_t *)xs[j] : &zero;
    __m256i is[8];
    for (int j = 0; j < 8; j++) is[j] = _mm256_setzero_si256();
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += size) {
        PREFETCH(w);
        uint8_t sc[8], mn[8];
        SFX(k_scales)(w + 4, sc, mn);
        __m256i q[8], s16[8]; /* the 32 values and the scale of x's q[32i .. 32i + 31] */
        const __m256i qh = five ? LD(w + 16) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = LD(w + (five ? 48 : 16) + 32 * c);
            q[2 * c] = _mm256_and_si256(v, m4);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
                const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
                q[2 * c] = _mm256_or_si256(q[2 * c], _mm256_slli_epi16(h0, 4));
                q[2 * c + 1] = _mm256_or_si256(q[2 * c + 1], _mm256_slli_epi16(h1, 4));
            }
        }
        SFX(bcast16)(sc, s16);
        const __m256i mp = SFX(mins_pairs)(mn);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = x0[j] + b;
            __m256i s = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) s = DPW(s, _mm256_maddubs_epi16(q[i], LD(x->q + 32 * i)), s16[i]);
            is[j] = s;
        }
        __m256i isum, imin;
        if (nx <= 4) { /* isum and imin of 4 rows in one reduction: lanes 0-3 and 4-7 */
            for (int j = 0; j < 4; j++) is[4 + j] = _mm256_madd_epi16(LD(x0[j][b].bsums), mp);
            isum = SFX(hsum8)(is);
            imin = _mm256_permute2x128_si256(isum, isum, 0x11);
        } else {
            __m256i im[8];
            for (int j = 0; j < 8; j++) im[j] = _mm256_madd_epi16(LD(x0[j][b].bsums), mp);
            isum = SFX(hsum8)(is);
            imin = SFX(hsum8)(im);
        }
        const __m256 dx = _mm256_set_ps(x0[7][b].d, x0[6][b].d, x0[5][b].d, x0[4][b].d,
                                        x0[3][b].d, x0[2][b].d, x0[1][b].d, x0[0][b].d);
        acc = SFX(combine_k8)(acc, dx, F16(w), F16(w + 2), isum, imin);
    }
    SFX(store_rows)(acc, nx, out);
}

static TGT void SFX(mdot_q4_k)(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    SFX(mdot_q45_k)(w, xs, nx, nb, out, 0);
}

static TGT void SFX(mdot_q5_k)(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    SFX(mdot_q45_k)(w, xs, nx, nb, out, 1);
}

static TGT void SFX(mdot_q6_k)(const uint8_t *w, const void *const *xs, int nx, int64_t nb, float *out) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    __m256i is[8];
    for (int j = nx; j < 8; j++) is[j] = _mm256_setzero_si256();
    float dx[8] = {0};
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        PREFETCH(w);
        const int8_t *sc = (const int8_t *)(w + 192);
        __m256i q[8], s16[8]; /* x's q[32i .. 32i + 31]: values and the scales of its two sub-blocks */
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = LD(w + 64 * half), ql1 = LD(w + 64 * half + 32);
            const __m256i qh = LD(w + 128 + 32 * half);
            const int8_t *hs = sc + 8 * half;
            __m256i *o = q + 4 * half;
            o[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            o[1] = _mm256_or_si256(
                _mm256_and_si256(ql1, m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            o[2] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            o[3] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            for (int g = 0; g < 4; g++) s16[4 * half + g] = Q6_SCALES(hs, 2 * g);
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)sc));
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            __m256i s = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) s = DPW(s, _mm256_maddubs_epi16(q[i], LD(x->q + 32 * i)), s16[i]);
            /* minus the -32 offset, 32 * sum_t scale_t * bsums_t, lane by lane */
            is[j] = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(LD(x->bsums), sc16), 5));
            dx[j] = x->d;
        }
        acc = SFX(combine_k8)(acc, _mm256_loadu_ps(dx), F16(w + 208), 0.0f, SFX(hsum8)(is),
                              _mm256_setzero_si256());
    }
    SFX(store_rows)(acc, nx, out);
}
