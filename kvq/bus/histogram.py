"""A fixed-bucket latency histogram that a process counts in and publishes as text.

A coordinator has no HTTP port: it counts its latencies here and publishes them in its stats
record (`P:{c:C}:stats`, `kvq.bus.records.CoordStats`), and the monitor's `/metrics` turns them
into Prometheus histograms (`kvq.monitor.metrics`). The text is JSON
`{"le": [upper bounds], "counts": [per bucket, the last one is +Inf], "sum": seconds}`, so a
reader needs no agreement on the buckets.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field

# seconds: 1 ms (a local job round trip) to a minute (a long queue before the first token)
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass
class Histogram:
    """Counts per bucket (`le` upper bounds, then +Inf) and the sum of the observations."""

    le: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.le) + 1)
        if len(self.counts) != len(self.le) + 1:
            raise ValueError(f"{len(self.counts)} counts for {len(self.le)} bounds + Inf")

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.le, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound as text, observations <= it), ending with +Inf."""
        out, total = [], 0
        for bound, n in zip((*self.le, math.inf), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(bound), total))
        return out

    def to_text(self) -> str:
        # one copy of the counts, so a reader on another thread sees a consistent histogram
        counts = list(self.counts)
        return json.dumps({"le": list(self.le), "counts": counts, "sum": round(self.sum, 6)})

    @classmethod
    def from_text(cls, text: str) -> Histogram | None:
        """The histogram, or None for empty or malformed text (an old or corrupt record)."""
        if not text:
            return None
        try:
            d = json.loads(text)
            return cls(
                tuple(float(b) for b in d["le"]), [int(n) for n in d["counts"]], float(d["sum"])
            )
        except (ValueError, KeyError, TypeError):
            return None
