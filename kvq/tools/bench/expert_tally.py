"""A MoeFn wrapper that tallies what a decode's expert calls cost (`kvq bench model`)."""

from __future__ import annotations

import time
from typing import Any


class ExpertTally:
    """A MoeFn that counts, over the calls with exactly `rows` token rows (decode steps; a
    prefill's calls are left out), the distinct experts each call routes to and the time it
    takes: the expert work per step, which grows with the union of the batch's choices."""

    def __init__(self, fn: Any, rows: int) -> None:
        self.fn, self.rows = fn, rows
        self.calls, self.distinct, self.seconds = 0, 0, 0.0

    def __call__(self, layer: int, x: Any, ids: Any, w: Any) -> Any:
        if x.shape[0] != self.rows:
            return self.fn(layer, x, ids, w)
        t0 = time.perf_counter()
        out = self.fn(layer, x, ids, w)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.distinct += int(ids.unique().numel())
        return out

    def mean_distinct(self) -> float:
        return self.distinct / self.calls if self.calls else 0.0

    def mean_ms(self) -> float:
        return 1e3 * self.seconds / self.calls if self.calls else 0.0

    def share(self, span_s: float) -> float:
        """The tallied calls' share of `span_s` (the decode's wall time)."""
        return self.seconds / span_s if span_s > 0 else 0.0


def span(stamps: list[float]) -> float:
    """Seconds from the first to the last stamp (0 with fewer than two)."""
    return stamps[-1] - stamps[0] if len(stamps) >= 2 else 0.0
