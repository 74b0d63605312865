"""Token-by-token generation for one sequence: greedy, or sampled with temperature/top-k/top-p."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvq.errors import ModelError
from kvq.model.cache import SeqStep

if TYPE_CHECKING:
    from kvq.model.backbone import Backbone, MoeFn


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is picked: temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None

    def check(self) -> None:
        """ModelError naming the first out-of-range setting."""
        if self.temperature < 0:
            raise ModelError(f"temperature {self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ModelError(f"top_k {self.top_k} must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ModelError(f"top_p {self.top_p} must be in (0, 1]")


def generate(
    bb: Backbone,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    moe: MoeFn | None = None,
    sampling: Sampling | None = None,
    stop_at_eos: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generated ids only (EOS not included); stops at EOS (if `stop_at_eos`), after
    `max_tokens`, or when the context is full. `on_token` sees each id as it is chosen."""
    if max_tokens <= 0:
        return []
    if not prompt_ids:
        raise ModelError("the prompt is empty; pass at least one token id")
    pick = _picker(sampling or Sampling())
    cache = bb.new_cache()
    logits = bb.forward([SeqStep(list(prompt_ids), cache)], moe)  # [1, V]
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


def _picker(s: Sampling) -> Callable[[torch.Tensor], int]:
    """A function from logits [V] to the next token id."""
    s.check()
    if s.temperature == 0:
        return lambda logits: int(logits.argmax())
    gen = torch.Generator()
    gen.manual_seed(s.seed if s.seed is not None else int(torch.seed()))

    def pick(logits: torch.Tensor) -> int:
        z = logits.float().cpu() / s.temperature  # [V]
        if 0 < s.top_k < z.shape[0]:
            kth = torch.topk(z, s.top_k).values[-1]
            z = z.masked_fill(z < kth, float("-inf"))
        probs = torch.softmax(z, dim=-1)  # [V]
        if s.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)  # [V] each
            drop = sorted_p.cumsum(0) - sorted_p >= s.top_p  # keep the smallest nucleus
            probs = probs.index_fill(0, order[drop], 0.0)
        return int(torch.multinomial(probs, 1, generator=gen))

    return pick
