"""Departed and stale workers on the dashboard (real Redis): a worker whose heartbeat is late
shows as late at once, as lost once it expired, and after the monitor reaps it stays listed
for an hour with when and why; a worker back since is no longer listed as departed."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry
from waiting import wait_for

from kvq.bus.records import DEPARTED_KEEP_S, Departure, Quarantine, WorkerInfo
from kvq.config import Settings
from kvq.monitor import Monitor
from kvq.monitor.coverage import sid_ranges
from kvq.monitor.dashboard import Dashboard
from kvq.tools.synth import make_tiny


def test_late_then_lost_then_departed_with_when_and_why(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, seed=1)
    mon = Monitor.from_settings(settings)
    mon.register("tiny", path)
    board = mon.board
    dash = Dashboard(board, CollectorRegistry())
    sid = board.volunteer("tiny", "w1")
    assert sid is not None
    board.beat("w1", WorkerInfo(model="tiny", slice=sid, device="cpu"))  # its only beat

    def state() -> str:
        (row,) = dash.snapshot()["workers"]
        return str(row["state"])

    assert state() == "serving"
    wait_for(lambda: state() == "late", 5, "late: more than half the 1 s lifetime since a beat")
    wait_for(lambda: state() == "lost", 5, "lost: the heartbeat expired, not reaped yet")
    assert dash.snapshot()["departed"] == []
    assert mon.reap("tiny") == ["w1"]
    snap = dash.snapshot()
    assert snap["workers"] == []
    (gone,) = snap["departed"]
    assert gone["worker"] == "w1" and 0 <= gone["ago_s"] < 60
    assert gone["why"] == "lost: no heartbeat for 1s (KVQ_HEARTBEAT_TTL_S); reaped"
    assert gone["held"] == f"tiny: 1 slice(s), {' '.join(sid_ranges([sid]))}"
    assert abs(gone["when_ms"] - board.now_ms()) < 60_000
    board.rejoin("tiny", "w1", sid)  # it comes back
    board.beat("w1", WorkerInfo(model="tiny", slice=sid, device="cpu"))
    assert dash.snapshot()["departed"] == [], "a worker back since is not departed"
    board.r.close()


def test_departures_older_than_an_hour_are_dropped(settings: Settings) -> None:
    mon = Monitor.from_settings(settings)
    board = mon.board
    now = int(board.now_ms())
    board.record_departure("old", Departure(ts_ms=now - int(DEPARTED_KEEP_S * 1000) - 1, why="x"))
    assert board.departures() == {}, "past the hour: not listed"
    board.record_departure("new", Departure(ts_ms=now, why="y"))
    assert list(board.departures()) == ["new"]
    assert board.r.hkeys(board.keys.departed()) == [b"new"], "the old one deleted on a write"
    board.r.close()


def test_a_worker_that_gives_its_slices_back_or_is_quarantined_is_departed_with_why(
    settings: Settings, tmp_path: Path
) -> None:
    path = tmp_path / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, seed=1)
    mon = Monitor.from_settings(settings.model_copy(update={"base_replicas": 2}))
    mon.register("tiny", path)
    board = mon.board
    held = {}
    for w in ("w1", "w2", "w3"):
        sid = board.volunteer("tiny", w)
        assert sid is not None
        held[w] = sid
        board.beat(w, WorkerInfo(model="tiny", slice=sid, device="cpu"))
    mon.tick()  # the monitor sees who holds what
    board.release("tiny", "w1")  # a clean stop gives every slice back (`Membership.leave`)
    board.forget_worker("w1")
    until = int(board.now_ms()) + 60_000
    board.quarantine("tiny", "w2", Quarantine(until_ms=until, mismatches=1, reason="test"))
    mon.tick()
    got = {w: d.why for w, d in board.departures().items()}
    assert got == {
        "w1": "left: gave its slices back (a clean stop or a wind-down)",
        "w2": "quarantined: its slices taken back (wrong results)",
    }
    assert board.departures()["w1"].held == f"tiny: 1 slice(s), {sid_ranges([held['w1']])[0]}"
    board.r.close()


def test_the_monitor_takes_a_drained_worker_s_slices_back_once_its_work_is_done(
    settings: Settings, tmp_path: Path
) -> None:
    """A drained worker that cannot read verdicts (a `kvq acl` user: it asks the monitor's
    market, which refuses its rejoin while drained) gets its slices taken back by the monitor
    once a beat after the drain says nothing is on its plate; not before."""
    path = tmp_path / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, seed=1)
    mon = Monitor.from_settings(settings)
    mon.register("tiny", path)
    board = mon.board
    held = [board.volunteer("tiny", "w1", None, [])]
    held.append(board.volunteer("tiny", "w1", None, held))
    assert None not in held

    def beat(queued_rows: int) -> None:
        holds = json.dumps({"tiny": held})
        info = WorkerInfo(
            model="tiny", slice=str(held[-1]), device="cpu", holds=holds, queued_rows=queued_rows
        )
        board.beat("w1", info)

    def drain(age_s: float) -> None:  # `kvq workers drain`'s verdict, `age_s` old
        ts = int(board.now_ms() - age_s * 1000)
        verdict = Quarantine(until_ms=0, mismatches=0, ts_ms=ts, operator="ops", drain=True)
        board.quarantine("tiny", "w1", verdict)

    beat(0)
    mon.tick()
    drain(0.0)
    mon.tick()
    assert len(board.held_by("tiny", "w1")) == 2, "no beat since the drain yet"
    drain(5.0)  # older than the 1 s heartbeat lifetime: beats since
    beat(7)
    mon.tick()
    assert len(board.held_by("tiny", "w1")) == 2, "7 rows on its plate: its work first"
    beat(0)
    mon.tick()
    assert board.held_by("tiny", "w1") == ()
    assert {d.coverage for d in board.slice_demand("tiny").values()} == {0}
    why = board.departures()["w1"].why
    assert why == "drained by operator ops: its slices taken back once its work was done", why
    board.r.close()
