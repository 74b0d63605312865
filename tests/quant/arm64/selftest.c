/* Same bits on every path of kvq's int8 kernels (kvq/quant/csrc/qdot.c), as one static
 * program: tests/quant/test_arm64_qemu.py builds it for arm64 (aarch64-linux-gnu-gcc -static)
 * and runs it under qemu-aarch64 -cpu max, and builds it for this machine too.
 *
 * For every type it fills weights and activations from a seed, runs kvq_qdot (one row: the
 * one-row dots; 11 rows: the multi-row dots, 8 + 3), kvq_qdot_moe and kvq_qdot_moe_batch on
 * every path this CPU has (kvq_qdot_isa(id) == id) on argv[2] threads (default 1; with more,
 * the scalar path too), and compares each output's
 * bytes with the scalar path's on one thread (kvq_qdot also with an infinite and a NaN row:
 * NaN outputs). It prints
 *   best <path>
 *   same <type> <path> <outputs compared>     (or "diff ..." with the first differing index)
 *   hash <type> <fnv-1a of the scalar kvq_qdot outputs of finite rows>
 * and exits 1 on any difference. The hashes let the test compare the scalar path across
 * instruction sets (arm64 against x86): they cover finite rows only, where no NaN's sign can
 * differ. The
 * MoE outputs go through expf, whose last bit libm may give differently per instruction set,
 * so they are compared within one build only. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvq_qdot(int qtype, const uint8_t *w, int64_t n_rows, int64_t row_bytes, const float *x,
             int64_t n_x, int64_t k, float *out, int threads, int isa);
int kvq_qdot_moe(int n, const uint8_t *const *gate, const uint8_t *const *up,
                 const uint8_t *const *down, const int *types, const int64_t *rb, int64_t f,
                 int64_t h, const float *x, const float *w, float *out, int threads, int isa,
                 int act, const float *const *bias);
int kvq_qdot_moe_batch(int n, const uint8_t *const *gate, const uint8_t *const *up,
                       const uint8_t *const *down, const int *types, const int64_t *rb, int64_t f,
                       int64_t h, int64_t t, const float *x, const int64_t *start,
                       const int64_t *row, const float *w, float *out, int threads, int isa,
                       int act, const float *const *bias);
int kvq_qdot_isa(int asked);
int kvq_qdot_best_isa(void);

/* kvq.quant.qdot.ISA_NAMES */
static const char *const PATHS[] = {"scalar", "avx2", "avx2+vnni", "avx512", "amx", "neon", "neon+dotprod", "neon+i8mm"};
#define NPATHS 8

typedef struct {
    const char *name;
    int id, block, bytes; /* ggml id, values and bytes per block */
} type_t;

static const type_t TYPES[] = {
    {"Q4_K", 12, 256, 144}, {"Q5_K", 13, 256, 176}, {"Q6_K", 14, 256, 210}, {"Q8_0", 8, 32, 34},
    {"Q4_0", 2, 32, 18},    {"Q5_0", 6, 32, 22},    {"MXFP4", 39, 32, 17},
};
#define NTYPES 7

static uint64_t rng_state;

static uint32_t rnd(void) { /* xorshift64*: the same numbers on every machine */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1DULL) >> 32);
}

/* a float in (-1, 1) times a power of two from 2^-6 to 2^5, exactly representable */
static float rnd_float(int scale_exp) {
    const float u = (float)((int32_t)(rnd() >> 8) - (1 << 23)) / (float)(1 << 23);
    float p = 1.0f;
    for (int i = 0; i < scale_exp; i++) p *= 2.0f;
    for (int i = 0; i > scale_exp; i--) p *= 0.5f;
    return u * p;
}

