/* Multi-row dots of one SIMD path (kvq_qdot_moe_batch), included at the end of qdot_simd.h
 * with its macros: out[j] = SFX(dot_*)(w, xs[j], nb), bit for bit, for j < nx <= MX. A block's
 * weights are unpacked into registers once and multiplied with every row; each row's integers
 * are the one-row function's (exact) and its combine_k / combine_0 the same call, block after
 * block. */

static TGT void SFX(mdot_q4_k)(const uint8_t *w, const void *const *xs, int nx, int64_t nb,
                               float *out) {
    const __m256i m4 = _mm256_set1_epi8(15);
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 144) {
        PREFETCH(w);
        uint8_t sc[8], mn[8];
        SFX(k_scales)(w + 4, sc, mn);
        __m256i q[8], s16[8]; /* the 32 values and the scale of x's q[32i .. 32i + 31] */
        for (int c = 0; c < 4; c++) {
            const __m256i v = LD(w + 16 + 32 * c);
            q[2 * c] = _mm256_and_si256(v, m4);
            q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        for (int i = 0; i < 8; i++) s16[i] = _mm256_set1_epi16(sc[i]);
        const float d = F16(w), dmin = F16(w + 2);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            __m256i s = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) s = _mm256_add_epi32(s, SCALED(q[i], LD(x->q + 32 * i), s16[i]));
            acc[j] = combine_k(acc[j], x->d, d, dmin, SFX(hsum)(s), SFX(k_mins)(mn, x->bsums));
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static TGT void SFX(mdot_q5_k)(const uint8_t *w, const void *const *xs, int nx, int64_t nb,
                               float *out) {
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 176) {
        PREFETCH(w);
        uint8_t sc[8], mn[8];
        SFX(k_scales)(w + 4, sc, mn);
        const __m256i qh = LD(w + 16);
        __m256i q[8], s16[8];
        for (int c = 0; c < 4; c++) {
            const __m256i v = LD(w + 48 + 32 * c);
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
            q[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_slli_epi16(h0, 4));
            q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                           _mm256_slli_epi16(h1, 4));
        }
        for (int i = 0; i < 8; i++) s16[i] = _mm256_set1_epi16(sc[i]);
        const float d = F16(w), dmin = F16(w + 2);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            __m256i s = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) s = _mm256_add_epi32(s, SCALED(q[i], LD(x->q + 32 * i), s16[i]));
            acc[j] = combine_k(acc[j], x->d, d, dmin, SFX(hsum)(s), SFX(k_mins)(mn, x->bsums));
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static TGT void SFX(mdot_q6_k)(const uint8_t *w, const void *const *xs, int nx, int64_t nb,
                               float *out) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    float acc[MX] = {0};
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
        const float d = F16(w + 208);
        for (int j = 0; j < nx; j++) {
            const xk_t *x = (const xk_t *)xs[j] + b;
            __m256i s = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) s = _mm256_add_epi32(s, SCALED(q[i], LD(x->q + 32 * i), s16[i]));
            const int32_t isum = SFX(hsum)(s) - 32 * SFX(hsum)(_mm256_madd_epi16(LD(x->bsums), sc16));
            acc[j] = combine_k(acc[j], x->d, d, 0.0f, isum, 0);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static TGT void SFX(mdot_q8_0)(const uint8_t *w, const void *const *xs, int nx, int64_t nb,
                               float *out) {
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 34) {
        const __m256i q = LD(w + 2), u = _mm256_sign_epi8(q, q);
        const float d = F16(w);
        for (int j = 0; j < nx; j++) {
            const x0_t *x = (const x0_t *)xs[j] + b;
            const __m256i p = MUL_SUM(u, _mm256_sign_epi8(LD(x->q), q));
            acc[j] = combine_0(acc[j], x->d, d, SFX(hsum)(p));
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}

static TGT void SFX(mdot_q4_0)(const uint8_t *w, const void *const *xs, int nx, int64_t nb,
                               float *out) {
    const __m128i m4 = _mm_set1_epi8(15);
    float acc[MX] = {0};
    for (int64_t b = 0; b < nb; b++, w += 18) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(w + 2));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
        const float d = F16(w);
        for (int j = 0; j < nx; j++) {
            const x0_t *x = (const x0_t *)xs[j] + b;
            acc[j] = combine_0(acc[j], x->d, d, SFX(hsum)(MUL_SUM(q, LD(x->q))) - 8 * x->sum);
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)nx);
}
