"""Run an engine's admitted sequences to the end, timed: the decode loop the engine benches
(`kvq bench structured`, `kvq bench speculative`) share, and the medians they report."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Drained:
    wall_s: float  # from after the first step (every prefill, each first token) to the end
    steps: int
    seq_passes: int  # sequences in each step after the first, summed
    tokens: int  # generated after each sequence's first
    generated: list[list[int]]

    def figures(self) -> dict[str, Any]:
        """tok/s, tokens, steps and ms a step, as both benches report them."""
        return {
            "tok_s": self.tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "tokens": self.tokens,
            "steps": self.steps,
            "ms_per_step": 1000 * self.wall_s / max(self.steps, 1),
        }


def drain(engine: Any) -> Drained:
    """Step `engine` (local experts) until no sequence is left."""
    bb, seqs = engine.backbone, list(engine.active)
    engine.step(bb.local_moe, lambda _s: None)  # prefill of all, first token of each
    t1, steps, seq_passes = time.perf_counter(), 0, 0
    while engine.busy:
        seq_passes += engine.busy
        engine.step(bb.local_moe, lambda _s: None)
        steps += 1
    wall = time.perf_counter() - t1
    tokens = sum(max(0, len(s.generated) - 1) for s in seqs)
    return Drained(wall, steps, seq_passes, tokens, [list(s.generated) for s in seqs])


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per sequence count, the median of each figure over the rounds (`generated` left out)."""
    return {
        n: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0] if k != "generated"}
        for n, rs in runs.items()
    }
