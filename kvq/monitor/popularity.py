"""Replica targets weighted by routed demand (K7): hot slices get more copies.

Coordinators add the token rows they route to each slice to `P:{m:M}:routed` (a counter per
slice). Each monitor tick turns the counters' growth into a per-slice rate (an EWMA with
weight `alpha` per tick) and, while the model is saturated, spreads the boost copies over the
slices in proportion to those rates: the same total as a uniform boost (`boost x slices`), but
a slice that gets 40% of the rows gets 40% of the extra copies. EPLB does this for the experts
of one GPU cluster; here the copies are volunteers' slices.

Without any routed rows yet (or with a zero boost) every slice gets the uniform target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


class Popularity:
    """Per model: the last counters seen and the EWMA of their growth per tick."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._last: dict[str, dict[str, int]] = {}
        self._rate: dict[str, dict[str, float]] = {}

    def update(self, model: str, counters: Mapping[str, int]) -> dict[str, float]:
        """Feed this tick's counters; returns the smoothed rows per tick of each slice."""
        last = self._last.get(model)
        rate = self._rate.setdefault(model, {})
        self._last[model] = dict(counters)
        if last is None:  # first look: the counters hold all history, not one tick
            return dict(rate)
        for sid, n in counters.items():
            delta = max(0, n - last.get(sid, 0))  # a reset counter (Redis lost it) counts 0
            old = rate.get(sid)
            rate[sid] = delta if old is None else old + self.alpha * (delta - old)
        return dict(rate)


def spread(
    base: int, boost: int, rates: Mapping[str, float], sids: Sequence[str]
) -> dict[str, int]:
    """Targets for `sids`: `base` each plus `boost x len(sids)` extra copies shared by `rates`
    (largest remainder; ties to the smaller slice id). Uniform when no slice has a rate."""
    extra = boost * len(sids)
    weights = {s: max(0.0, rates.get(s, 0.0)) for s in sids}
    total = sum(weights.values())
    if extra <= 0 or total <= 0 or not math.isfinite(total):
        return dict.fromkeys(sids, base + boost)
    exact = {s: extra * w / total for s, w in weights.items()}
    out = {s: base + math.floor(v) for s, v in exact.items()}
    left = extra - sum(math.floor(v) for v in exact.values())
    for s in sorted(sids, key=lambda s: (-(exact[s] - math.floor(exact[s])), s))[:left]:
        out[s] += 1
    return out
