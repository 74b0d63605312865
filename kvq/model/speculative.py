"""Speculative decoding with n-gram (prompt-lookup) drafts, verified in one pass (X13).

A sequence's next tokens often repeat what it has already read or written (code, quotes,
lists, a model that loops). `ngram_draft` looks up the longest recent n-gram ending the
sequence earlier in it and proposes the tokens that followed there, at no model cost. One
forward pass then runs the sequence's last token and its k draft tokens as k + 1 rows
(`SeqStep.verify`): each row computed as a decode step at its position would compute it, so
row j's logits are the bits plain decoding gets after the same tokens (X17). Greedy
verification keeps the drafts up to the first that differs from the row's argmax and adds that
argmax: 1 to k + 1 tokens per pass, exactly the tokens of plain greedy decoding. The cache
commits the accepted rows only (`KVCache.advance`; a linear-attention layer's state after each
row was staged).

The draft length adapts to what is accepted (`DraftLength`): it grows by one after a pass
that accepts every draft and shrinks to what was accepted + 1 after one that does not.
This module's `speculative_greedy` (`kvq generate`) is greedy only; the coordinator's engine
also verifies sampled sequences' drafts (`Sampler.speculate`, `kvq.coordinator.drafts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvq.errors import ModelError
from kvq.model.cache import KVCache, SeqStep

if TYPE_CHECKING:
    from kvq.model.backbone import Backbone, MoeFn

# the longest n-gram looked up first; shorter ones down to `NGRAM_MIN` after it
NGRAM_MAX = 3
NGRAM_MIN = 1


def ngram_draft(tokens: Sequence[int], k: int, n_max: int = NGRAM_MAX) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
    (n_max down to `NGRAM_MIN` tokens) that ends `tokens`; [] where none recurs."""
    t = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, t - 1), NGRAM_MIN - 1, -1):
        tail = list(tokens[t - n :])
        for start in range(t - n - 1, -1, -1):  # the latest occurrence first
            if list(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + k])
    return []


def accept_greedy(draft: list[int], picks: list[int]) -> list[int]:
    """The tokens a greedy verification keeps: `picks[j]` is the argmax of the row after
    draft[:j] (len(draft) + 1 rows); the drafts that match it, then the first pick that
    differs (or the pick after the last draft)."""
    out = []
    for d, p in zip(draft, picks, strict=False):
        out.append(p)
        if p != d:
            return out
    out.append(picks[len(draft)])
    return out


@dataclass
class DraftLength:
    """The draft length of one sequence, adapting to its measured acceptance: one more after
    a pass that accepted every draft (up to `most`), the accepted count + 1 after one that
    did not."""

    most: int
    now: int = 0

    def __post_init__(self) -> None:
        if self.most < 0:
            raise ModelError(f"draft length {self.most} must be >= 0")
        self.now = self.now or self.most

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.now = min(self.most, accepted + 1) if accepted == drafted else max(1, accepted + 1)


@dataclass
class SpecStats:
    """What speculative decoding did: forward passes after the prompts, tokens made,
    draft tokens proposed and accepted."""

    passes: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0


@dataclass
class _Seq:
    tokens: list[int]  # prompt and generated so far
    cache: KVCache
    limit: int  # tokens to generate at most
    length: DraftLength
    out: list[int] = field(default_factory=list)
    done: bool = False


def speculative_greedy(
    bb: Backbone,
    prompts: list[list[int]],
    max_tokens: int,
    draft_tokens: int,
    *,
    moe: MoeFn | None = None,
    stop_at_eos: bool = True,
    stats: SpecStats | None = None,
    chunk: int = 0,
    on_token: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """Greedy generation of every prompt together, one forward pass per step for all of
    them, each sequence with its n-gram drafts verified in that pass (one without a draft
    decodes its one token in the same pass). The tokens are exactly plain greedy decoding's
    (`kvq.model.generate`, EOS excluded; `chunk` as there). `stats` counts what the drafts
    did; `on_token(i, id)` sees each token of prompt i as it is kept."""
    st = stats if stats is not None else SpecStats()
    seqs = [_Seq(list(p), bb.new_cache(), max_tokens, DraftLength(draft_tokens)) for p in prompts]
    for i, s in enumerate(seqs):
        if not s.tokens:
            raise ModelError("the prompt is empty; pass at least one token id")
        step = chunk if chunk > 0 else len(s.tokens)
        for a in range(0, len(s.tokens), step):
            logits = bb.forward([SeqStep(s.tokens[a : a + step], s.cache)], moe)  # [1, V]
        _take(bb, s, [int(logits[0].argmax())], stop_at_eos, st, _tell(on_token, i))
    while live := [s for s in seqs if not s.done]:
        drafts = [_draft(s) for s in live]
        steps = [
            SeqStep([s.tokens[-1], *d], s.cache, verify=True)
            for s, d in zip(live, drafts, strict=True)
        ]
        with torch.inference_mode():
            logits = bb.forward(steps, moe)  # [sum(len(d) + 1), V]
        picks = logits.argmax(-1).tolist()
        st.passes += 1
        row = 0
        for s, d in zip(live, drafts, strict=True):
            i = seqs.index(s)
            kept = accept_greedy(d, picks[row : row + len(d) + 1])
            row += len(d) + 1
            s.cache.advance(len(kept))  # the last token and the accepted drafts
            s.length.update(len(d), len(kept) - 1)
            st.drafted, st.accepted = st.drafted + len(d), st.accepted + len(kept) - 1
            _take(bb, s, kept, stop_at_eos, st, _tell(on_token, i))
    return [s.out for s in seqs]


def _tell(on_token: Callable[[int, int], None] | None, i: int) -> Callable[[int], None] | None:
    return None if on_token is None else lambda tok: on_token(i, tok)


def _draft(s: _Seq) -> list[int]:
    """The sequence's draft: no more than it may still generate or its context holds."""
    room = s.cache.max_len - s.cache.length - 1
    left = s.limit - len(s.out) - 1
    return ngram_draft(s.tokens, max(0, min(s.length.now, room, left)))


def _take(
    bb: Backbone,
    s: _Seq,
    kept: list[int],
    stop_at_eos: bool,
    st: SpecStats,
    tell: Callable[[int], None] | None,
) -> None:
    """Record the tokens a pass kept, stopping where plain decoding would (EOS, the token
    limit, a full context)."""
    for tok in kept:
        if stop_at_eos and tok == bb.meta.eos_id:
            s.done = True
            return
        s.out.append(tok)
        if tell is not None:
            tell(tok)
        s.tokens.append(tok)
        st.tokens += 1
        # plain decoding has fed every earlier token by now
        fed = len(s.tokens) - 1
        if len(s.out) >= s.limit or fed >= s.cache.max_len:
            s.done = True
            return
