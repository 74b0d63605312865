"""An operator's hand on workers (`kvq.bus.operator`: quarantine, release, drain) on both boards,
as coordinators' trust and the market then read it; and the coordinators' `inflight` records
(what the dashboard's requests table shows)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from boards import BoardCase

from kvq.bus import operator
from kvq.bus.market import VOLUNTEER, MarketDesk
from kvq.bus.records import CoordStats, InFlight, Quarantine, SlotState
from kvq.bus.redis_board import RedisBoard
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.gguf.registry import plan_model
from kvq.tools.synth import make_tiny


@pytest.fixture
def registered(board_case: BoardCase, tmp_path: Path) -> BoardCase:
    """Model `m` (4 slices) with worker `w` holding one."""
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    board_case.board.register_model(plan_model("m", path, 1, 4), base_replicas=1)
    assert board_case.board.volunteer("m", "w") is not None
    return board_case


def trust_of(board: object, now_ms: float) -> Trust:
    trust = Trust(TrustPolicy(), "c1", rng=random.Random(0), clock_ms=lambda: now_ms)
    trust.merge(board.quarantined("m"))  # type: ignore[attr-defined]
    return trust


def test_quarantine_then_release_by_hand(registered: BoardCase) -> None:
    board = registered.board
    assert operator.quarantine(board, "w", "alice", for_s=60) == ["m"], "every model it holds"
    q = board.quarantined("m")["w"]
    now = board.now_ms()
    assert q.operator == "alice" and q.active(now) and not q.banned and not q.drain
    assert q.reason == "quarantined by operator alice"
    assert 59_000 < q.until_ms - now <= 60_000
    assert trust_of(board, now).barred("w")

    assert operator.release(board, "w", "bob") == ["m"]
    q = board.quarantined("m")["w"]
    assert q.operator == "bob" and not q.idle(board.now_ms() + 1)
    assert not trust_of(board, board.now_ms() + 1).idle("w")


def test_a_release_ends_a_coordinators_own_ban(registered: BoardCase) -> None:
    """A coordinator that caught and banned the worker takes the operator's later release."""
    board = registered.board
    now = board.now_ms()
    trust = Trust(TrustPolicy(ban_after=1), "c1", rng=random.Random(0), clock_ms=lambda: now)
    board.quarantine("m", "w", trust.failed("w", "row error 9"))
    assert trust.barred("w") and board.quarantined("m")["w"].banned
    later = now + 5
    trust.clock_ms = lambda: later
    operator.release(board, "w", "alice")
    records = board.quarantined("m")
    assert trust.lost(records) == {}, "the release is in the records: nothing to republish"
    trust.merge(records)
    assert not trust.barred("w") and trust.workers["w"].mismatches == 1, "its count is kept"
    assert trust.lost(board.quarantined("m")) == {}


def test_a_ban_by_hand_lasts_and_the_count_is_kept(registered: BoardCase) -> None:
    board = registered.board
    board.quarantine("m", "w", Quarantine(until_ms=0, mismatches=2, coord="c1"))
    operator.quarantine(board, "w", "alice", models=["m"], ban=True)
    q = board.quarantined("m")["w"]
    assert q.banned and q.mismatches == 2 and q.reason == "banned by operator alice"
    assert trust_of(board, board.now_ms() + 10**9).barred("w")


def test_a_drained_worker_gets_no_work_but_its_results_count(registered: BoardCase) -> None:
    board = registered.board
    assert operator.drain(board, "w", "alice") == ["m"]
    q = board.quarantined("m")["w"]
    assert q.drain and not q.active(board.now_ms()) and q.idle(board.now_ms())
    trust = trust_of(board, board.now_ms())
    assert trust.idle("w"), "routing leaves it out"
    assert not trust.barred("w"), "what it was sent is still used"
    operator.release(board, "w", "alice")
    trust.clock_ms = lambda: board.now_ms() + 1
    trust.merge(board.quarantined("m"))
    assert not trust.idle("w")


def test_the_market_grants_a_drained_worker_nothing(registered: BoardCase) -> None:
    board = registered.board
    if not isinstance(board, RedisBoard):
        pytest.skip("the market desk answers over Redis streams")
    desk = MarketDesk(board, board.r, board.keys, 1000)
    operator.drain(board, "w2", "alice", models=["m"])
    got = desk._answer("w2", {"op": VOLUNTEER, "instance": "i"})
    assert got == {"slice": ""}, got
    operator.release(board, "w2", "alice", models=["m"])
    got = desk._answer("w2", {"op": VOLUNTEER, "instance": "i"})
    assert got.get("model") == "m" and got.get("slice"), got


def test_every_verdict_is_kept_in_order(registered: BoardCase) -> None:
    """The trust history: each verdict on the model's log, newest first, per worker."""
    board = registered.board
    board.quarantine("m", "w", Quarantine(until_ms=1, mismatches=1, coord="c1", reason="x"))
    board.quarantine("m", "other", Quarantine(until_ms=1, mismatches=1, coord="c1"))
    operator.release(board, "w", "alice")
    got = board.verdict_history("m", "w")
    assert [(q.coord, q.operator) for q in got] == [("", "alice"), ("c1", "")]
    assert board.verdict_history("m", "nobody") == []
    assert board.unregister_model("m") == ["w"]
    assert board.verdict_history("m", "w") == [], "gone with the model"


def test_an_action_names_who(registered: BoardCase) -> None:
    with pytest.raises(ValueError, match="who"):
        operator.drain(registered.board, "w", "")


def test_inflight_records_round_trip(board_case: BoardCase) -> None:
    board = board_case.board
    now_ms = int(time.time() * 1000)
    row = InFlight(
        request="r-1",
        model="m",
        coordinator="c1",
        grain="expert",
        state="decode",
        prompt_tokens=5,
        generated=3,
        max_tokens=64,
        queued_ms=now_ms - 1500,
    )
    state = SlotState(model="m", busy=1, total=4, ts_ms=now_ms)
    board.publish_slots("c1", state, CoordStats(), [row])
    board.publish_slots("c2", state, CoordStats())
    assert board.in_flight(["c1", "c2", "c3"]) == [row]
    board.publish_slots("c1", state, CoordStats(), [])
    assert board.in_flight(["c1"]) == [], "replaced whole at each poll"
    if isinstance(board, RedisBoard):
        key = board.keys.coord_inflight("c1")
        assert 0 < board.r.ttl(key) <= board.lifetimes.slots_s()
        board.r.set(key, b'[{"request": 1}]')  # what no coordinator writes: ignored
        assert board.in_flight(["c1"]) == []
