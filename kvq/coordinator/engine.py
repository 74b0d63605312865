"""Continuous batching over `n_slots` sequences: admit, step all together, retire.

One `step()` runs one backbone forward over every active sequence (prompt tokens of new ones,
one decode token of the others), so each MoE layer sees all their token rows at once.

Chunked prefill (as vLLM schedules it): one step takes at most `prefill_chunk` prompt tokens
over all the sequences still reading their prompt, first admitted first, each prompt in
pieces cut at multiples of `prefill_chunk` from its start (a piece that does not fit what is
left of the step waits for the next). A long prompt is read over several steps, and the decode
steps of the other sequences go on between its chunks instead of waiting for the whole prompt;
it gives its first token once it has read its last chunk. A decode token never counts against
the budget.

What a step writes on each sequence is `kvq.coordinator.sequence`'s; which sequences bring
drafts and which drafts they keep, `kvq.coordinator.drafts`'s (X13).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kvq import wire
from kvq.coordinator.chain import Chain, Pass
from kvq.coordinator.detok import StopText
from kvq.coordinator.drafts import DraftPlan, verify
from kvq.coordinator.sequence import Recorder, Sequence, TokenSink, shaped_logits
from kvq.model import Backbone, MoeFn, SeqStep
from kvq.model.microbatch import SplitMoe, forward_microbatched, split_rows
from kvq.model.sampling import Sampler, Sampling
from kvq.model.speculative import DraftLength, SpecStats
from kvq.text import Tokenizer
from kvq.text.grammar import GrammarVocab

__all__ = ["Engine", "Sequence", "TokenSink"]


class Engine:
    """Generation for up to `n_slots` sequences at a time, each with its own sampling."""

    def __init__(
        self,
        backbone: Backbone,
        tokenizer: Tokenizer,
        n_slots: int,
        prefill_chunk: int = 0,
        chain: Chain | None = None,
        drafts: DraftPlan | None = None,
    ) -> None:
        """`prefill_chunk`: prompt tokens one step takes at most (0: every prompt whole).
        `chain`: the stage holders that run the blocks of a stage-grain model (X12); the
        backbone then holds only the embedding and the output head. `drafts`: speculative
        decoding (X13; off by default, and always with a chain)."""
        self.backbone, self.tokenizer, self.n_slots = backbone, tokenizer, n_slots
        self.record = Recorder(tokenizer, backbone.meta.context_length)
        self.chain = chain
        self.drafts = drafts if drafts is not None and chain is None else DraftPlan()
        self.spec = SpecStats()  # draft tokens proposed and accepted so far
        self._admitted = 0
        self._open: dict[int, tuple[Pass, list[tuple[Sequence, int]]]] = {}  # cohort -> pass
        self.prefill_chunk = prefill_chunk
        self.active: list[Sequence] = []
        self._vocab: GrammarVocab | None = None  # built at the first grammar

    def grammar_vocab(self) -> GrammarVocab:
        """The model's vocabulary as the grammar library reads it (built once)."""
        if self._vocab is None:
            self._vocab = GrammarVocab(self.tokenizer, self.backbone.meta.vocab_size)
        return self._vocab

    @property
    def busy(self) -> int:
        return len(self.active)

    @property
    def free(self) -> int:
        return self.n_slots - len(self.active)

    def admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        entry_id: bytes,
        params: wire.SamplingParams | None = None,
        attempt: int = 1,
        forced: list[int] | None = None,
        source: str = "",
    ) -> Sequence:
        """Start a sequence. `forced`: the tokens an earlier run of the request streamed
        before it stopped; they are generated again as they were (whatever the sampling)."""
        assert self.free > 0, "admit() called with no free slot"
        p = params or wire.SamplingParams()
        sampling = Sampling(
            p.temperature, p.top_k, p.top_p, p.seed, p.presence_penalty, p.frequency_penalty
        )
        constraint = self.grammar_vocab().matcher(p.grammar) if p.grammar else None
        cache = self.chain.new_cache() if self.chain is not None else self.backbone.new_cache()
        seq = Sequence(
            request_id,
            list(prompt_ids),
            max_tokens,
            cache,
            entry_id,
            next_input=list(prompt_ids),
            params=p,
            sampler=Sampler(sampling, self.backbone.meta.vocab_size),
            text=StopText(self.tokenizer.decode, p.stop),
            attempt=attempt,
            forced=list(forced or []),
            source=source,
            constraint=constraint,
            draft_length=DraftLength(self.drafts.tokens),
        )
        if p.prompt_logprobs is not None and prompt_ids:
            seq.prompt_lp.append(
                wire.PromptToken(prompt_ids[0], self.record.text(prompt_ids[0]), None)
            )
        if self.chain is not None:
            seq.cohort = self._admitted % self.chain.cohorts
        self._admitted += 1
        self.active.append(seq)
        return seq

    def cancel(self, request_ids: Collection[str]) -> list[Sequence]:
        """Drop the sequences of these requests now (their slots are free for the next
        admission); returns them, finished as `cancelled`."""
        gone = [s for s in self.active if s.request_id in request_ids]
        for seq in gone:
            seq.finish, seq.new_token, seq.new_text = "cancelled", None, ""
        self.active = [s for s in self.active if s.finish is None]
        return gone

    def drop_all(self) -> list[Sequence]:
        """Drop every active sequence (a step that cannot finish); returns them."""
        gone, self.active = self.active, []
        if self.chain is not None:
            self.chain.abandon()
        self._open.clear()
        return gone

    def step(self, moe: MoeFn | None, on_tokens: TokenSink) -> list[Sequence]:
        """One forward over all active sequences (a sequence whose prompt is longer than
        what is left of the step's prefill budget reads a chunk of it and gives no token);
        returns the sequences that finished."""
        if not self.active:
            return []
        if self.chain is not None and self.chain.cohorts > 1:
            return self._step_cohorts(on_tokens)
        takes = self._tokens_to_read()
        stepping = [(s, n) for s, n in zip(self.active, takes, strict=True) if n]
        for seq in self.active:
            seq.new_token, seq.new_text, seq.new_logprob, seq.new_top = None, "", None, None
        drafts = [self.drafts.for_sequence(s, n) for s, n in stepping]
        steps = [
            SeqStep(s.next_input[:n] + d, s.cache, verify=bool(d))
            for (s, n), d in zip(stepping, drafts, strict=True)
        ]
        with torch.inference_mode():
            logits = self._forward(steps, moe)  # [S + drafts, vocab]
        if not any(drafts):
            return self._take(stepping, logits, on_tokens)
        return self._take_verified(stepping, drafts, logits, on_tokens)

    def _take_verified(
        self,
        stepping: list[tuple[Sequence, int]],
        drafts: list[list[int]],
        logits: torch.Tensor,
        on_tokens: TokenSink,
    ) -> list[Sequence]:
        """The tokens of a step with drafts: those its drafts give each drafting sequence
        (greedy: the drafts the rows' argmax confirms, then the argmax after the last;
        sampled: the speculative sampling rule, `Sampler.speculate`), the others' one as
        `_take` picks it, told in rounds of one token per sequence, as plain decoding's
        steps tell them. Each verified cache commits the rows it kept."""
        first = [0]
        for d in drafts:
            first.append(first[-1] + len(d) + 1)  # each step's first row
        picks = logits.argmax(-1).tolist()
        kept = []
        for (seq, _), d, r in zip(stepping, drafts, first, strict=False):
            k = verify(seq, d, logits[r : r + len(d) + 1], picks[r : r + len(d) + 1])
            if d:
                seq.cache.advance(len(k))  # its last token and the drafts it kept
                seq.draft_length.update(len(d), len(k) - 1)
                self.spec.drafted += len(d)
                self.spec.accepted += len(k) - 1
            kept.append(k)
        chosen = {r: k[0] for k, r in zip(kept, first, strict=False) if k}
        done = self._take(stepping, logits, on_tokens, first[:-1], chosen)
        for r in range(1, max(len(k) for k in kept)):
            for seq in self.active:
                seq.new_token, seq.new_text, seq.new_logprob, seq.new_top = None, "", None, None
            live = {id(s) for s in self.active}
            for (seq, _), k, row in zip(stepping, kept, first, strict=False):
                if r < len(k) and id(seq) in live:
                    self.record.advance(seq, k[r], logits[row + r])
                    done += [seq] if seq.finish else []
            emitted = self.active
            self.active = [s for s in self.active if s.finish is None]
            on_tokens(emitted)
        return done

    def _step_cohorts(self, on_tokens: TokenSink) -> list[Sequence]:
        """Stage grain with cohorts (X12 item 5): each cohort of sequences has its own pass
        through the chain, and a cohort whose pass is done samples and starts its next one
        while the others are still on their way, so with as many cohorts as stages every
        holder computes all the time. One call: start what can start, finish what is done."""
        assert self.chain is not None
        idle = [s for s in self.active if s.cohort not in self._open]  # not in flight
        takes = dict(zip(map(id, idle), self._tokens_to_read(idle), strict=True))
        for c in range(self.chain.cohorts):
            if c in self._open:
                continue
            stepping = [(s, takes[id(s)]) for s in idle if s.cohort == c and takes[id(s)]]
            if stepping:
                steps = [SeqStep(s.next_input[:n], s.cache) for s, n in stepping]
                self._open[c] = (self.chain.start(steps), stepping)
        for seq in self.active:
            seq.new_token, seq.new_text, seq.new_logprob, seq.new_top = None, "", None, None
        done: list[Sequence] = []
        by_pass = {id(p): c for c, (p, _) in self._open.items()}
        finished = self.chain.pump() if self._open else []
        for p, logits in finished:
            _, stepping = self._open.pop(by_pass[id(p)])
            live = {id(s) for s in self.active}  # one cancelled meanwhile gets nothing
            done += self._take(
                [(s, n) for s, n in stepping if id(s) in live],
                logits,
                None,
                [i for i, (s, _) in enumerate(stepping) if id(s) in live],
            )
        emitted = self.active
        self.active = [s for s in self.active if s.finish is None]
        on_tokens(emitted)
        return done

    def _take(
        self,
        stepping: list[tuple[Sequence, int]],
        logits: torch.Tensor,
        on_tokens: TokenSink | None,
        rows: list[int] | None = None,
        chosen: dict[int, int] | None = None,
    ) -> list[Sequence]:
        """Sample each stepping sequence from its logits row (`rows[i]`, default i; the
        token `chosen[row]` where a verification picked it already); then, with
        `on_tokens`, retire the finished and tell. Returns the finished."""
        with torch.inference_mode():
            raw, logits = logits, self._shaped(stepping, logits, rows)
            greedy_ids = logits.argmax(dim=-1).tolist()  # bit-exact with `kvq generate`
            # update every sequence before telling anyone: a failed send must not leave one
            # sequence's cache ahead of its token list
            done = []
            for j, (seq, n) in enumerate(stepping):
                i = rows[j] if rows is not None else j
                if n < len(seq.next_input):  # a chunk of its prompt: the rest in later steps
                    self.record.prompt_logprob(seq, seq.next_input[n], raw[i])
                    seq.next_input = seq.next_input[n:]
                    continue
                assert seq.sampler is not None
                made = len(seq.generated)
                forced = seq.forced[made] if made < len(seq.forced) else None
                if chosen and i in chosen:
                    tok = chosen[i]
                elif seq.sampler.greedy:
                    tok = greedy_ids[i] if forced is None else forced
                else:
                    tok = seq.sampler.pick(logits[i], forced)
                self.record.advance(seq, tok, raw[i])
                if seq.finish:
                    done.append(seq)
        if on_tokens is None:
            return done
        emitted = self.active
        self.active = [s for s in self.active if s.finish is None]
        on_tokens(emitted)
        return done

    def _shaped(
        self, stepping: list[tuple[Sequence, int]], logits: torch.Tensor, rows: list[int] | None
    ) -> torch.Tensor:
        """The logits sampling reads (`shaped_logits`; `kvq bench structured` times this call)."""
        return shaped_logits(stepping, logits, rows, self.grammar_vocab)

    def _tokens_to_read(self, seqs: list[Sequence] | None = None) -> list[int]:
        """Per active sequence, the tokens of its `next_input` this step reads: all of a
        decode step's one; of prompts, in admission order, the next piece of at most
        `prefill_chunk` tokens if the step's budget has room for it whole (0: it waits for the
        next step). A prompt is cut at multiples of `prefill_chunk` from its start whatever
        the other prompts of the step (X17), as `kvq generate` cuts it. A sequence that wants
        its prompt's logprobs reads it a token per step (the head gives a step's last row
        only): its logits are those of a token-by-token forward pass."""
        left = self.prefill_chunk or None
        takes = []
        for seq in self.active if seqs is None else seqs:
            n = len(seq.next_input)
            if n > 1 and seq.params.prompt_logprobs is not None and not seq.generated:
                n = 1
            if n > 1 and left is not None:
                n = min(n, self.prefill_chunk)  # the first prompt's always fits
                n = n if n <= left else 0
                left -= n
            takes.append(n)
        return takes

    def _forward(self, steps: list[SeqStep], moe: MoeFn | None) -> torch.Tensor:
        """One forward of `steps`, cut into the micro-batches `moe` asks for (if it can)."""
        if self.chain is not None:
            return self.chain.forward(steps)
        parts = moe.microbatches if isinstance(moe, SplitMoe) else 1
        groups = split_rows([len(s.tokens) for s in steps], parts)
        if len(groups) < 2 or not isinstance(moe, SplitMoe):
            return self.backbone.forward(steps, moe=moe)
        outs = forward_microbatched(
            self.backbone, [[steps[i] for i in g] for g in groups], moe.start
        )
        rows: dict[int, torch.Tensor] = {}  # each step's logits rows (a verify step's: all)
        for g, out in zip(groups, outs, strict=True):
            at = 0
            for i in g:
                n = len(steps[i].tokens) if steps[i].verify else 1
                rows[i], at = out[at : at + n], at + n
        return torch.cat([rows[i] for i in range(len(steps))])  # [S + drafts, vocab]
