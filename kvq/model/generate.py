"""Token-by-token generation for one sequence: greedy, or sampled with temperature/top-k/top-p."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvq.errors import ModelError
from kvq.model.cache import SeqStep
from kvq.model.sampling import Sampler, Sampling
from kvq.model.speculative import speculative_greedy

__all__ = ["Sampling", "generate"]

if TYPE_CHECKING:
    from kvq.model.backbone import Backbone, MoeFn


def generate(
    bb: Backbone,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    moe: MoeFn | None = None,
    sampling: Sampling | None = None,
    stop_at_eos: bool = True,
    on_token: Callable[[int], None] | None = None,
    chunk: int = 0,
    draft_tokens: int = 0,
) -> list[int]:
    """Generated ids only (EOS not included); stops at EOS (if `stop_at_eos`), after
    `max_tokens`, or when the context is full. `on_token` sees each id as it is chosen.
    `chunk` > 0: the prompt is read `chunk` tokens at a time, cut where a coordinator with
    that `KVQ_PREFILL_CHUNK` cuts it (X17: the same bits as served). `draft_tokens` > 0 and
    greedy: n-gram drafts of up to that many tokens verified in one pass each (X13,
    `kvq.model.speculative`): the same tokens in fewer passes."""
    if max_tokens <= 0:
        return []
    if not prompt_ids:
        raise ModelError("the prompt is empty; pass at least one token id")
    s = sampling or Sampling()
    if draft_tokens > 0 and Sampler(s, bb.meta.vocab_size).greedy:
        tell = None if on_token is None else lambda _i, tok: on_token(tok)
        spec = speculative_greedy(
            bb,
            [prompt_ids],
            max_tokens,
            draft_tokens,
            moe=moe,
            stop_at_eos=stop_at_eos,
            chunk=chunk,
            on_token=tell,
        )
        return spec[0]
    pick = _picker(s, bb.meta.vocab_size)
    cache = bb.new_cache()
    step = chunk if chunk > 0 else len(prompt_ids)
    for i in range(0, len(prompt_ids), step):
        logits = bb.forward([SeqStep(list(prompt_ids[i : i + step]), cache)], moe)  # [1, V]
    out: list[int] = []
    while True:
        nxt = pick(logits[0])
        if stop_at_eos and nxt == bb.meta.eos_id:
            break
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if len(out) >= max_tokens or cache.length >= cache.max_len:
            break
        logits = bb.forward([SeqStep([nxt], cache)], moe)
    return out


def _picker(s: Sampling, vocab: int) -> Callable[[torch.Tensor], int]:
    """A function from logits [V] to the next token id (the coordinator's rule too)."""
    return Sampler(s, vocab).pick
