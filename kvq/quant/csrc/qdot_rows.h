/* One row of x against several matrices in one call (kvq.quant.qdot.matmul_one), included at
 * the end of qdot.c after qdot_moe.h.
 *
 *   out[m] = x @ W_m.T for m < n, x [k] float32, W_m [rows[m], k] of types[m]
 *
 * A decode step's attention projections (q, k and v) read one input: three kvq_qdot calls
 * were three quantizations of x, three parallel regions (each a futex wake of the other
 * threads) and three Python wrappers. Here x is quantized once per kind of block the types
 * take, and the rows of every matrix are one job of the pool (qdot_pool.h), RZ weight rows at a
 * time where the kernel has that form (qdot_rows_z.h). Each output is the dot product kvq_qdot computes for
 * it, by one thread: the same bits. */

#define ONE_MAX 8 /* matrices per call */

typedef struct { /* a call's matrices, their kernels, x's quantizations and the outputs */
    int n;
    const kern_t *kn;
    const rdot_k_fn *rk;
    const uint8_t *const *w;
    const int64_t *rows, *rb;
    const char *xq;
    const size_t *off;
    int64_t k;
    float *const *out;
    const int64_t *first;
} one_job;

/* group g of RZ rows: of the matrix whose groups hold it */
static void one_piece(void *c, int64_t g) {
    const one_job *j = (const one_job *)c;
    int m = 0;
    while (g >= j->first[m + 1]) m++;
    const int64_t r0 = (g - j->first[m]) * RZ, nr = j->rows[m] - r0 < RZ ? j->rows[m] - r0 : RZ;
    const uint8_t *wr = j->w[m] + r0 * j->rb[m];
    const char *xq = j->xq + j->off[m];
    if (j->rk[m]) {
        j->rk[m](wr, j->rb[m], (int)nr, (const xk_t *)(const void *)xq, j->k / QK, j->out[m] + r0);
        return;
    }
    for (int64_t r = 0; r < nr; r++) j->out[m][r0 + r] = kern_dot(&j->kn[m], wr + r * j->rb[m], xq, j->k);
}

/* Returns 0, or -1 (a type not covered, or n outside 1..ONE_MAX), -2 (k not a multiple of a
 * type's block), -3 (out of memory). */
int kvq_qdot_one(int n, const int *types, const uint8_t *const *w, const int64_t *rows, const int64_t *rb,
                 const float *x, int64_t k, float *const *out, int threads, int isa) {
    if (n < 1 || n > ONE_MAX) return -1;
    int best = kvq_qdot_best_isa();
    isa = (isa < 0 || isa > best) ? best : isa;
    kern_t kn[ONE_MAX];
    rdot_k_fn rk[ONE_MAX];
    size_t off[ONE_MAX], total = 0;
    int64_t first[ONE_MAX + 1]; /* matrix m's groups of RZ rows: first[m] .. first[m + 1] - 1 */
    first[0] = 0;
    for (int m = 0; m < n; m++) {
        if (kern_init(&kn[m], types[m], isa)) return -1;
        if (k % kn[m].block) return -2;
        rk[m] = kn[m].kq ? pick_rk(types[m], isa) : 0;
        off[m] = total; /* a quantization of x of its kind: an earlier one's where they share it */
        for (int e = 0; e < m; e++)
            if (kern_share_x(&kn[e], &kn[m])) {
                off[m] = off[e];
                break;
            }
        if (off[m] == total) total += kern_xbytes(&kn[m], k);
        first[m + 1] = first[m] + (rows[m] + RZ - 1) / RZ;
    }
    char *xq = malloc(total + 1);
    if (!xq) return -3;
    for (int m = 0; m < n; m++) {
        int made = 0;
        for (int e = 0; e < m; e++) made |= off[e] == off[m];
        if (!made) kern_quantize(&kn[m], x, k, xq + off[m]);
    }
    one_job job = {n, kn, rk, w, rows, rb, xq, off, k, out, first};
    pool_run(one_piece, &job, first[n], threads);
    free(xq);
    return 0;
}