/* a finite half: sign, exponent 1..20 (2^-14 .. 2^5), any mantissa */
static void put_f16(uint8_t *p) {
    const uint32_t h = (rnd() & 0x8000u) | ((1 + rnd() % 20) << 10) | (rnd() & 0x3ffu);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

/* n_rows rows of k values of type t: random bytes, with finite scales */
static uint8_t *make_weights(const type_t *t, int64_t n_rows, int64_t k) {
    const int64_t nb = n_rows * (k / t->block);
    uint8_t *w = malloc((size_t)(nb * t->bytes));
    for (int64_t i = 0; i < nb * t->bytes; i++) w[i] = (uint8_t)rnd();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * t->bytes;
        if (t->id == 14) {
            put_f16(blk + 208); /* Q6_K's d; its int8 scales stay random */
        } else if (t->id == 39) {
            blk[0] = (uint8_t)(110 + rnd() % 30); /* E8M0: 2^-18 .. 2^11 */
        } else {
            put_f16(blk);
            if (t->id == 12 || t->id == 13) put_f16(blk + 2); /* dmin */
        }
    }
    return w;
}

/* rows of k activations: row 0 all zero, the others of magnitudes 2^-6 .. 2^5 */
static float *make_x(int64_t rows, int64_t k) {
    float *x = malloc(sizeof(float) * (size_t)(rows * k));
    for (int64_t r = 0; r < rows; r++) {
        const int e = (int)(rnd() % 12) - 6;
        for (int64_t i = 0; i < k; i++) x[r * k + i] = r == 0 ? 0.0f : rnd_float(e);
    }
    return x;
}

static uint64_t fnv1a(const void *p, size_t n, uint64_t h) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static int failures;
static int threads = 1; /* of every call but the scalar reference's (argv[2]) */

/* compare out (n floats) of path with the scalar path's ref; print one line per call site */
static void check(const char *what, const char *path, const float *ref, const float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(ref + i, out + i, 4) != 0) {
            printf("diff %s %s at %" PRId64 ": %a vs %a\n", what, path, i, (double)out[i], (double)ref[i]);
            failures++;
            return;
        }
    }
    printf("same %s %s %" PRId64 "\n", what, path, n);
}

/* the paths this CPU has, scalar first */
static int paths(int *ids) {
    int n = 0;
    for (int id = 0; id < NPATHS; id++)
        if (kvq_qdot_isa(id) == id) ids[n++] = id;
    return n;
}

/* kvq_qdot of one row and of 11 rows on every path against the scalar path */
static void test_dot(const type_t *t, const int *ids, int np) {
    const int64_t n_rows = 9, k = t->block == 256 ? 768 : 1120, n_x = 11;
    uint8_t *w = make_weights(t, n_rows, k);
    float *x = make_x(n_x, k);
    float *ref = malloc(sizeof(float) * (size_t)(n_x * n_rows)), *out = malloc(sizeof(float) * (size_t)(n_x * n_rows));
    const int64_t rb = k / t->block * t->bytes;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int rows = 1; rows <= n_x; rows += n_x - 1) {
        const float *xr = rows == 1 ? x + k : x; /* one row: a nonzero one */
        kvq_qdot(t->id, w, n_rows, rb, xr, rows, k, ref, 1, 0);
        h = fnv1a(ref, sizeof(float) * (size_t)(rows * n_rows), h);
        for (int p = threads > 1 ? 0 : 1; p < np; p++) {
            char what[32];
            snprintf(what, sizeof what, "%s/%s", t->name, rows == 1 ? "dot" : "rows");
            kvq_qdot(t->id, w, n_rows, rb, xr, rows, k, out, threads, ids[p]);
            check(what, PATHS[ids[p]], ref, out, rows * n_rows);
        }
    }
    printf("hash %s %016" PRIx64 "\n", t->name, h);
    x[2 * k + 5] = 1.0f / 0.0f; /* rows 2 and 3 not finite: NaN outputs, compared, not hashed */
    x[3 * k + 7] = 0.0f / 0.0f;
    kvq_qdot(t->id, w, n_rows, rb, x, n_x, k, ref, 1, 0);
    for (int p = threads > 1 ? 0 : 1; p < np; p++) {
        char what[32];
        snprintf(what, sizeof what, "%s/nan", t->name);
        kvq_qdot(t->id, w, n_rows, rb, x, n_x, k, out, threads, ids[p]);
        check(what, PATHS[ids[p]], ref, out, n_x * n_rows);
    }
    free(w), free(x), free(ref), free(out);
}

