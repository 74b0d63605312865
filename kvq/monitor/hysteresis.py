"""Saturation with hysteresis (K6): a raw signal must hold before the state follows it.

The raw signal (some coordinator has `busy >= threshold`) flickers with every burst and every
quiet moment of a load that hovers around the threshold. Boosting on each flicker recruits
workers that download a slice, then winds them down again. So the state turns on only after
the raw signal has been on for `enter_s` without a break, and off only after it has been off
for `leave_s`; each disagreement restarts its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Hysteresis:
    enter_s: float
    leave_s: float
    on: bool = False
    since: float | None = None  # when the raw signal began to disagree with `on`
    flips: int = 0

    def update(self, raw: bool, now: float) -> bool:
        """The state after seeing `raw` at time `now` (seconds, monotonic)."""
        if raw == self.on:
            self.since = None
            return self.on
        if self.since is None:
            self.since = now
        if now - self.since >= (self.enter_s if raw else self.leave_s):
            self.on, self.since = raw, None
            self.flips += 1
        return self.on
