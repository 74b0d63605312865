"""The monitor's own metrics over time: its Prometheus registry sampled every `SAMPLE_S` into a
`History`, and the helpers that read samples (`pick`, `since`, `increase`). The dashboard's
charts and the alert rules (`kvq.monitor.alerts`) both read it.

A `History` keeps every sample of the last `WINDOW_S` (the alert windows, 10 minutes: 120
samples) and, older than that up to `keep_s` (`KVQ_MONITOR_HISTORY_S`), one sample per
`(keep_s - WINDOW_S) / OLD_POINTS` seconds: at most `MAX_SAMPLES` (393) whatever `keep_s`,
so memory is bounded by a count of samples, not by time. A newest sample taken less than
`SAMPLE_S` after the one before it (a page polling between two ticks) is replaced by the next.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

SAMPLE_S = 5.0
WINDOW_S = 600.0  # alert windows, and every sample kept at full rate: the last 10 minutes
HISTORY_S = 3600.0  # KVQ_MONITOR_HISTORY_S by default: how far back the charts can look
OLD_POINTS = 240  # samples kept older than WINDOW_S (downsampled), whatever keep_s
MAX_SAMPLES = int(WINDOW_S / (0.8 * SAMPLE_S)) + 2 + OLD_POINTS + 1  # what a History holds at most
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
    """The registry's samples, oldest first: all of the last WINDOW_S, then older ones thinned
    to at most OLD_POINTS back to `keep_s`."""

    def __init__(self, read: Callable[[], Series], keep_s: float = HISTORY_S) -> None:
        self.read = read
        self.keep_s = max(float(keep_s), WINDOW_S)
        self.step_s = max(SAMPLE_S, (self.keep_s - WINDOW_S) / OLD_POINTS)  # older spacing
        self._lock = threading.Lock()
        self._recent: deque[Sample] = deque()  # the last WINDOW_S, every sample
        self._old: deque[Sample] = deque()  # older, one per step_s

    def take(self, t: float | None = None) -> Sample:
        """Sample the registry now (`t`: the time to stamp it with, for tests)."""
        s = Sample(time.time() if t is None else t, self.read())
        with self._lock:
            self._add(s)
        return s

    def _add(self, s: Sample) -> None:
        r = self._recent
        if len(r) >= 2 and r[-1].t - r[-2].t < 0.8 * SAMPLE_S:
            r[-1] = s  # the newest was a page's extra sample: replaced, not kept beside
        else:
            self._recent.append(s)
        while self._recent and s.t - self._recent[0].t > WINDOW_S:
            aged = self._recent.popleft()
            if not self._old or aged.t - self._old[-1].t >= self.step_s:
                self._old.append(aged)
        while self._old and s.t - self._old[0].t > self.keep_s:
            self._old.popleft()

    def latest(self, max_age_s: float = SAMPLE_S) -> Sample:
        """The newest sample, taken now when older than `max_age_s`."""
        with self._lock:
            last = self._recent[-1] if self._recent else None
        if last is None or time.time() - last.t > max_age_s:
            return self.take()
        return last

    def samples(self, range_s: float | None = WINDOW_S) -> list[Sample]:
        """The samples of the last `range_s` seconds before the newest (None: all kept),
        oldest first; the default, WINDOW_S, is what the alert rules read."""
        with self._lock:
            if range_s is not None and range_s <= WINDOW_S:
                got = list(self._recent)
            else:
                got = [*self._old, *self._recent]
        if range_s is None or not got:
            return got
        return [s for s in got if got[-1].t - s.t <= range_s]

    def run(self, stop: threading.Event) -> None:
        """Sample every SAMPLE_S until `stop` (the HTTP server's thread companion)."""
        while not stop.wait(SAMPLE_S):
            try:
                self.take()
            except Exception:  # noqa: BLE001 - Redis away: the next sample tries again
                continue


def chart_range(now_t: float, range_s: float, kept_s: float) -> dict[str, float]:
    """The time axis of a page's charts: from `range_s` before the newest sample to it, and
    how much history the monitor keeps (`KVQ_MONITOR_HISTORY_S`: the page's "all kept")."""
    return {
        "from": round(now_t - range_s, 1),
        "to": round(now_t, 1),
        "seconds": range_s,
        "kept_s": kept_s,
    }


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
