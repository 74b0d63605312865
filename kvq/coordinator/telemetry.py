"""The coordinator's request telemetry: time to first token, token gaps, finish reasons.

Counted on the engine's thread and published in the stats record at every slot poll
(`CoordStats.ttft_s`, `token_gap_s`, `finishes`); the monitor's `/metrics` exports them.
Times are this process's monotonic clock, from the moment the request is admitted to a slot
(queueing before that shows as `kvq_group_oldest_unread_age_seconds`, `docs/api.md`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from kvq.bus.histogram import Histogram


class RequestTimes:
    """Per-request clocks and the histograms they feed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ttft = Histogram()
        self.gap = Histogram()
        self.finishes: dict[str, int] = {}
        self._admitted: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def admitted(self, request_id: str) -> None:
        self._admitted[request_id] = self.clock()
        self._last.pop(request_id, None)

    def token(self, request_id: str) -> None:
        now = self.clock()
        last = self._last.get(request_id)
        if last is not None:
            self.gap.observe(now - last)
        elif (start := self._admitted.get(request_id)) is not None:
            self.ttft.observe(now - start)
        self._last[request_id] = now

    def finished(self, request_id: str, reason: str) -> None:
        """A `done` (`reason`: eos, length, context) or an error event ("error")."""
        self.finishes[reason] = self.finishes.get(reason, 0) + 1
        self._admitted.pop(request_id, None)
        self._last.pop(request_id, None)

    def finishes_text(self) -> str:
        counts = dict(self.finishes)  # one copy: the slot-poll thread reads while we count
        return json.dumps(dict(sorted(counts.items())))
