"""Saturation hysteresis (K6): the boost starts after busy has held for saturation_enter_s
and ends after it has been low for saturation_leave_s; load hovering around the threshold
does not flap it."""

from __future__ import annotations

import random
import time
from pathlib import Path

from boards import BoardCase

from kvq.bus.records import CoordStats, SlotState
from kvq.config import load_settings
from kvq.monitor import Monitor
from kvq.monitor.hysteresis import Hysteresis
from kvq.tools.synth import make_tiny


def test_square_wave_holds_before_each_change() -> None:
    h = Hysteresis(enter_s=2.0, leave_s=10.0)
    assert not h.update(True, 0.0) and not h.update(True, 1.9)
    assert h.update(True, 2.0), "on after 2 s of load"
    assert h.update(False, 3.0) and h.update(False, 12.9)
    assert not h.update(False, 13.0), "off after 10 s quiet"
    assert h.flips == 2


def test_a_break_restarts_the_clock() -> None:
    h = Hysteresis(enter_s=2.0, leave_s=10.0)
    h.update(True, 0.0)
    h.update(False, 1.5)  # a quiet moment before the hold
    assert not h.update(True, 2.5) and not h.update(True, 4.4)
    assert h.update(True, 4.5)


def test_noisy_load_around_the_threshold_flips_at_most_once_in_10_minutes() -> None:
    """Busy samples every second, each above the threshold with probability 1/2: the raw
    signal flips ~300 times in 10 minutes; the state turns on once and stays on."""
    rng = random.Random(0)
    h = Hysteresis(enter_s=2.0, leave_s=30.0)
    raw_flips, last = 0, False
    for t in range(600):
        raw = rng.random() < 0.5
        raw_flips += raw != last
        last = raw
        h.update(raw, float(t))
    assert raw_flips > 200
    assert h.flips <= 1


def test_monitor_boosts_only_after_the_hold(board_case: BoardCase, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=1, experts=8)
    s = load_settings(saturation_enter_s=2.0, saturation_leave_s=5.0).monitor
    now = [100.0]
    mon = Monitor(board_case.board, s, clock=lambda: now[0])
    mon.register("m", path)

    def busy(n: int) -> None:
        state = SlotState(model="m", busy=n, total=4, ts_ms=int(time.time() * 1000))
        board_case.board.publish_slots("c1", state, CoordStats())

    busy(s.saturation_threshold)
    assert not mon.poll("m").saturated
    now[0] += 1.0
    assert not mon.poll("m").saturated
    now[0] += 1.0
    st = mon.poll("m")
    assert st.saturated and st.effective_target == s.base_replicas + s.boost_replicas
    busy(0)
    assert mon.poll("m").saturated, "the quiet clock starts at the first quiet poll"
    now[0] += 4.9
    assert mon.poll("m").saturated, "a short quiet spell keeps the boost"
    now[0] += 0.1
    assert mon.poll("m").effective_target == s.base_replicas
