"""Bookkeeping of dynamic updates (numpy): hit-rate tallies, decayed scores, ping-pong watch,
and the one log line each update writes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

SCORE_DECAY = 0.5  # score = SCORE_DECAY * score + counts of the last interval
PINGPONG_UPDATES = 2


@dataclass(frozen=True, slots=True)
class HitRates:
    """Shares of routed (token, expert) pairs served hot and cold, by count and by bytes read."""

    hot: float
    cold: float
    hot_bytes: float
    cold_bytes: float
    routed: int


@dataclass
class Tally:
    """Running sums behind HitRates."""

    hot_n: int = 0
    cold_n: int = 0
    hot_b: int = 0
    cold_b: int = 0

    def add(self, counts: npt.NDArray[np.int64], hot: list[bool], expert_bytes: int) -> None:
        """Add one layer's counts [n] split by its hot mask [n]."""
        h = int(counts[np.asarray(hot, dtype=bool)].sum()) if counts.size else 0
        c = int(counts.sum()) - h
        self.hot_n += h
        self.cold_n += c
        self.hot_b += h * expert_bytes
        self.cold_b += c * expert_bytes

    def merged(self, other: Tally) -> Tally:
        return Tally(
            self.hot_n + other.hot_n,
            self.cold_n + other.cold_n,
            self.hot_b + other.hot_b,
            self.cold_b + other.cold_b,
        )

    def rates(self) -> HitRates:
        n, b = self.hot_n + self.cold_n, self.hot_b + self.cold_b
        return HitRates(
            self.hot_n / n if n else 0.0,
            self.cold_n / n if n else 0.0,
            self.hot_b / b if b else 0.0,
            self.cold_b / b if b else 0.0,
            n,
        )


@dataclass(frozen=True, slots=True)
class UpdateReport:
    """What one update saw (since the previous one) and did."""

    step: int
    update: int
    mode: str  # "dynamic" | "static"
    swaps: int
    rates: HitRates
    pingpong: int  # total so far

    def line(self) -> str:
        r = self.rates
        return (
            f"bank update {self.update} at step {self.step} ({self.mode}): swaps={self.swaps} "
            f"hit rate by count hot={r.hot:.3f} cold={r.cold:.3f}, by bytes "
            f"hot={r.hot_bytes:.3f} cold={r.cold_bytes:.3f} over {r.routed} routed pairs; "
            f"pingpong={self.pingpong}"
        )


@dataclass
class PingPong:
    """Counts experts whose hot/cold status flips twice within PINGPONG_UPDATES updates
    (swapped out and back in, or in and out again): the churn a margin should prevent."""

    last_flip: dict[tuple[int, int], int] = field(default_factory=dict)
    total: int = 0

    def record(self, update: int, layer: int, experts: list[int]) -> None:
        for e in experts:
            before = self.last_flip.get((layer, e))
            if before is not None and update - before <= PINGPONG_UPDATES:
                self.total += 1
            self.last_flip[(layer, e)] = update


def decay(scores: npt.NDArray[np.float64], counts: npt.NDArray[np.int64]) -> None:
    """In place: scores = SCORE_DECAY * scores + counts."""
    scores *= SCORE_DECAY
    scores += counts
