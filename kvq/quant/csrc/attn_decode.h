/* One decode step's attention for many sequences in one call (kvq.quant.qdot.attn_decode),
 * included at the end of qdot.c.
 *
 * A batch of decoding sequences gives each sequence one new query per head, to be attended
 * against that sequence's own cache. In torch that is ten or so small calls per sequence and
 * layer (the cache append, two matmuls, the softmax, the reshapes): about 86 us per sequence
 * and layer on two cores, 9 % of a 32-sequence olmoe step. Here it is one call: the new keys and
 * values are written into each cache, then each sequence (one thread) computes, for each query
 * head h reading kv head g,
 *
 *   out[h] = sum over p of softmax(scale * q[h] . k[p, g])[p] * v[p, g]   (p = 0 .. len)
 *
 * with a sink's logit joining the softmax where `sinks` is given (gpt-oss). float32 throughout,
 * expf for the exponentials, the same operations in the same order on every vector width, so a
 * sequence's result depends neither on the batch, the thread count, the schedule nor the CPU.
 * The sums run in another order than torch's, so the results differ from the torch path by
 * float32 rounding (tests/model/test_decode_attention.py states the bound).
 *
 * What it costs is reading the caches: 32 olmoe sequences of 31 positions are 16 MB of float32
 * keys and values a layer, read in 0.85 ms on two cores (19 GB/s, this machine's streaming rate). */

/* a . b over d values: 16 partial sums, lane j takes every 16th product, then added in order
 * (the same bits at every vector width: each lane's operations are the same) */
static inline __attribute__((always_inline)) float attn_dot(const float *a, const float *b, int64_t d) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int j = 0; j < 16; j++) part[j] = part[j] + a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s = s + part[j];
    for (; i < d; i++) s = s + a[i] * b[i];
    return s;
}

/* o [heads, d] = one sequence's attention, every head, over n positions of keys k and values v
 * ([n, kv, d]): position after position, so that the cache is read in the order it is stored
 * (a head at a time would stride kv * d floats between positions, which the hardware
 * prefetcher does not follow); p: heads * n floats of scratch */
static inline __attribute__((always_inline)) void attn_seq(const float *q, const float *k, const float *v,
                                                           int64_t n, int64_t heads, int64_t kv, int64_t d,
                                                           float scale, const float *sinks, float *p, float *o) {
    const int64_t group = heads / kv;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < heads; h++) p[h * n + t] = scale * attn_dot(q + h * d, k + (t * kv + h / group) * d, d);
    for (int64_t h = 0; h < heads; h++) {
        float *ph = p + h * n, top = sinks ? sinks[h] : -INFINITY;
        for (int64_t t = 0; t < n; t++) top = ph[t] > top ? ph[t] : top;
        float sum = sinks ? expf(sinks[h] - top) : 0.0f;
        for (int64_t t = 0; t < n; t++) {
            ph[t] = expf(ph[t] - top);
            sum = sum + ph[t];
        }
        for (int64_t t = 0; t < n; t++) ph[t] = ph[t] / sum;
    }
    for (int64_t c = 0; c < heads * d; c++) o[c] = 0.0f;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float w = p[h * n + t], *vt = v + (t * kv + h / group) * d;
            float *oh = o + h * d;
            for (int64_t c = 0; c < d; c++) oh[c] = oh[c] + w * vt[c];
        }
}

static void attn_seq_base(const float *q, const float *k, const float *v, int64_t n, int64_t heads, int64_t kv,
                          int64_t d, float scale, const float *sinks, float *p, float *o) {
    attn_seq(q, k, v, n, heads, kv, d, scale, sinks, p, o);
}

#ifdef QDOT_X86
/* 512-bit vectors (no FMA: -ffp-contract=off keeps each product and sum rounded apart) */
static __attribute__((target("avx2,avx512f"))) void attn_seq_z(const float *q, const float *k, const float *v,
                                                               int64_t n, int64_t heads, int64_t kv, int64_t d,
                                                               float scale, const float *sinks, float *p, float *o) {
    attn_seq(q, k, v, n, heads, kv, d, scale, sinks, p, o);
}
#endif

/* q [nseq, heads, d], knew and vnew [nseq, kv, d]; kc[s] and vc[s] sequence s's cache of this
 * layer, [capacity, kv, d] with positions 0 .. len[s] - 1 filled (the new key and value are
 * written at len[s]); out [nseq, heads, d]. heads a multiple of kv; query head h reads kv head
 * h / (heads / kv). Returns 0, -2 (heads not a multiple of kv, or a size below 1) or -3. */
int kvq_attn_decode(int64_t nseq, int64_t heads, int64_t kv, int64_t d, const float *q,
                    const float *knew, const float *vnew, float *const *kc, float *const *vc,
                    const int64_t *len, float scale, const float *sinks, float *out, int threads) {
    if (nseq < 1 || heads < 1 || kv < 1 || d < 1 || heads % kv) return -2;
    int64_t most = 0; /* the longest sequence, new position included */
    for (int64_t s = 0; s < nseq; s++) most = len[s] + 1 > most ? len[s] + 1 : most;
    for (int64_t s = 0; s < nseq; s++) {
        memcpy(kc[s] + len[s] * kv * d, knew + s * kv * d, sizeof(float) * (size_t)(kv * d));
        memcpy(vc[s] + len[s] * kv * d, vnew + s * kv * d, sizeof(float) * (size_t)(kv * d));
    }
    void (*one)(const float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t, float,
                const float *, float *, float *) = attn_seq_base;
#ifdef QDOT_X86
    if (kvq_qdot_best_isa() >= ISA_AVX512) one = attn_seq_z;
#endif
    if (threads < 1) threads = 1;
    if (threads > nseq) threads = (int)nseq; /* a sequence is one thread's: no wake for idle ones */
    (void)threads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (size_t)(heads * most));
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < nseq; s++) {
            if (!p) continue;
            one(q + s * heads * d, kc[s], vc[s], len[s] + 1, heads, kv, d, scale, sinks, p, out + s * heads * d);
        }
        free(p);
    }
    return failed ? -3 : 0;
}
