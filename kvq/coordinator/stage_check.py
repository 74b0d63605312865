"""Checks of stage answers (X3 at stage grain): witnessed sequences, and the coordinator as
referee.

A stage holder keeps each sequence's state, so a stage answer cannot be recomputed from the job
alone the way an expert answer is: whoever checks it needs the sequence's state too. So checks
are drawn per sequence and span, when the sequence enters the span at position 0, with the
probability the trust schedule gives the holder's next result (`Verifier.wants_witness`:
`KVQ_VERIFY_REMOTE`, the clean streak, the step floor). A drawn sequence is *witnessed* there:
a second live holder of the span gets each of its jobs on that span too (the same rows in the
same batch, so it builds the same state), and the rows go on only when both answers are in and
agree (`Verifier.agree`: bit for bit where both answers carry one `numerics` label, the same
kind of CPU, kvq and torch: `kvq.device.numerics`; else float32's tolerance, a relative row
error of 1e-3 and a scale bias of 1e-4, since two honest holders of one job differ by about
1e-6 where float32 reductions are ordered differently, `docs/security.md`).

On disagreement the coordinator referees (`Referee`): it maps the span from its own model file
and runs it over the sequence's inputs to the span, chunk by chunk as the holders ran them (the
chain keeps the inputs of witnessed sequences), and the holder that disagrees with it is caught
(quarantined on the board, as at expert grain); the other's answer is used and it keeps the
sequence. With no copy of the span here (a backbone-only file) or a recomputation that agrees
with neither, no answer is used and the step fails with a clear error: never a wrong token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq.coordinator.pending import Answer
from kvq.coordinator.verify import Verifier
from kvq.device import dtype_name, numerics
from kvq.errors import KvqError
from kvq.model import Backbone
from kvq.slices import SliceSpec

log = logging.getLogger("kvq.coordinator")
REFEREE = "coordinator"  # the name the referee's answer goes by


class Referee:
    """Spans of the coordinator's own model file, mapped when first needed."""

    def __init__(self, path: str | Path | None, stages: list[SliceSpec]) -> None:
        self.path, self.stages = path, stages
        self._spans: dict[int, Backbone | None] = {}
        # raises ModelCorrupt if the file's bytes of a span are corrupted (`own_bytes`)
        self.own_bytes: Callable[[str], None] = lambda sid: None

    def numerics(self) -> str:
        """The label of this process's recomputations (`kvq.device.numerics`): the spans run
        on the CPU in float32, as `span` maps them."""
        return numerics(dtype_name(torch.float32, "cpu"))

    def span(self, k: int) -> Backbone | None:
        """Span `k`'s blocks from the file, or None where the file lacks them."""
        if k not in self._spans:
            spec = self.stages[k]
            bb = None
            if self.path is not None:
                try:
                    bb = Backbone.from_gguf(
                        self.path, span=range(spec.layer_start, spec.layer_end), head=False
                    )
                except (KvqError, OSError, KeyError, ValueError) as exc:
                    log.warning("stage %s: the coordinator cannot referee it (%s)", spec.sid, exc)
                if bb is not None and not bb.meta.holds_experts:  # a backbone file
                    log.info(
                        "stage %s: a backbone file holds no routed expert; a third "
                        "holder referees the span",
                        spec.sid,
                    )
                    bb = None
            self._spans[k] = bb
        return self._spans[k]

    @torch.no_grad()
    def recompute(self, k: int, chunks: list[list[torch.Tensor]]) -> torch.Tensor | None:
        """Each sequence's rows leaving span `k` for its last chunk, its state rebuilt from
        its earlier chunks (each [n, H], in the order the holders ran them); None without
        the span here."""
        bb = self.span(k)
        if bb is None:
            return None
        out = []
        for seq_chunks in chunks:
            cache, y = bb.new_cache(), None
            for x in seq_chunks:
                n = int(x.shape[0])
                y = bb.run_span(x.to(bb.device, bb.dtype), [cache], [n])
                Backbone.advance_caches([cache], [n])
            assert y is not None
            out.append(y.float())
        return torch.cat(out)


@dataclass(frozen=True)
class Ruling:
    """What a disagreement came to: whose answer to use (None: none) and who lied."""

    use: Answer | None
    caught: list[str]
    why: str


def rule(
    verifier: Verifier,
    referee: Referee,
    k: int,
    a: Answer,
    b: Answer,
    chunks: list[list[torch.Tensor]],
) -> Ruling:
    """Two holders' answers `a` and `b` to one stage job disagree: the coordinator's own
    recomputation decides (`decide`)."""
    ref = referee.recompute(k, chunks)
    sid = referee.stages[k].sid
    if ref is None:
        verifier.stats.unresolved += 1
        return Ruling(
            None,
            [],
            f"stage {sid}: {a.worker} and {b.worker} disagree and this "
            "coordinator's file lacks the span to decide; no answer is used",
        )
    judge = Answer(REFEREE, ref, a.dtype, referee.numerics())
    if not any(verifier.agree(x, judge, exact=False) for x in (a, b)):
        referee.own_bytes(sid)  # raises ModelCorrupt: the fault may be this coordinator's
    return decide(verifier, sid, a, b, judge)


def decide(verifier: Verifier, sid: str, a: Answer, b: Answer, judge: Answer) -> Ruling:
    """`judge` (the coordinator's recomputation, or a third holder's replay) agrees with one
    of `a` and `b`: that one is used (its streak grows, and a third holder's), the other is
    caught. Agreeing with both or neither: none is used."""
    good = [x for x in (a, b) if verifier.agree(x, judge, exact=False)]
    if len(good) != 1:
        verifier.stats.unresolved += 1
        return Ruling(
            None,
            [],
            f"stage {sid}: {a.worker} and {b.worker} disagree and "
            f"{judge.worker}'s recomputation agrees with {len(good)} of "
            "them; no answer is used",
        )
    (use,) = good
    liar = b if use is a else a
    verifier.confirmed([use] if judge.worker == REFEREE else [use, judge])
    verifier.outvoted(liar, [use, judge] if judge.worker != REFEREE else [use])
    return Ruling(
        use,
        [liar.worker],
        f"{liar.worker}'s answer disagreed with {use.worker}'s and {judge.worker}'s",
    )
