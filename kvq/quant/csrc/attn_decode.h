/* One decode step's attention for many sequences in one call (kvq.quant.qdot.attn_decode),
 * included at the end of qdot.c.
 *
 * A batch of decoding sequences gives each sequence one new query per head, to be attended
 * against that sequence's own cache. In torch that is ten or so small calls per sequence and
 * layer (the cache append, two matmuls, the softmax, the reshapes): about 86 us per sequence
 * and layer on two cores, 9 % of a 32-sequence olmoe step. Here it is one call: the new keys and
 * values are written into each cache, then each (sequence, kv head) pair computes, for each
 * query head of its group,
 *
 *   out = sum over p of softmax(scale * q . k[p])[p] * v[p]      (p = 0 .. len, the new one last)
 *
 * with a sink's logit joining the softmax where `sinks` is given (gpt-oss). float32 throughout,
 * expf for the exponentials; each output is computed by one thread in a fixed order, so a
 * sequence's result does not depend on the batch, the thread count or the schedule. The sums run
 * in another order than torch's, so the results differ from the torch path by float32 rounding
 * (tests/model/test_attn_decode.py states the bound). */

/* a . b over d values: 16 partial sums, lane j takes every 16th product, then added in order */
static float attn_dot(const float *a, const float *b, int64_t d) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int j = 0; j < 16; j++) part[j] = part[j] + a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s = s + part[j];
    for (; i < d; i++) s = s + a[i] * b[i];
    return s;
}

/* q [nseq, heads, d], knew and vnew [nseq, kv, d]; kc[s] and vc[s] sequence s's cache of this
 * layer, [capacity, kv, d] with positions 0 .. len[s] - 1 filled (the new key and value are
 * written at len[s]); out [nseq, heads, d]. heads a multiple of kv; query head h reads kv head
 * h / (heads / kv). Returns 0, -2 (heads not a multiple of kv, or a size below 1) or -3. */
int kvq_attn_decode(int64_t nseq, int64_t heads, int64_t kv, int64_t d, const float *q,
                    const float *knew, const float *vnew, float *const *kc, float *const *vc,
                    const int64_t *len, float scale, const float *sinks, float *out, int threads) {
    if (nseq < 1 || heads < 1 || kv < 1 || d < 1 || heads % kv) return -2;
    const int64_t group = heads / kv;
    int64_t most = 0; /* the longest sequence, new position included */
    for (int64_t s = 0; s < nseq; s++) most = len[s] + 1 > most ? len[s] + 1 : most;
    for (int64_t s = 0; s < nseq; s++) {
        memcpy(kc[s] + len[s] * kv * d, knew + s * kv * d, sizeof(float) * (size_t)(kv * d));
        memcpy(vc[s] + len[s] * kv * d, vnew + s * kv * d, sizeof(float) * (size_t)(kv * d));
    }
    if (threads < 1) threads = 1;
    (void)threads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (size_t)most);
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nseq * heads; i++) { /* sequence i / heads, query head i % heads */
            if (!p) continue;
            const int64_t s = i / heads, h = i % heads, g = h / group, n = len[s] + 1;
            const float *qh = q + i * d, *k = kc[s] + g * d, *v = vc[s] + g * d;
            float top = sinks ? sinks[h] : -INFINITY;
            for (int64_t t = 0; t < n; t++) {
                p[t] = scale * attn_dot(qh, k + t * kv * d, d);
                top = p[t] > top ? p[t] : top;
            }
            float sum = sinks ? expf(sinks[h] - top) : 0.0f;
            for (int64_t t = 0; t < n; t++) {
                p[t] = expf(p[t] - top);
                sum = sum + p[t];
            }
            float *o = out + i * d;
            for (int64_t c = 0; c < d; c++) o[c] = 0.0f;
            for (int64_t t = 0; t < n; t++) {
                const float w = p[t] / sum, *vt = v + t * kv * d;
                for (int64_t c = 0; c < d; c++) o[c] = o[c] + w * vt[c];
            }
        }
        free(p);
    }
    return failed ? -3 : 0;
}
