"""How often a priced-out worker is re-probed (K4 under load), and why not always as often.

A re-probe gives a worker that no route has used for `reprobe_ms` one job, and its answer
replaces the worker's estimate: a worker that was slow for a moment (a busy shared machine)
wins its share back at once. A worker can game that: answer the probe at once and its other
jobs just before the deadline, so that every probe buys it a few slow jobs that hold up their
layers (the "degrader"; `docs/security.md`). So each worker's jobs after a probe are held to
the probe's answer: one more than `SLOWER` times slower (and `SLACK_MS` beyond it) doubles the
wait before its next probe, up to `MAX_FACTOR` times `reprobe_ms`; `KEEP` jobs that keep to it
bring the wait back to `reprobe_ms`. An honest worker that got faster keeps its share; a
degrader's share falls geometrically.
"""

from __future__ import annotations

SLOWER = 3.0  # a job this many times the probe's latency is a broken promise
SLACK_MS = 20.0  # ... and at least this much slower (jitter on a fast link is not)
KEEP = 5  # jobs after a probe that keep to it: the wait is back to reprobe_ms
MAX_FACTOR = 64.0


class ProbeBackoff:
    """Per worker: the factor on `reprobe_ms` before its next probe."""

    def __init__(self) -> None:
        self.factor: dict[str, float] = {}
        self._promise: dict[str, float] = {}  # worker -> its last probe's latency (ms)
        self._kept: dict[str, int] = {}

    def wait(self, worker: str, reprobe: float) -> float:
        """How long `worker` must go without a job before its next probe."""
        return reprobe * self.factor.get(worker, 1.0)

    def probed(self, worker: str, latency_ms: float) -> None:
        """A probe's answer came back after `latency_ms`: later jobs are held to it."""
        self._promise[worker] = max(0.0, latency_ms)
        self._kept[worker] = 0

    def observed(self, worker: str, latency_ms: float) -> None:
        """A job other than a probe took `latency_ms` (a failure or a missed deadline: inf)."""
        promise = self._promise.get(worker)
        if promise is None:
            return
        if latency_ms > max(SLOWER * promise, promise + SLACK_MS):
            self.factor[worker] = min(MAX_FACTOR, 2.0 * self.factor.get(worker, 1.0))
            del self._promise[worker]
            return
        self._kept[worker] = self._kept.get(worker, 0) + 1
        if self._kept[worker] >= KEEP:
            self.factor.pop(worker, None)
            del self._promise[worker]
