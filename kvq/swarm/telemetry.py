"""Node telemetry (H1, H4, H5): EWMAs of latency, load and score, and the per-node cost of H3.

A node is *unmeasured* until its first sample of any kind. Unmeasured, it is penalised, not
ignored (H4): its latency is its declared latency or `UNMEASURED_LATENCY_MS`, and its load is
`UNMEASURED_LOAD`. Once measured, a term that has no sample yet takes its declared value
(latency) or 0 (load). The first sample of a term sets it; later ones blend with weight `alpha`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvq.swarm.types import CostWeights

UNMEASURED_LATENCY_MS = 50.0
UNMEASURED_LOAD = 0.25
MIN_SCORE = 0.01
LOAD_SCALE = 120.0
SCORE_SCALE = 100.0
HOP_COST = 15.0
TOKENS_COST = 10.0  # per 1024 prompt tokens


@dataclass(slots=True)
class NodeTelemetry:
    """What the router knows about one node right now."""

    declared_latency_ms: float | None = None
    score: float = 1.0
    latency_ms: float | None = None
    load: float | None = None
    alive: bool = True

    @property
    def measured(self) -> bool:
        return self.latency_ms is not None or self.load is not None

    def observe(
        self,
        alpha: float,
        latency_ms: float | None = None,
        load: float | None = None,
        score: float | None = None,
    ) -> None:
        """Blends new samples into the EWMAs (`alpha` = weight of the new sample); a non-finite
        sample is ignored, so one bad measurement cannot poison the cost."""
        if latency_ms is not None and not math.isfinite(latency_ms):
            latency_ms = None
        if load is not None and not math.isfinite(load):
            load = None
        if score is not None and not math.isfinite(score):
            score = None
        if latency_ms is not None:
            lat = max(0.0, latency_ms)
            self.latency_ms = (
                lat
                if self.latency_ms is None
                else self.latency_ms + alpha * (lat - self.latency_ms)
            )
        if load is not None:
            ld = min(1.0, max(0.0, load))
            self.load = ld if self.load is None else self.load + alpha * (ld - self.load)
        if score is not None:
            self.score = self.score + alpha * (max(0.0, score) - self.score)

    def relax(self, fraction: float, prior_ms: float = UNMEASURED_LATENCY_MS) -> None:
        """Move the latency estimate `fraction` (0..1) of the way back to `prior_ms`: what
        is known of a node fades when it sends no samples."""
        if self.latency_ms is not None and 0.0 < fraction <= 1.0:
            self.latency_ms += fraction * (prior_ms - self.latency_ms)

    def effective(self) -> tuple[float, float, float]:
        """(latency_ms, load, score) as the cost sees them, H4 penalty included."""
        declared = (
            UNMEASURED_LATENCY_MS if self.declared_latency_ms is None else self.declared_latency_ms
        )
        if not self.measured:
            return declared, UNMEASURED_LOAD, self.score
        lat = declared if self.latency_ms is None else self.latency_ms
        return lat, 0.0 if self.load is None else self.load, self.score


def node_cost(t: NodeTelemetry, w: CostWeights) -> float:
    """H3: `w_l*latency + w_c*load*120 + w_k*100/max(score, 0.01)`."""
    lat, load, score = t.effective()
    return w.w_l * lat + w.w_c * load * LOAD_SCALE + w.w_k * SCORE_SCALE / max(score, MIN_SCORE)


def hops_cost(hops: int, w: CostWeights) -> float:
    return w.w_h * HOP_COST * hops


def tokens_cost(tokens: int, w: CostWeights) -> float:
    return w.w_p * TOKENS_COST * tokens / 1024
