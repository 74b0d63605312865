/* One row of x against several matrices in one call (kvq.quant.qdot.matmul_one), included at
 * the end of qdot.c after qdot_moe.h.
 *
 *   out[m] = x @ W_m.T for m < n, x [k] float32, W_m [rows[m], k] of types[m]
 *
 * A decode step's attention projections (q, k and v) read one input: three kvq_qdot calls
 * were three quantizations of x, three parallel regions (each a futex wake of the other
 * threads) and three Python wrappers. Here x is quantized once per kind of block the types
 * take, and the rows of every matrix share one region, RZ weight rows at a time where the
 * kernel has that form (qdot_rows_z.h). Each output is the dot product kvq_qdot computes for
 * it, by one thread: the same bits. */

#define ONE_MAX 8 /* matrices per call */

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
    if (threads < 1) threads = 1;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < first[n]; g++) {
        int m = 0;
        while (g >= first[m + 1]) m++;
        const int64_t r0 = (g - first[m]) * RZ, nr = rows[m] - r0 < RZ ? rows[m] - r0 : RZ;
        const uint8_t *wr = w[m] + r0 * rb[m];
        if (rk[m]) {
            rk[m](wr, rb[m], (int)nr, (const xk_t *)(const void *)(xq + off[m]), k / QK, out[m] + r0);
            continue;
        }
        for (int64_t j = 0; j < nr; j++) out[m][r0 + j] = kern_dot(&kn[m], wr + j * rb[m], xq + off[m], k);
    }
    free(xq);
    return 0;
}
