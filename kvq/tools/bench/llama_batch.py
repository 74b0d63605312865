"""llama.cpp's aggregate decode rate over several sequences at once, for `kvq bench model`.

llama-cpp-python's `Llama` decodes one sequence; its low-level API (`llama_batch`,
`llama_decode`) takes tokens of many sequences in one batch, which is how llama.cpp's own
server and `llama-batched` serve concurrent requests. This drives it the way `kvq bench
model` drives kvq's engine: `n` distinct prompts prefilled in one batch, then one token per
sequence per `llama_decode`, greedy, EOS ignored; the rate counts the tokens after each
sequence's first, over the time after the first step.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np


def decode_together(
    llm: Any, prompts: list[list[int]], tokens: int, threads: int
) -> tuple[list[list[int]], float]:
    """The `tokens` greedy tokens of each prompt, decoded together on `llm`'s model (a loaded
    `llama_cpp.Llama`) in a context of their own, and the rate: tokens after each sequence's
    first over the time after the first step."""
    import llama_cpp as lc

    n = len(prompts)
    per_seq = -(-(max(len(p) for p in prompts) + tokens + 16) // 256) * 256  # llama.cpp pads
    params = lc.llama_context_default_params()
    params.n_ctx = n * per_seq
    params.n_batch = params.n_ubatch = max(sum(len(p) for p in prompts), n)
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm._model.model, params)
    if not ctx:
        raise RuntimeError(
            f"llama.cpp could not create a context of {n} sequences (n_ctx {params.n_ctx}, "
            f"n_seq_max {n}, n_batch {params.n_batch}); its log on stderr says why"
        )
    batch = lc.llama_batch_init(params.n_batch, 0, n)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm._model.model))
    try:
        entries = [
            (p[j], j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j in range(len(p))
        ]
        out = [[t] for t in _decode(lc, ctx, batch, entries, n_vocab)]
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            entries = [(out[s][-1], pos[s], s, True) for s in range(n)]
            for s, t in enumerate(_decode(lc, ctx, batch, entries, n_vocab)):
                out[s].append(t)
            pos = [q + 1 for q in pos]
        elapsed = time.perf_counter() - t0
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    done = n * (tokens - 1)
    return out, (done / elapsed if elapsed > 0 and done else 0.0)


def _decode(
    lc: Any, ctx: Any, batch: Any, entries: list[tuple[int, int, int, bool]], n_vocab: int
) -> list[int]:
    """One `llama_decode` of (token, position, sequence, wants logits) entries; the greedy
    next token of each sequence that wanted logits, in sequence order."""
    batch.n_tokens = len(entries)
    for i, (tok, pos, seq, want) in enumerate(entries):
        batch.token[i], batch.pos[i] = tok, pos
        batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
        batch.logits[i] = want
    if lc.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed on a multi-sequence batch")
    out: dict[int, int] = {}
    for i, (_tok, _pos, seq, want) in enumerate(entries):
        if want:
            ptr = lc.llama_get_logits_ith(ctx, i)
            logits = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
            )
            out[seq] = int(logits.argmax())
    return [out[s] for s in sorted(out)]
