"""The coordinator's own slot poll (K2, K5): a background thread, bounded in time.

Every `slot_poll_s` it samples the engine's busy slots and publishes them for the monitor; the
engine loop also notes its count after each admission (no I/O), so load is seen at once.
Dispatch never waits for it: it reads the last sample (`loaded`), and a sample older than
`slot_state_stale_s` counts as "not loaded", so a stuck poll degrades to the fast local path
(K1) instead of blocking or keeping stale load alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("kvq.coordinator")


@dataclass(frozen=True, slots=True)
class SlotSample:
    busy: int
    total: int
    at: float  # time.monotonic() of the sample


class SlotPoller:
    """Samples `read_busy()` on a thread; `publish(busy, total)` sends it out (may be slow)."""

    def __init__(
        self,
        read_busy: Callable[[], int],
        total: int,
        threshold: int,
        publish: Callable[[int, int], None],
        poll_s: float,
        stale_s: float,
    ) -> None:
        self._read_busy, self._publish = read_busy, publish
        self.total, self.threshold = total, threshold
        self.poll_s, self.stale_s = poll_s, stale_s
        self.sample = SlotSample(0, total, time.monotonic())
        self.stop = threading.Event()
        self.failures = 0
        self._thread = threading.Thread(target=self._loop, name="slot-poll", daemon=True)

    def start(self) -> None:
        """Sample now (no I/O) and start polling; the first publish happens on the thread."""
        self.note(self._read_busy())
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=self.poll_s + 1)

    @property
    def loaded(self) -> bool:
        """Busy slots >= threshold in a fresh sample (K2); a stale sample is not load (K5)."""
        return self.current()[0] >= self.threshold

    def current(self) -> tuple[int, int]:
        """(busy, total) of the last sample, with busy 0 once it is stale (K5)."""
        s = self.sample
        fresh = time.monotonic() - s.at <= self.stale_s
        return (s.busy if fresh else 0), s.total

    def note(self, busy: int) -> None:
        """The engine's own count after admitting or retiring (no I/O): dispatch sees load at
        once instead of up to `poll_s` later; publishing stays on the poll thread."""
        self.sample = SlotSample(busy, self.total, time.monotonic())

    def poll_once(self) -> SlotSample:
        sample = SlotSample(self._read_busy(), self.total, time.monotonic())
        self.sample = sample  # one reference swap: readers see a whole sample or the last one
        try:
            self._publish(sample.busy, sample.total)
            self.failures = 0
        except Exception as exc:  # noqa: BLE001 - a failed publish must not stop the poll
            self.failures += 1
            if self.failures == 1:
                log.warning("publishing slot state failed: %s", exc)
        return sample

    def _loop(self) -> None:
        self.poll_once()
        while not self.stop.wait(self.poll_s):
            self.poll_once()
