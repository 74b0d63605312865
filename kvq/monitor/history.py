"""The monitor's own metrics over time: its Prometheus registry sampled every `SAMPLE_S` into a
`History` of the last `WINDOW_S`, and the helpers that read samples (`pick`, `since`,
`increase`). The dashboard's charts and the alert rules (`kvq.monitor.alerts`) both read it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

SAMPLE_S = 5.0
WINDOW_S = 600.0  # charts and alert windows: the last 10 minutes
Labels = tuple[tuple[str, str], ...]
Series = dict[tuple[str, Labels], float]


def read_registry(registry: CollectorRegistry) -> Series:
    """Every sample of the registry: (sample name, sorted labels) -> value."""
    out: Series = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # wall clock, seconds
    series: Series


class History:
    """The registry's samples over the last WINDOW_S, oldest first."""

    def __init__(self, read: Callable[[], Series]) -> None:
        self.read = read
        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque()

    def take(self) -> Sample:
        s = Sample(time.time(), self.read())
        with self._lock:
            self._samples.append(s)
            while self._samples and s.t - self._samples[0].t > WINDOW_S:
                self._samples.popleft()
        return s

    def latest(self, max_age_s: float = SAMPLE_S) -> Sample:
        """The newest sample, taken now when older than `max_age_s`."""
        with self._lock:
            last = self._samples[-1] if self._samples else None
        if last is None or time.time() - last.t > max_age_s:
            return self.take()
        return last

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def run(self, stop: threading.Event) -> None:
        """Sample every SAMPLE_S until `stop` (the HTTP server's thread companion)."""
        while not stop.wait(SAMPLE_S):
            try:
                self.take()
            except Exception:  # noqa: BLE001 - Redis away: the next sample tries again
                continue


def pick(series: Series, name: str, **want: str) -> list[tuple[dict[str, str], float]]:
    """The samples named `name` whose labels include `want`."""
    return [
        (dict(labels), v)
        for (n, labels), v in series.items()
        if n == name and all(dict(labels).get(k) == x for k, x in want.items())
    ]


def since(samples: list[Sample], window_s: float) -> tuple[Sample, Sample] | None:
    """The oldest sample within `window_s` of the newest, and the newest; None with one."""
    if len(samples) < 2:
        return None
    last = samples[-1]
    first = next(s for s in samples if last.t - s.t <= window_s)
    return (first, last) if first is not last else None


def increase(pair: tuple[Sample, Sample] | None, name: str, **want: str) -> dict[Labels, float]:
    """Per label set, how much the counter `name` grew between the two samples."""
    if pair is None:
        return {}
    a, b = pair
    before = {tuple(sorted(lb.items())): v for lb, v in pick(a.series, name, **want)}
    return {
        tuple(sorted(lb.items())): max(0.0, v - before.get(tuple(sorted(lb.items())), 0.0))
        for lb, v in pick(b.series, name, **want)
    }
