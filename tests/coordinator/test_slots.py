"""The coordinator's own slot poll (K2, K5): background, bounded, never blocking dispatch."""

from __future__ import annotations

import threading
import time

from waiting import wait_for

from kvq.coordinator.slots import SlotPoller


def test_loaded_follows_busy_slots() -> None:
    busy = [0]
    published: list[tuple[int, int]] = []
    p = SlotPoller(lambda: busy[0], 4, 2, lambda b, t: published.append((b, t)), 0.01, 1.0)
    p.start()
    try:
        assert not p.loaded
        busy[0] = 2
        wait_for(lambda: p.loaded, 2, "the busy slots to count as load", poll_s=0.005)
        assert (2, 4) in published
    finally:
        p.close()


def test_stuck_publish_never_blocks_and_goes_stale() -> None:
    """A poll stuck in publish: readers answer at once, and the old load expires (K5)."""
    release = threading.Event()
    calls = [0]

    def stuck_publish(busy: int, total: int) -> None:
        calls[0] += 1
        if calls[0] > 1:
            release.wait(10)

    p = SlotPoller(lambda: 4, 4, 2, stuck_publish, 0.01, 0.2)
    p.start()
    try:
        wait_for(lambda: calls[0] > 1, 2, "the poll stuck inside publish")
        t0 = time.perf_counter()
        first = p.loaded
        assert time.perf_counter() - t0 < 0.01
        assert first, "fresh sample: loaded"
        time.sleep(0.3)  # the sample ages past stale_s (0.2 s): the time is what is tested
        assert not p.loaded, "a sample older than stale_s is not load"
    finally:
        release.set()
        p.close()


def test_publish_errors_are_counted_not_raised() -> None:
    def broken(busy: int, total: int) -> None:
        raise ConnectionError("redis down")

    p = SlotPoller(lambda: 3, 4, 2, broken, 0.01, 1.0)
    p.poll_once()
    p.poll_once()
    assert p.failures == 2 and p.loaded
