"""Continuous batching over `n_slots` sequences: admit, step all together, retire.

One `step()` runs one backbone forward over every active sequence (prefill tokens of new ones,
one decode token of the others), so each MoE layer sees all their token rows at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvq.model import Backbone, KVCache, MoeFn, SeqStep, Tokenizer


@dataclass
class Sequence:
    """One request being generated."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    cache: KVCache
    entry_id: bytes = b""
    generated: list[int] = field(default_factory=list)  # EOS is never part of it
    next_input: list[int] = field(default_factory=list)
    finish: str | None = None
    new_token: int | None = None  # the token this step produced for the client; None at EOS


TokenSink = Callable[[list[Sequence]], None]  # called once per step with every sequence


class Engine:
    """Greedy generation for up to `n_slots` sequences at a time."""

    def __init__(self, backbone: Backbone, tokenizer: Tokenizer, n_slots: int) -> None:
        self.backbone, self.tokenizer, self.n_slots = backbone, tokenizer, n_slots
        self.active: list[Sequence] = []

    @property
    def busy(self) -> int:
        return len(self.active)

    @property
    def free(self) -> int:
        return self.n_slots - len(self.active)

    def admit(
        self, request_id: str, prompt_ids: list[int], max_tokens: int, entry_id: bytes
    ) -> Sequence:
        assert self.free > 0, "admit() called with no free slot"
        seq = Sequence(
            request_id, list(prompt_ids), max_tokens, self.backbone.new_cache(), entry_id,
            next_input=list(prompt_ids),
        )  # fmt: skip
        self.active.append(seq)
        return seq

    def step(self, moe: MoeFn | None, on_tokens: TokenSink) -> list[Sequence]:
        """One forward over all active sequences; returns the sequences that finished."""
        if not self.active:
            return []
        steps = [SeqStep(s.next_input, s.cache) for s in self.active]
        with torch.inference_mode():
            logits = self.backbone.forward(steps, moe=moe)  # [S, vocab]
        next_ids = logits.argmax(dim=-1).tolist()
        # update every sequence before telling anyone: a failed send must not leave one
        # sequence's cache ahead of its token list
        done = []
        for seq, tok in zip(self.active, next_ids, strict=True):
            seq.next_input = [tok]
            if tok == self.tokenizer.eos_id:  # the end, not a token: as `kvq generate` does
                seq.finish, seq.new_token = "eos", None
                done.append(seq)
                continue
            seq.generated.append(tok)
            seq.new_token = tok
            if len(seq.generated) >= seq.max_tokens:
                seq.finish = "length"
            elif seq.cache.length + 1 >= self.backbone.meta.context_length:
                seq.finish = "context"
            if seq.finish:
                done.append(seq)
        emitted = self.active
        self.active = [s for s in self.active if s.finish is None]
        on_tokens(emitted)
        return done
