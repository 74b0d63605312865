/* The batched MoE call's many-row experts on the tile kernel (qdot_gemm.h), included by
 * qdot_moe.h before kvq_qdot_moe_batch on x86.
 *
 * An expert with gemm_min(type) pairs or more (a prompt's tokens routed to it) computes a tile of GT
 * weight rows for all of its pairs at once; one with fewer keeps the multi-row dots. Both give
 * every output the one-row bits, so which one an expert takes changes no result. */

typedef struct { /* one thread's buffers: the unpacked tiles and the gate and up outputs */
    uint8_t *g, *u, *d;
    float *go, *uo; /* [GEMM_CHUNK, GT] */
} moe_bufs_t;

/* whether kn's matrix takes the tile kernel for an expert of `pairs` pairs */
static int kern_tiles(const kern_t *kn, int64_t pairs) {
    return kn->isa >= ISA_AVX512 && gemm_covers(kn->qtype) && pairs >= gemm_min(kn->qtype);
}

static int moe_bufs_alloc(moe_bufs_t *b, const kern_t *kg, const kern_t *ku, const kern_t *kd,
                          int64_t h, int64_t f) {
    b->g = aligned_alloc(64, gemm_tile_bytes(kg->qtype, h));
    b->u = aligned_alloc(64, gemm_tile_bytes(ku->qtype, h));
    b->d = aligned_alloc(64, gemm_tile_bytes(kd->qtype, f));
    b->go = malloc(sizeof(float) * GEMM_CHUNK * GT);
    b->uo = malloc(sizeof(float) * GEMM_CHUNK * GT);
    return b->g && b->u && b->d && b->go && b->uo;
}

static void moe_bufs_free(moe_bufs_t *b) {
    free(b->g), free(b->u), free(b->d), free(b->go), free(b->uo);
}

/* hb[p, r0 .. r0 + nr - 1] for expert e's pairs p in [p_lo, p_hi): gate and up rows r0 .. of
 * the expert as tiles, each pair's activations at xg / xu + row[p] * their row bytes */
static void moe_tile_gate_up(moe_bufs_t *b, const kern_t *kg, const kern_t *ku, const uint8_t *gate,
                             const uint8_t *up, const int64_t *rb, int64_t r0, int nr, int64_t h,
                             int64_t f, const char *xg, size_t xg_row, const char *xu, size_t xu_row,
                             const int64_t *row, int64_t p_lo, int64_t p_hi, float *hb, int act,
                             const float *const *bias, int64_t e) {
    const uint8_t *rows[GT];
    tile_rows(gate + r0 * rb[0], rb[0], nr, rows);
    gemm_unpack(kg->qtype, k_paired(kg->qtype, kg->isa), rows, h / kg->block, b->g);
    tile_rows(up + r0 * rb[1], rb[1], nr, rows);
    gemm_unpack(ku->qtype, k_paired(ku->qtype, ku->isa), rows, h / ku->block, b->u);
    for (int64_t p0 = p_lo; p0 < p_hi; p0 += GEMM_CHUNK) {
        const int64_t nx = p_hi - p0 < GEMM_CHUNK ? p_hi - p0 : GEMM_CHUNK;
        const void *xsg[GEMM_CHUNK], *xsu[GEMM_CHUNK];
        for (int64_t j = 0; j < nx; j++) {
            xsg[j] = xg + xg_row * (size_t)row[p0 + j];
            xsu[j] = xu + xu_row * (size_t)row[p0 + j];
        }
        gemm_tile(kg->qtype, kg->isa == ISA_AMX, b->g, h / kg->block, xsg, nx, nr, b->go, GT);
        gemm_tile(ku->qtype, ku->isa == ISA_AMX, b->u, h / ku->block, xsu, nx, nr, b->uo, GT);
        for (int64_t j = 0; j < nx; j++)
            for (int l = 0; l < nr; l++)
                hb[(p0 + j) * f + r0 + l] = moe_hidden(b->go[j * GT + l], b->uo[j * GT + l], act, bias, e, r0 + l);
    }
}

/* y[p, r0 .. r0 + nr - 1] for expert e's pairs p in [p_lo, p_hi): down rows r0 .. as a tile,
 * pair p's hidden activations at hq + p * hq_row */
static void moe_tile_down(moe_bufs_t *b, const kern_t *kd, const uint8_t *down, int64_t rb, int64_t r0,
                          int nr, int64_t h, int64_t f, const char *hq, size_t hq_row, int64_t p_lo,
                          int64_t p_hi, float *y, const float *const *bias, int64_t e) {
    const uint8_t *rows[GT];
    tile_rows(down + r0 * rb, rb, nr, rows);
    gemm_unpack(kd->qtype, k_paired(kd->qtype, kd->isa), rows, f / kd->block, b->d);
    for (int64_t p0 = p_lo; p0 < p_hi; p0 += GEMM_CHUNK) {
        const int64_t nx = p_hi - p0 < GEMM_CHUNK ? p_hi - p0 : GEMM_CHUNK;
        const void *xs[GEMM_CHUNK];
        for (int64_t j = 0; j < nx; j++) xs[j] = hq + hq_row * (size_t)(p0 + j);
        gemm_tile(kd->qtype, kd->isa == ISA_AMX, b->d, f / kd->block, xs, nx, nr, y + p0 * h + r0, h);
        if (bias)
            for (int64_t j = 0; j < nx; j++)
                for (int l = 0; l < nr; l++) y[(p0 + j) * h + r0 + l] = moe_out(y[(p0 + j) * h + r0 + l], bias, e, r0 + l);
    }
}
