"""Picking the next token of one sequence from its logits: greedy, or sampled.

One `Sampler` per sequence, used by local `kvq generate` and by the coordinator's batched step
alike, so that a request with a fixed seed gets the same tokens either way. The order of the
steps follows OpenAI's and vLLM's: penalties on the raw logits, then temperature, top-k,
softmax, top-p (the smallest nucleus whose mass reaches `top_p`), then a draw from the
sequence's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.errors import ModelError


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is picked: temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token

    def check(self) -> None:
        """ModelError naming the first out-of-range setting."""
        if self.temperature < 0:
            raise ModelError(f"temperature {self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ModelError(f"top_k {self.top_k} must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ModelError(f"top_p {self.top_p} must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ModelError(f"{name} {getattr(self, name)} must be in [-2, 2]")


class Sampler:
    """The next-token rule of one sequence, with its own generator and token counts."""

    def __init__(self, s: Sampling, vocab: int) -> None:
        s.check()
        self.s = s
        self.penalized = bool(s.presence_penalty or s.frequency_penalty)
        self.counts = torch.zeros(vocab) if self.penalized else None  # [V]
        self.gen: torch.Generator | None = None
        if s.temperature > 0:
            self.gen = torch.Generator()
            self.gen.manual_seed(s.seed if s.seed is not None else int(torch.seed()))

    @property
    def greedy(self) -> bool:
        """Argmax of the raw logits: the batched fast path may pick for this sequence."""
        return self.gen is None and not self.penalized

    def pick(self, logits: torch.Tensor, forced: int | None = None) -> int:
        """The next token id from logits [V]; remembers it for the penalties. `forced`: a
        token an earlier run of the request already chose (a replay): it is drawn as usual,
        so the generator advances as it did then, but `forced` is the one kept."""
        z = logits.float().cpu()  # [V]
        if self.counts is not None:
            seen = (self.counts > 0).float()
            z = z - self.s.presence_penalty * seen - self.s.frequency_penalty * self.counts
        tok = int(z.argmax()) if self.gen is None else self._draw(z)
        if forced is not None:
            tok = forced
        if self.counts is not None:
            self.counts[tok] += 1
        return tok

    def speculate(self, logits: torch.Tensor, draft: int) -> int:
        """The next token id from logits [V] given a draft token (a sampled sequence's
        speculative step, X13): the standard speculative sampling rule for a draft that
        proposes `draft` with certainty (n-gram lookup), keep it with probability p(draft),
        else draw from p without it, renormalised; so the token follows p exactly, as
        `pick` draws it. Remembers it for the penalties."""
        z = logits.float().cpu()  # [V]
        if self.counts is not None:
            seen = (self.counts > 0).float()
            z = z - self.s.presence_penalty * seen - self.s.frequency_penalty * self.counts
        if self.gen is None:
            tok = int(z.argmax())
        else:
            p = self._filtered(z / self.s.temperature)
            p = p / p.sum()  # [V]: top-p leaves it unnormalised (multinomial does not mind)
            u = float(torch.rand(1, generator=self.gen))
            rest = p.index_fill(0, torch.tensor([draft]), 0.0)
            keep = u < float(p[draft]) or float(rest.sum()) <= 0
            tok = draft if keep else int(torch.multinomial(rest, 1, generator=self.gen))
        if self.counts is not None:
            self.counts[tok] += 1
        return tok

    def note(self, tok: int) -> None:
        """A token picked elsewhere (the batched greedy path)."""
        if self.counts is not None:
            self.counts[tok] += 1

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a draw follows, [V] (for tests and diagnostics; no penalties)."""
        return self._filtered(logits.float().cpu() / max(self.s.temperature, 1e-6))

    def _draw(self, z: torch.Tensor) -> int:
        probs = self._filtered(z / self.s.temperature)
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def _filtered(self, z: torch.Tensor) -> torch.Tensor:
        """Softmax of tempered logits z [V] after top-k and top-p, [V]."""
        s = self.s
        if 0 < s.top_k < z.shape[0]:
            kth = torch.topk(z, s.top_k).values[-1]
            z = z.masked_fill(z < kth, float("-inf"))
        probs = torch.softmax(z, dim=-1)  # [V]
        if s.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)  # [V] each
            drop = sorted_p.cumsum(0) - sorted_p >= s.top_p  # keep the smallest nucleus
            probs = probs.index_fill(0, order[drop], 0.0)
        return probs


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """log_softmax of the raw logits [V]: the chosen token's value and the `n` best (id, value)."""
    lp = torch.log_softmax(logits.float().cpu(), dim=-1)  # [V]
    best = torch.topk(lp, n) if n else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best else []
    return float(lp[token]), pairs
