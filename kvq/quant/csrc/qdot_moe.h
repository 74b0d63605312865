/* One token's routed experts in one call (kvq.quant.qdot.moe), included at the end of qdot.c.
 *
 *   out = sum over e = 0..n-1 of w[e] * down_e(silu(gate_e x) * up_e x)
 *
 * for x [h] float32, gate_e and up_e [f, h] and down_e [h, f] in GGUF blocks. The decode path
 * of a MoE layer was three kvq_qdot calls per expert plus torch's SiLU, product and weighted
 * sum around them: about 25 Python calls and 24 OpenMP regions per layer for 8 experts. Here
 * it is one call and one region: x quantized once for every gate and up row, the expert
 * hidden states quantized in the region, and the sum taken there.
 *
 * Same bits on every path and thread count: each gate/up/down output is one dot product of
 * the kernels above (computed by one thread), SiLU and the products are the same float32
 * operations in every path, and each out[r] adds the experts in the order given,
 * acc = acc + w[e] * y[e], starting from 0 (what the torch loop it replaces does). */

typedef struct { /* one weight type's dot product and the activations' block */
    int kq;
    int64_t block;
    dot_k_fn fk;
    dot_0_fn f0;
} kern_t;

static int kern_init(kern_t *kn, int qtype, int isa) {
    kn->kq = qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K;
    if (!kn->kq && qtype != T_Q8_0 && qtype != T_Q4_0) return -1;
    kn->block = kn->kq ? QK : Q0;
    kn->fk = kn->kq ? pick_k(qtype, isa) : 0;
    kn->f0 = kn->kq ? 0 : pick_0(qtype, isa);
    return 0;
}

static size_t kern_xbytes(const kern_t *kn, int64_t k) {
    return (size_t)(k / kn->block) * (kn->kq ? sizeof(xk_t) : sizeof(x0_t));
}

static void kern_quantize(const kern_t *kn, const float *x, int64_t k, void *xq) {
    if (kn->kq)
        quantize_k(x, k, (xk_t *)xq);
    else
        quantize_0(x, k, (x0_t *)xq);
}

static inline float kern_dot(const kern_t *kn, const uint8_t *row, const void *xq, int64_t k) {
    int64_t nb = k / kn->block;
    return kn->kq ? kn->fk(row, (const xk_t *)xq, nb) : kn->f0(row, (const x0_t *)xq, nb);
}

/* shared by every path: the compiler sees one copy, so one rounding of expf */
static __attribute__((noinline)) float silu_mul(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

/* Returns 0, or -1 (a type not covered), -2 (h or f not a multiple of a type's block),
 * -3 (out of memory). gate, up, down: n pointers each to [rows, row bytes]; rb: row bytes of
 * gate, up and down; types: their ggml types. */
int kvq_qdot_moe(int n, const uint8_t *const *gate, const uint8_t *const *up,
                 const uint8_t *const *down, const int *types, const int64_t *rb, int64_t f,
                 int64_t h, const float *x, const float *w, float *out, int threads, int isa) {
    int best = kvq_qdot_best_isa();
    isa = (isa < 0 || isa > best) ? best : isa;
    kern_t kg, ku, kd;
    if (kern_init(&kg, types[0], isa) || kern_init(&ku, types[1], isa) || kern_init(&kd, types[2], isa))
        return -1;
    if (h % kg.block || h % ku.block || f % kd.block) return -2;
    if (n <= 0) {
        memset(out, 0, sizeof(float) * (size_t)h);
        return 0;
    }
    /* gate and up share x's quantization when their blocks are of one kind */
    const size_t xg_n = kern_xbytes(&kg, h), xu_n = ku.kq == kg.kq ? 0 : kern_xbytes(&ku, h);
    const size_t hq_n = kern_xbytes(&kd, f);
    const size_t hb_n = sizeof(float) * (size_t)(n * f), y_n = sizeof(float) * (size_t)(n * h);
    char *mem = malloc(xg_n + xu_n + hq_n * (size_t)n + hb_n + y_n + 64);
    if (!mem) return -3;
    /* float buffers first: every piece stays 4-byte aligned */
    float *hb = (float *)mem, *y = hb + n * f;
    char *xg = (char *)(y + n * h), *xu = xu_n ? xg + xg_n : xg, *hq = xg + xg_n + xu_n;
    kern_quantize(&kg, x, h, xg);
    if (xu_n) kern_quantize(&ku, x, h, xu);
    if (threads < 1) threads = 1;
    (void)threads;
    const int64_t nf = (int64_t)n * f, nh = (int64_t)n * h;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nf; i++) { /* [n, f]: expert i / f, row i % f */
            const int64_t e = i / f, r = i % f;
            const float g = kern_dot(&kg, gate[e] + r * rb[0], xg, h);
            const float u = kern_dot(&ku, up[e] + r * rb[1], xu, h);
            hb[i] = silu_mul(g, u);
        }
#pragma omp for schedule(static)
        for (int64_t e = 0; e < n; e++) kern_quantize(&kd, hb + e * f, f, hq + (size_t)e * hq_n);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nh; i++) { /* [n, h] */
            const int64_t e = i / h, r = i % h;
            y[i] = kern_dot(&kd, down[e] + r * rb[2], hq + (size_t)e * hq_n, f);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < h; r++) {
            float acc = 0.0f;
            for (int64_t e = 0; e < n; e++) acc = acc + w[e] * y[e * h + r];
            out[r] = acc;
        }
    }
    free(mem);
    return 0;
}
