"""Which sequences of an engine step bring n-gram drafts, and how many (X13).

A decoding sequence drafts up to its adaptive length (`DraftLength`) from its own prompt and
output (`ngram_draft`); its k drafts join its one decode token as k + 1 rows of the step's
forward, verified there (`SeqStep.verify`: greedy by argmax, sampled by the speculative
sampling rule, `Sampler.speculate`), while sequences without drafts decode their one token in
the same pass. A sequence drafts nothing with a `logit_bias` or a grammar (each token's mask
depends on the one before), while replaying the tokens an earlier run streamed, or while
reading its prompt. A request caps its
drafts with `SamplingParams.draft_max` (the API's `speculative.n_max`, as llama-server's; 0
opts out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.coordinator.sequence import Sequence
from kvq.model.speculative import DraftLength, accept_greedy, ngram_draft

SPECULATIVE_MODES = ("off", "ngram")


@dataclass
class DraftPlan:
    """The engine's draft policy: `mode` off or ngram, `tokens` the longest draft."""

    mode: str = "off"
    tokens: int = 4

    @property
    def on(self) -> bool:
        return self.mode == "ngram" and self.tokens > 0

    def draft(
        self,
        tokens: list[int],
        length: DraftLength,
        room: int,
        eligible: bool,
    ) -> list[int]:
        """The draft of a sequence whose prompt and output so far are `tokens`: none unless
        `eligible`; at most its adaptive length and `room` (tokens it may still be given
        after the next, and positions its context still holds)."""
        if not (self.on and eligible):
            return []
        return ngram_draft(tokens, max(0, min(length.now, room)))

    def for_sequence(self, seq: Sequence, n: int) -> list[int]:
        """`seq`'s draft for a step that reads `n` of its input tokens."""
        p = seq.params
        eligible = (
            n == len(seq.next_input) == 1
            and bool(seq.generated)
            and not p.logit_bias
            and seq.constraint is None
            and len(seq.generated) >= len(seq.forced)
        )
        left = seq.max_tokens - len(seq.generated) - 1
        room = min(left, seq.cache.max_len - seq.cache.length - 1)
        if p.draft_max is not None:  # the request's own cap; 0: it opted out
            room = min(room, p.draft_max)
        tokens = [*seq.prompt_ids, *seq.generated]
        return self.draft(tokens, seq.draft_length, room, eligible)


def verify(seq: Sequence, draft: list[int], rows: torch.Tensor, picks: list[int]) -> list[int]:
    """The tokens `seq` keeps of a pass that verified `draft` (rows [len(draft) + 1, V]:
    the logits after its last token and after each draft token; `picks` their argmax)."""
    if not draft:
        return []
    assert seq.sampler is not None
    if seq.sampler.greedy:
        return accept_greedy(draft, picks)
    out = []
    for j, d in enumerate(draft):
        out.append(seq.sampler.speculate(rows[j], d))
        if out[-1] != d:
            return out
    return [*out, seq.sampler.pick(rows[len(draft)])]
