"""`Sequence`: one request being generated, and what each step writes on it.

An engine step reads each sequence's next input and gives it at most one token per round
(`Recorder.advance`: the token, its text, its logprobs, and whether it ends the sequence: EOS, a
stop token or string, a finished grammar, `max_tokens`, the context). Sampling reads the
model's logits shaped by the sequence's `logit_bias` and grammar (`shaped_logits`); logprobs
always read the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvq import wire
from kvq.coordinator.detok import StopText
from kvq.model import KVCache
from kvq.model.sampling import Sampler, top_logprobs
from kvq.model.speculative import DraftLength
from kvq.text import Tokenizer
from kvq.text.grammar import Constraint, GrammarVocab, mask_rows


@dataclass
class Sequence:
    """One request being generated."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    cache: KVCache
    entry_id: bytes = b""
    source: str = ""  # the request stream (shard) the entry came from: where it is acked
    generated: list[int] = field(default_factory=list)  # EOS and stop tokens are not in it
    next_input: list[int] = field(default_factory=list)
    finish: str | None = None  # eos, stop, length, context, cancelled
    new_token: int | None = None  # the token this step produced for the client; None at EOS
    new_text: str = ""  # the text this step made final (see kvq.coordinator.detok)
    new_logprob: wire.TokenLogprob | None = None
    new_top: list[wire.TokenLogprob] | None = None
    params: wire.SamplingParams = wire.SamplingParams()
    sampler: Sampler | None = None
    text: StopText | None = None
    attempt: int = 1  # which run of the request this is (a restart or takeover adds one)
    forced: list[int] = field(default_factory=list)  # tokens an earlier run already streamed
    cohort: int = 0  # stage grain with KVQ_MICROBATCHES > 1: the cohort it steps with
    constraint: Constraint | None = None  # its grammar (`params.grammar`)
    prompt_lp: list[wire.PromptToken] = field(default_factory=list)  # `params.prompt_logprobs`
    draft_length: DraftLength = field(default_factory=lambda: DraftLength(0))  # X13

    @property
    def fresh(self) -> bool:
        """Whether `new_token` is news to the client: not one an earlier run streamed."""
        return len(self.generated) > len(self.forced)

    @property
    def completion(self) -> str:
        """The text handed out so far (all of it once finished; a stop string never is)."""
        return self.text.text if self.text is not None else ""


TokenSink = Callable[[list[Sequence]], None]  # called once per step with every sequence


class Recorder:
    """Writes a step's tokens on their sequences, with the text `tokenizer` gives them."""

    def __init__(self, tokenizer: Tokenizer, context_length: int) -> None:
        self.tokenizer, self.context_length = tokenizer, context_length

    def advance(self, seq: Sequence, tok: int, logits: torch.Tensor) -> None:
        """Record `tok` for `seq`: its text, logprobs and whether it ends the sequence."""
        assert seq.text is not None
        seq.next_input, seq.new_logprob, seq.new_top, seq.new_text = [tok], None, None, ""
        if tok == self.tokenizer.eos_id or tok in seq.params.stop_token_ids:
            # the end, not a token: as `kvq generate` does at EOS
            seq.finish = "eos" if tok == self.tokenizer.eos_id else "stop"
            seq.new_token = None
            seq.new_text = seq.text.flush(seq.generated)
            return
        seq.generated.append(tok)
        seq.new_token = tok
        if seq.constraint is not None:
            seq.constraint.accept(tok)
        if seq.params.logprobs is not None:
            self._logprobs(seq, tok, logits)
        seq.new_text = seq.text.push(seq.generated)
        if seq.text.stopped or (seq.constraint is not None and seq.constraint.done):
            seq.finish = "stop"
        elif len(seq.generated) >= seq.max_tokens:
            seq.finish = "length"
        elif len(seq.prompt_ids) + len(seq.generated) >= self.context_length:
            seq.finish = "context"
        if seq.finish in ("length", "context"):
            seq.new_text += seq.text.flush(seq.generated)

    def _logprobs(self, seq: Sequence, tok: int, logits: torch.Tensor) -> None:
        n = seq.params.logprobs or 0
        chosen, best = top_logprobs(logits, tok, n)
        dec = self.tokenizer.decode
        seq.new_logprob = wire.TokenLogprob(tok, dec([tok]), chosen)
        seq.new_top = [wire.TokenLogprob(t, dec([t]), lp) for t, lp in best]

    def prompt_logprob(self, seq: Sequence, tok: int, logits: torch.Tensor) -> None:
        """The log-probability of prompt token `tok` from the logits [V] before it."""
        if seq.params.prompt_logprobs is None:
            return
        chosen, best = top_logprobs(logits, tok, seq.params.prompt_logprobs)
        top = [wire.TokenLogprob(t, self.text(t), lp) for t, lp in best]
        seq.prompt_lp.append(wire.PromptToken(tok, self.text(tok), chosen, top))

    def text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])


def shaped_logits(
    stepping: list[tuple[Sequence, int]],
    logits: torch.Tensor,
    rows: list[int] | None,
    vocab: Callable[[], GrammarVocab],
) -> torch.Tensor:
    """The logits [S, V] sampling reads: each sequence's `logit_bias` added, then its
    grammar's mask (a copy when any sequence has either; `logits` stays the model's, for
    logprobs). `vocab`: the grammar's view of the vocabulary, built when a mask needs it."""
    shaped: torch.Tensor | None = None
    masked: list[tuple[int, Constraint]] = []
    for j, (seq, n) in enumerate(stepping):
        if n < len(seq.next_input):
            continue  # reading its prompt: nothing is sampled
        i = rows[j] if rows is not None else j
        if seq.params.logit_bias:
            shaped = logits.clone() if shaped is None else shaped
            ids = torch.tensor(list(seq.params.logit_bias))
            ok = ids < logits.shape[1]
            bias = torch.tensor(list(seq.params.logit_bias.values()), dtype=logits.dtype)
            shaped[i, ids[ok]] += bias[ok]
        if seq.constraint is not None:
            masked.append((i, seq.constraint))
    if masked:
        shaped = logits.clone() if shaped is None else shaped
        mask_rows(vocab(), shaped, masked)
    return logits if shaped is None else shaped
