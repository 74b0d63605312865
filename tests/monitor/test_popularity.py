"""Popularity-weighted replica targets: the boost copies follow the rows routed per slice."""

from __future__ import annotations

import time
from pathlib import Path

from boards import BoardCase
from hypothesis import given
from hypothesis import strategies as st

from kvq.bus.records import CoordStats, SlotState
from kvq.config import load_settings
from kvq.monitor import Monitor
from kvq.monitor.popularity import Popularity, spread
from kvq.tools.synth import make_tiny


def test_spread_follows_the_rates_and_keeps_the_total() -> None:
    sids = ["a", "b", "c", "d"]
    got = spread(1, 1, {"a": 55.0, "b": 25.0, "c": 10.0, "d": 10.0}, sids)
    # 4 extra copies: exact shares 2.2, 1.0, 0.4, 0.4 -> 2, 1, 0, 0 and one by remainder
    assert got == {"a": 3, "b": 2, "c": 2, "d": 1}
    assert sum(got.values()) == 4 * (1 + 1) and got["a"] > got["b"] > min(got["c"], got["d"])
    assert spread(1, 2, {}, sids) == dict.fromkeys(sids, 3), "no rows yet: uniform"
    assert spread(1, 0, {"a": 5.0}, sids) == dict.fromkeys(sids, 1), "no boost"


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=12), st.integers(0, 3), st.integers(0, 3))
def test_spread_never_loses_or_invents_copies(rates: list[float], base: int, boost: int) -> None:
    sids = [f"s{i:02d}" for i in range(len(rates))]
    got = spread(base, boost, dict(zip(sids, rates, strict=True)), sids)
    assert sum(got.values()) == (base + boost) * len(sids)
    assert all(v >= base for v in got.values())


def test_popularity_is_the_growth_of_the_counters() -> None:
    pop = Popularity(alpha=0.5)
    assert pop.update("m", {"a": 1000}) == {}, "the first look is history, not a rate"
    assert pop.update("m", {"a": 1010, "b": 4}) == {"a": 10.0, "b": 4.0}
    assert pop.update("m", {"a": 1010, "b": 8}) == {"a": 5.0, "b": 4.0}
    assert pop.update("m", {"a": 0, "b": 8}) == {"a": 2.5, "b": 2.0}, "a reset counts 0"


def test_the_monitor_gives_the_hot_slice_more_copies_while_saturated(
    board_case: BoardCase, tmp_path: Path
) -> None:
    board = board_case.board
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8)
    s = load_settings(
        slice_experts=2,
        base_replicas=1,
        boost_replicas=1,
        saturation_enter_s=0,
        saturation_leave_s=0,
        saturation_threshold=1,
    )
    mon = Monitor(board, s.monitor)
    info = mon.register("m", model)
    hot, *cold = sorted(info.slices)
    now = int(time.time() * 1000)
    board.publish_slots("c1", SlotState(model="m", busy=2, total=4, ts_ms=now), CoordStats())
    board.add_routed("m", {hot: 100, **dict.fromkeys(cold, 1)})
    mon.poll("m")  # first look
    board.add_routed("m", {hot: 700, **dict.fromkeys(cold, 100)})  # hot gets 70% of the rows
    state = mon.poll("m")
    assert state.saturated
    targets = {sid: d.target for sid, d in board.slice_demand("m").items()}
    assert sum(targets.values()) == len(info.slices) * 2, "the uniform boost's total"
    assert targets[hot] == max(targets.values()) and targets[hot] >= 3
    assert all(targets[c] >= 1 for c in cold)
    board.publish_slots("c1", SlotState(model="m", busy=0, total=4, ts_ms=now + 1), CoordStats())
    mon.poll("m")
    assert {d.target for d in board.slice_demand("m").values()} == {1}, "drained: base"
