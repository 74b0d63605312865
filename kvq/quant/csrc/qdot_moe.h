/* One token's routed experts in one call (kvq.quant.qdot.moe), included at the end of qdot.c.
 *
 *   out = sum over e = 0..n-1 of w[e] * down_e(silu(gate_e x) * up_e x)
 *
 * or, with `act` 1 and biases (gpt-oss), w[e] * (down_e(swiglu_oai(gate_e x + bg_e,
 * up_e x + bu_e)) + bd_e): `bias` then holds 3n float32 vectors, expert e's gate, up and down
 * biases at 3e, 3e + 1 and 3e + 2 (NULL: none).
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
    int qtype, isa; /* which kernel, on which instruction set (clamped) */
    int64_t block;
    dot_k_fn fk;
    dot_0_fn f0;
    mdot_k_fn mk; /* the same dots on up to MX rows at once (kvq_qdot_moe_batch) */
    mdot_0_fn m0;
#ifdef QDOT_ARM_EXT
    mdot2_fn m2; /* and on two weight rows at once (i8mm), or NULL */
#endif
} kern_t;

static int kern_init(kern_t *kn, int qtype, int isa) {
    kn->kq = qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K;
    kn->qtype = qtype;
    kn->isa = isa;
    if (!kn->kq && !is_q0(qtype)) return -1;
    kn->block = kn->kq ? QK : Q0;
    const k_pick pk = kn->kq ? pick_k(qtype, isa) : (k_pick){0, 0};
    const q0_pick p0 = kn->kq ? (q0_pick){0, 0} : pick_0(qtype, isa);
    kn->fk = pk.one, kn->mk = pk.many;
    kn->f0 = p0.one, kn->m0 = p0.many;
#ifdef QDOT_ARM_EXT
    kn->m2 = isa == ISA_I8MM ? pick_m2(qtype) : 0;
#endif
    return 0;
}

static size_t kern_xbytes(const kern_t *kn, int64_t k) {
    return (size_t)(k / kn->block) * (kn->kq ? sizeof(xk_t) : sizeof(x0_t));
}

static void kern_quantize(const kern_t *kn, const float *x, int64_t k, void *xq) {
    if (kn->kq)
        quantize_for(kn->qtype, kn->isa, x, k, (xk_t *)xq);
    else
        quantize_0(kn->isa, x, k, (x0_t *)xq);
}

/* whether a and b read one quantization of x */
static int kern_share_x(const kern_t *a, const kern_t *b) {
    return a->kq == b->kq && k_paired(a->qtype, a->isa) == k_paired(b->qtype, b->isa);
}

static inline float kern_dot(const kern_t *kn, const uint8_t *row, const void *xq, int64_t k) {
    int64_t nb = k / kn->block;
    return kn->kq ? kn->fk(row, (const xk_t *)xq, nb) : kn->f0(row, (const x0_t *)xq, nb);
}

/* out[j] = kern_dot(kn, row, xs[j], k) for j < nx <= MX */
static inline void kern_mdot(const kern_t *kn, const uint8_t *row, const void *const *xs, int nx,
                             int64_t k, float *out) {
    int64_t nb = k / kn->block;
    if (nx == 1)
        out[0] = kern_dot(kn, row, xs[0], k);
    else if (kn->kq)
        kn->mk(row, xs, nx, nb, out);
    else
        kn->m0(row, xs, nx, nb, out);
}

/* kern_mdot of weight row `row` into out0 and, where `two`, of the row `stride` bytes after it
 * into out1 (at once on i8mm) */
static inline void kern_mdot2(const kern_t *kn, const uint8_t *row, int64_t stride, int two,
                              const void *const *xs, int nx, int64_t k, float *out0, float *out1) {
#ifdef QDOT_ARM_EXT
    if (two && kn->m2) {
        kn->m2(row, row + stride, xs, nx, k / kn->block, out0, out1);
        return;
    }
#endif
    kern_mdot(kn, row, xs, nx, k, out0);
    if (two) kern_mdot(kn, row + stride, xs, nx, k, out1);
}

/* out[j] = kern_dot(kn, w + j * rb, xq, k) for j < nr <= RZ: RZ rows at a time where rk
 * (pick_rk's) has that form */
static inline void moe_rows(const kern_t *kn, rdot_k_fn rk, const uint8_t *w, int64_t rb, int nr,
                            const void *xq, int64_t k, float *out) {
    if (rk) {
        rk(w, rb, nr, (const xk_t *)xq, k / QK, out);
        return;
    }
    for (int j = 0; j < nr; j++) out[j] = kern_dot(kn, w + j * rb, xq, k);
}

