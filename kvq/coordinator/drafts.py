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

from kvq.model.speculative import DraftLength, ngram_draft

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
