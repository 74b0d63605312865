"""Greedy continuations of a prompt by kvq and by llama.cpp, with the logits of every step: what
the family tests (`test_model_families.py`, `test_model_gpt_oss.py`) compare."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvq.model import Backbone, SeqStep
from kvq.tools.train import check_pair


def llama_model(path: Path, n_ctx: int = 128) -> Any:
    """llama.cpp on `path` with an F32 KV cache (its default F16 cache rounds K and V)."""
    return check_pair.llama(path, n_ctx)


def llama_greedy(
    path: Path, ids: list[int], n: int, n_ctx: int = 128
) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation of `ids` and the logits [n, V] that chose each token."""
    llm = llama_model(path, n_ctx)
    llm.eval(ids)
    out, rows = [], []
    for _ in range(n):
        row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        rows.append(row)
        out.append(int(row.argmax()))
        llm.eval([out[-1]])
    return out, np.stack(rows)


def kvq_greedy(bb: Backbone, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """kvq's greedy continuation of `ids` (a prefill, then cached decode) and its logits."""
    cache = bb.new_cache()
    logits = bb.forward([SeqStep(list(ids), cache)])[0]
    out, rows = [], []
    for _ in range(n):
        rows.append(logits.double().numpy())
        out.append(int(logits.argmax()))
        logits = bb.forward([SeqStep([out[-1]], cache)])[0]
    return out, np.stack(rows)