/* shared by every path: the compiler sees one copy, so one rounding of expf */
static __attribute__((noinline)) float silu_mul(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

/* gpt-oss's clamped SwiGLU: min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1) */
static __attribute__((noinline)) float swiglu_oai(float g, float u) {
    const float x = g < 7.0f ? g : 7.0f, y = u < -7.0f ? -7.0f : (u > 7.0f ? 7.0f : u);
    return x / (1.0f + expf(-1.702f * x)) * (y + 1.0f);
}

/* the hidden value of gate output g and up output u of row r of expert e */
static inline float moe_hidden(float g, float u, int act, const float *const *bias, int64_t e,
                               int64_t r) {
    if (bias) {
        g = g + bias[3 * e][r];
        u = u + bias[3 * e + 1][r];
    }
    return act ? swiglu_oai(g, u) : silu_mul(g, u);
}

static inline float moe_out(float y, const float *const *bias, int64_t e, int64_t r) {
    return bias ? y + bias[3 * e + 2][r] : y;
}

/* The gate, up and down kernels for `types` on `isa` (clamped to the best this CPU has):
 * 0, -1 (a type not covered) or -2 (h or f not a multiple of a type's block). */
static int moe_kerns(const int *types, int isa, int64_t h, int64_t f, kern_t *kg, kern_t *ku,
                     kern_t *kd) {
    isa = clamp_isa(isa);
    if (kern_init(kg, types[0], isa) || kern_init(ku, types[1], isa) || kern_init(kd, types[2], isa))
        return -1;
    return (h % kg->block || h % ku->block || f % kd->block) ? -2 : 0;
}

/* Returns 0, or -1 (a type not covered), -2 (h or f not a multiple of a type's block),
 * -3 (out of memory). gate, up, down: n pointers each to [rows, row bytes]; rb: row bytes of
 * gate, up and down; types: their ggml types. */
int kvq_qdot_moe(int n, const uint8_t *const *gate, const uint8_t *const *up,
                 const uint8_t *const *down, const int *types, const int64_t *rb, int64_t f,
                 int64_t h, const float *x, const float *w, float *out, int threads, int isa,
                 int act, const float *const *bias) {
    kern_t kg, ku, kd;
    const int bad = moe_kerns(types, isa, h, f, &kg, &ku, &kd);
    if (bad) return bad;
    if (n <= 0) {
        memset(out, 0, sizeof(float) * (size_t)h);
        return 0;
    }
    /* gate and up share x's quantization when their blocks and orders are of one kind */
    const size_t xg_n = kern_xbytes(&kg, h), xu_n = kern_share_x(&kg, &ku) ? 0 : kern_xbytes(&ku, h);
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
    const rdot_k_fn rg = pick_rk(kg.qtype, kg.isa), ru = pick_rk(ku.qtype, ku.isa), rd = pick_rk(kd.qtype, kd.isa);
    const int64_t gf = (f + RZ - 1) / RZ, gh = (h + RZ - 1) / RZ; /* groups of RZ rows per expert */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n * gf; i++) { /* [n, f] in groups: expert i / gf */
            const int64_t e = i / gf, r0 = (i % gf) * RZ, nr = f - r0 < RZ ? f - r0 : RZ;
            float g[RZ], u[RZ];
            moe_rows(&kg, rg, gate[e] + r0 * rb[0], rb[0], (int)nr, xg, h, g);
            moe_rows(&ku, ru, up[e] + r0 * rb[1], rb[1], (int)nr, xu, h, u);
            for (int64_t j = 0; j < nr; j++) hb[e * f + r0 + j] = moe_hidden(g[j], u[j], act, bias, e, r0 + j);
        }
#pragma omp for schedule(static)
        for (int64_t e = 0; e < n; e++) kern_quantize(&kd, hb + e * f, f, hq + (size_t)e * hq_n);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n * gh; i++) { /* [n, h] in groups */
            const int64_t e = i / gh, r0 = (i % gh) * RZ, nr = h - r0 < RZ ? h - r0 : RZ;
            float d[RZ];
            moe_rows(&kd, rd, down[e] + r0 * rb[2], rb[2], (int)nr, hq + (size_t)e * hq_n, f, d);
            for (int64_t j = 0; j < nr; j++) y[e * h + r0 + j] = moe_out(d[j], bias, e, r0 + j);
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

/* ---- a batch of tokens (kvq.quant.qdot.moe_batch) ------------------------------------------
 *
 *   out[t] = sum over token t's pairs p, in order, of w[p] * down_e(silu(gate_e x[t]) * up_e x[t])
 *
 * for x [T, h] and n distinct experts, expert e taking the pairs start[e] .. start[e + 1] - 1
 * (pair p: token row[p], weight w[p]). Each weight row of an expert is unpacked once for all of
 * its pairs (the multi-row dots, MX pairs at a time) instead of once per token: 8 sequences of
 * the olmoe preset send about 64 pairs to about 30 experts per layer.
 *
 * Same bits as kvq_qdot_moe on each token alone, its experts in the same order: x[t] is
 * quantized as there, every gate/up/down output is that call's dot product (the multi-row dots
 * give the one-row bits), the hidden state is quantized per pair, and out[t, r] adds token t's
 * terms from 0 in pair order, which is the order of the experts. So a token's result depends
 * neither on the other tokens of its batch nor on the path, the thread count or the schedule.
 * Returns what kvq_qdot_moe does, or -4 (start not ascending from 0, or a row outside [0, T)). */

/* weight rows per scheduled piece: experts' pair counts differ, so a static split is uneven
 * (dynamic pieces of 64 rows: the call 9-12% faster at 8 sequences of the olmoe preset) */
#define MOE_ROWS 64
#define MOE_TILE 16 /* weight rows per scheduled unit: the tile kernel's GT */

#ifdef QDOT_X86
_Static_assert(MOE_TILE == GT, "a MoE tile is one tile of the tile kernel");
#include "qdot_moe_gemm.h"
#endif

static int pairs_valid(int n, const int64_t *start, const int64_t *row, int64_t t) {
    if (start[0] != 0) return 0;
    for (int e = 0; e < n; e++)
        if (start[e + 1] < start[e]) return 0;
    for (int64_t p = 0; p < start[n]; p++)
        if (row[p] < 0 || row[p] >= t) return 0;
    return 1;
}

/* token i's pairs, ascending: tpair[tstart[i] .. tstart[i + 1] - 1] */
static void pairs_by_token(int64_t m, const int64_t *row, int64_t t, int64_t *tstart, int64_t *tpair) {
    memset(tstart, 0, sizeof(int64_t) * (size_t)(t + 1));
    for (int64_t p = 0; p < m; p++) tstart[row[p] + 1]++;
    for (int64_t i = 0; i < t; i++) tstart[i + 1] += tstart[i];
    for (int64_t p = 0; p < m; p++) tpair[tstart[row[p]]++] = p;
    for (int64_t i = t; i > 0; i--) tstart[i] = tstart[i - 1];
    tstart[0] = 0;
}

int kvq_qdot_moe_batch(int n, const uint8_t *const *gate, const uint8_t *const *up,
                       const uint8_t *const *down, const int *types, const int64_t *rb, int64_t f,
                       int64_t h, int64_t t, const float *x, const int64_t *start,
                       const int64_t *row, const float *w, float *out, int threads, int isa,
                       int act, const float *const *bias) {
    kern_t kg, ku, kd;
    const int bad = moe_kerns(types, isa, h, f, &kg, &ku, &kd);
    if (bad) return bad;
    if (n < 0 || t < 0 || (n > 0 && !pairs_valid(n, start, row, t))) return -4;
    const int64_t m = n > 0 ? start[n] : 0;
    if (m == 0) {
        memset(out, 0, sizeof(float) * (size_t)(t * h));
        return 0;
    }
    const size_t xg_n = kern_xbytes(&kg, h), xu_n = kern_share_x(&kg, &ku) ? 0 : kern_xbytes(&ku, h);
    const size_t hq_n = kern_xbytes(&kd, f);
    const size_t ix_n = sizeof(int64_t) * (size_t)(t + 1 + m);
    const size_t fl_n = sizeof(float) * (size_t)(m * f + m * h);
    char *mem = malloc(ix_n + fl_n + (xg_n + xu_n) * (size_t)t + hq_n * (size_t)m + 64);
    if (!mem) return -3;
    /* int64 first, then floats: every piece stays aligned to its type */
    int64_t *tstart = (int64_t *)mem, *tpair = tstart + t + 1;
    float *hb = (float *)(mem + ix_n), *y = hb + m * f; /* [m, f], [m, h] */
    char *xg = mem + ix_n + fl_n, *hq = xg + (xg_n + xu_n) * (size_t)t;
    char *xu = xu_n ? xg + xg_n * (size_t)t : xg;
    const size_t xu_row = xu_n ? xu_n : xg_n;
    pairs_by_token(m, row, t, tstart, tpair);
    if (threads < 1) threads = 1;
    (void)threads;
    const int64_t tf = (f + MOE_TILE - 1) / MOE_TILE, th = (h + MOE_TILE - 1) / MOE_TILE;
#ifdef QDOT_X86
    int64_t most = 0; /* the most pairs of one expert: whether any takes the tile kernel */
    for (int e = 0; e < n; e++) most = start[e + 1] - start[e] > most ? start[e + 1] - start[e] : most;
    const int want_tiles = kern_tiles(&kg, most) || kern_tiles(&kd, most);
#endif
#pragma omp parallel num_threads(threads)
    {
#ifdef QDOT_X86
        moe_bufs_t bufs = {0};
        /* without its buffers a thread keeps the multi-row dots: the same bits */
        const int tiles_ok = want_tiles && moe_bufs_alloc(&bufs, &kg, &ku, &kd, h, f);
#endif
#pragma omp for schedule(static)
        for (int64_t i = 0; i < t; i++) {
            kern_quantize(&kg, x + i * h, h, xg + xg_n * (size_t)i);
            if (xu_n) kern_quantize(&ku, x + i * h, h, xu + xu_n * (size_t)i);
        }
#pragma omp for schedule(dynamic, MOE_ROWS / MOE_TILE)
        for (int64_t i = 0; i < n * tf; i++) { /* [n, tf]: expert i / tf, its tile i % tf */
            const int64_t e = i / tf, r0 = (i % tf) * MOE_TILE;
            const int nr = (int)(f - r0 < MOE_TILE ? f - r0 : MOE_TILE);
#ifdef QDOT_X86
            if (tiles_ok && kern_tiles(&kg, start[e + 1] - start[e]) && kern_tiles(&ku, start[e + 1] - start[e])) {
                moe_tile_gate_up(&bufs, &kg, &ku, gate[e], up[e], rb, r0, nr, h, f, xg, xg_n, xu, xu_row,
                                 row, start[e], start[e + 1], hb, act, bias, e);
                continue;
            }
#endif
            for (int64_t r = r0; r < r0 + nr; r += 2) { /* rows r and r + 1 */
                const int two = r + 1 < r0 + nr;
                for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += MX) {
                    const int nx = (int)(start[e + 1] - p0 < MX ? start[e + 1] - p0 : MX);
                    const void *xsg[MX], *xsu[MX];
                    float g[2][MX], u[2][MX];
                    for (int j = 0; j < nx; j++) {
                        xsg[j] = xg + xg_n * (size_t)row[p0 + j];
                        xsu[j] = xu + xu_row * (size_t)row[p0 + j];
                    }
                    kern_mdot2(&kg, gate[e] + r * rb[0], rb[0], two, xsg, nx, h, g[0], g[1]);
                    kern_mdot2(&ku, up[e] + r * rb[1], rb[1], two, xsu, nx, h, u[0], u[1]);
                    for (int i = 0; i <= two; i++)
                        for (int j = 0; j < nx; j++)
                            hb[(p0 + j) * f + r + i] = moe_hidden(g[i][j], u[i][j], act, bias, e, r + i);
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < m; p++) kern_quantize(&kd, hb + p * f, f, hq + hq_n * (size_t)p);
#pragma omp for schedule(dynamic, MOE_ROWS / MOE_TILE)
        for (int64_t i = 0; i < n * th; i++) { /* [n, th] */
            const int64_t e = i / th, r0 = (i % th) * MOE_TILE;
            const int nr = (int)(h - r0 < MOE_TILE ? h - r0 : MOE_TILE);
#ifdef QDOT_X86
            if (tiles_ok && kern_tiles(&kd, start[e + 1] - start[e])) {
                moe_tile_down(&bufs, &kd, down[e], rb[2], r0, nr, h, f, hq, hq_n, start[e], start[e + 1],
                              y, bias, e);
                continue;
            }
#endif
            for (int64_t r = r0; r < r0 + nr; r += 2) { /* rows r and r + 1 */
                const int two = r + 1 < r0 + nr;
                for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += MX) {
                    const int nx = (int)(start[e + 1] - p0 < MX ? start[e + 1] - p0 : MX);
                    const void *xs[MX];
                    float v[2][MX];
                    for (int j = 0; j < nx; j++) xs[j] = hq + hq_n * (size_t)(p0 + j);
                    kern_mdot2(&kd, down[e] + r * rb[2], rb[2], two, xs, nx, f, v[0], v[1]);
                    for (int i = 0; i <= two; i++)
                        for (int j = 0; j < nx; j++) y[(p0 + j) * h + r + i] = moe_out(v[i][j], bias, e, r + i);
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < h; c += 64) { /* columns [c, c + 64) of every token */
            const int64_t end = c + 64 < h ? c + 64 : h;
            for (int64_t i = 0; i < t; i++) {
                float *o = out + i * h;
                for (int64_t r = c; r < end; r++) o[r] = 0.0f;
                for (int64_t q = tstart[i]; q < tstart[i + 1]; q++) {
                    const int64_t p = tpair[q];
                    const float wp = w[p], *yp = y + p * h;
                    for (int64_t r = c; r < end; r++) o[r] = o[r] + wp * yp[r];
                }
            }
        }
#ifdef QDOT_X86
        moe_bufs_free(&bufs);
#endif
    }
    free(mem);
    return 0;
}