/* kvq_qdot_moe (one token) and kvq_qdot_moe_batch (5 tokens) of 3 experts of gate/up/down
 * types g, u, d on every path against the scalar path */
static void test_moe(const type_t *g, const type_t *u, const type_t *d, int act, const int *ids, int np) {
    const int n = 3, ntok = 5;
    const int64_t h = 512, f = 256;
    const type_t *ty[3] = {g, u, d};
    const int types[3] = {g->id, u->id, d->id};
    const int64_t rb[3] = {h / g->block * g->bytes, h / u->block * u->bytes, f / d->block * d->bytes};
    const uint8_t *mats[3][3];
    for (int e = 0; e < n; e++)
        for (int m = 0; m < 3; m++) mats[m][e] = make_weights(ty[m], m < 2 ? f : h, m < 2 ? h : f);
    float *x = make_x(ntok + 1, h) + h; /* past the zero row */
    const float wts[8] = {0.5f, 0.25f, 0.125f, 0.75f, 0.375f, 0.625f, 0.875f, 0.0625f};
    /* pairs by expert: expert 0 takes tokens 0-4, expert 1 tokens 1 and 3, expert 2 token 4 */
    const int64_t start[4] = {0, 5, 7, 8}, row[8] = {0, 1, 2, 3, 4, 1, 3, 4};
    float ref[512 * 5], out[512 * 5];
    char what[48];
    snprintf(what, sizeof what, "%s+%s+%s/moe", g->name, u->name, d->name);
    kvq_qdot_moe(n, mats[0], mats[1], mats[2], types, rb, f, h, x, wts, ref, 1, 0, act, NULL);
    for (int p = threads > 1 ? 0 : 1; p < np; p++) {
        kvq_qdot_moe(n, mats[0], mats[1], mats[2], types, rb, f, h, x, wts, out, threads, ids[p], act, NULL);
        check(what, PATHS[ids[p]], ref, out, h);
    }
    snprintf(what, sizeof what, "%s+%s+%s/moe_batch", g->name, u->name, d->name);
    kvq_qdot_moe_batch(n, mats[0], mats[1], mats[2], types, rb, f, h, ntok, x, start, row, wts, ref, 1, 0, act, NULL);
    for (int p = threads > 1 ? 0 : 1; p < np; p++) {
        kvq_qdot_moe_batch(n, mats[0], mats[1], mats[2], types, rb, f, h, ntok, x, start, row, wts, out,
                           threads, ids[p], act, NULL);
        check(what, PATHS[ids[p]], ref, out, h * ntok);
    }
    for (int e = 0; e < n; e++)
        for (int m = 0; m < 3; m++) free((void *)mats[m][e]);
    free(x - h);
}

int main(int argc, char **argv) {
    const uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 10) : 1;
    threads = argc > 2 ? atoi(argv[2]) : 1;
    int ids[NPATHS];
    const int np = paths(ids);
    printf("best %s\n", PATHS[kvq_qdot_best_isa()]);
    for (int i = 0; i < NTYPES; i++) {
        rng_state = seed * 0x9E3779B97F4A7C15ULL + (uint64_t)TYPES[i].id + 1;
        test_dot(&TYPES[i], ids, np);
    }
    rng_state = seed + 1000;
    test_moe(&TYPES[0], &TYPES[0], &TYPES[2], 0, ids, np);  /* Q4_K_M's experts */
    test_moe(&TYPES[1], &TYPES[1], &TYPES[2], 0, ids, np);  /* Q5_K */
    test_moe(&TYPES[3], &TYPES[4], &TYPES[5], 0, ids, np);  /* Q8_0, Q4_0, Q5_0 */
    test_moe(&TYPES[6], &TYPES[6], &TYPES[6], 1, ids, np);  /* gpt-oss: MXFP4, SwiGLU */
    printf("%s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
