"""Both boards keep one contract: the same calls give the same answers.

The market is checked operation by operation: random sequences of volunteer / release / rejoin
/ retire / target changes run on a `MemoryBoard` and on a `RedisBoard` (the Lua scripts on a
real server) side by side, and every answer and the final state must agree. The records'
codecs, the TTL rules and the liveness rules are checked on their own.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import redis
from boards import BoardCase
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import (
    CoordStats,
    Lifetimes,
    ModelState,
    Quarantine,
    SlotState,
    WorkerInfo,
)
from kvq.bus.redis_board import RedisBoard
from kvq.gguf.registry import plan_model
from kvq.keys import Keys
from kvq.local.server import EmbeddedRedis
from kvq.slices import slice_id
from kvq.tools.synth import make_tiny

SIDS = [slice_id(0, 1, 4 * i, 4 * i + 4) for i in range(4)]
WORKERS = ["a", "b", "c", "d", "e"]

some_sids = st.lists(st.sampled_from(SIDS), max_size=4)
ops = st.lists(
    st.one_of(
        # `held`: what the worker knows it holds (a subset after a lost answer, or stale)
        # `room` None (any size) or 0 (a full worker: only gives back lost answers)
        st.tuples(
            st.just("volunteer"), st.sampled_from(WORKERS), some_sids, st.none() | st.just(0)
        ),
        st.tuples(st.just("release"), st.sampled_from(WORKERS), st.none() | st.sampled_from(SIDS)),
        st.tuples(st.just("retire"), st.sampled_from(WORKERS), st.sampled_from(SIDS)),
        st.tuples(st.just("rejoin"), st.sampled_from(WORKERS), some_sids),
        st.tuples(st.just("target"), st.sampled_from(SIDS), st.integers(0, 3)),
        # coordinators count the token rows routed to a slice: the hotter is taken first
        st.tuples(st.just("routed"), st.sampled_from(SIDS), st.integers(1, 50)),
    ),
    max_size=40,
)


def _apply(board: MemoryBoard | RedisBoard, op: tuple[object, ...]) -> object:
    kind, *args = op
    if kind == "target":
        sid, n = args
        board.set_target("m", str(sid), int(str(n)))
        return None
    if kind == "routed":
        sid, n = args
        board.add_routed("m", {str(sid): int(str(n))})
        return None
    if kind == "volunteer":
        worker, held, *room = args
        got = board.volunteer("m", str(worker), room[0] if room else None, list(held))  # type: ignore[call-overload, arg-type]
        return got, board.held_by("m", str(worker))
    if kind == "rejoin":
        worker, sids = args
        return board.rejoin("m", str(worker), *sids)  # type: ignore[misc]
    fn = getattr(board, str(kind))
    return fn("m", *args)


@settings(deadline=None, database=None, max_examples=80)
@given(targets=st.lists(st.integers(0, 3), min_size=4, max_size=4), program=ops)
# equal demand, unequal coverage: the less covered slice wins
@example(targets=[3, 2, 0, 0], program=[("volunteer", "a", []), ("volunteer", "b", [])])
# equal demand and coverage: the lower slice id wins; retire only beyond the target
@example(
    targets=[1, 1, 0, 0],
    program=[
        ("volunteer", "b", []),
        ("rejoin", "a", [SIDS[0]]),
        ("retire", "a", SIDS[0]),
        ("target", SIDS[0], 0),
        ("retire", "a", SIDS[0]),
    ],
)
# one worker takes every wanted slice, a lost answer comes back, then it gives back one, all
@example(
    targets=[1, 2, 1, 0],
    program=[
        ("volunteer", "a", []),
        ("volunteer", "a", [SIDS[1]]),
        ("volunteer", "a", [SIDS[1]]),
        ("volunteer", "a", [SIDS[0], SIDS[1]]),
        ("volunteer", "a", SIDS[:3]),
        ("release", "a", SIDS[0]),
        ("release", "a", None),
    ],
)
# a lost answer of a full worker is given back (room 0), then the slice goes to another
@example(
    targets=[1, 1, 0, 0],
    program=[
        ("volunteer", "a", []),
        ("volunteer", "a", [SIDS[0]]),
        ("volunteer", "a", [SIDS[0]], 0),
        ("volunteer", "b", []),
    ],
)
# a full worker gives up a second copy while a wanted slice has no holder, never a last one
@example(
    targets=[2, 1, 0, 0],
    program=[
        ("volunteer", "a", []),
        ("volunteer", "b", []),
        ("volunteer", "c", []),
        ("retire", "a", SIDS[0]),
        ("release", "b", None),
        ("retire", "a", SIDS[0]),
        ("retire", "c", SIDS[0]),
    ],
)
# coverage first: an uncovered slice before a hot one's second copy; then the hotter of two
@example(
    targets=[3, 1, 2, 2],
    program=[
        ("routed", SIDS[0], 40),
        ("volunteer", "a", []),
        ("volunteer", "b", []),
        ("volunteer", "c", []),
        ("volunteer", "d", []),
        ("routed", SIDS[3], 9),
        ("volunteer", "e", []),
    ],
)
def test_market_answers_match_the_lua_scripts(
    redis_server: EmbeddedRedis, targets: list[int], program: list[tuple[object, ...]]
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        real = RedisBoard(client, Keys(f"c{uuid.uuid4().hex[:10]}"), Lifetimes(6.0, 10.0, 600))
        fake = MemoryBoard()
        for board in (real, fake):
            for sid, n in zip(SIDS, targets, strict=True):
                board.set_target("m", sid, n)
        for op in program:
            assert _apply(real, op) == _apply(fake, op), op
        assert real.assignments("m") == fake.assignments("m")
        assert real.slice_demand("m") == fake.slice_demand("m")
    finally:
        client.close()


# -- records --------------------------------------------------------------------------------
def test_records_round_trip_through_their_hash_form() -> None:
    state = ModelState(
        saturated=True,
        busy=3,
        total=4,
        coordinators=1,
        base_target=1,
        effective_target=2,
        ts_ms=123,
    )
    as_redis = {k.encode(): str(v).encode() for k, v in state.to_hash().items()}
    assert ModelState.from_hash(as_redis) == state
    info = WorkerInfo(model="m", slice=SIDS[0], device="cuda:0", served=7, last_serve_ms=9)
    assert WorkerInfo.from_hash(info.to_hash()) == info


def test_a_corrupt_or_missing_record_reads_as_absent() -> None:
    assert SlotState.from_hash({}) is None
    assert SlotState.from_hash({b"model": b"m", b"busy": b"lots", b"total": b"4"}) is None
    assert ModelState.from_hash({b"saturated": b"1"}) == ModelState(saturated=True)


def test_lifetimes_rules() -> None:
    life = Lifetimes(heartbeat_ttl_s=6.0, slot_state_stale_s=10.0, request_ttl_s=600)
    assert life.heartbeat_ms() == 6000 and life.beat_every_s() == 2.0
    assert life.worker_info_s() > life.heartbeat_ttl_s
    assert life.slots_s() > life.slot_state_stale_s
    now = 1_000_000.0
    fresh = SlotState(model="m", busy=1, total=4, ts_ms=int(now - 10_000))
    stale = SlotState(model="m", busy=1, total=4, ts_ms=int(now - 10_001))
    assert life.coordinator_alive(fresh, now) and not life.coordinator_alive(stale, now)
    assert not life.coordinator_alive(None, now)


# -- views on both boards -------------------------------------------------------------------
def test_workers_view_applies_the_liveness_rule(board_case: BoardCase) -> None:
    board = board_case.board
    board.set_target("m", SIDS[0], 2)
    assert board.volunteer("m", "a") == SIDS[0] and board.volunteer("m", "b") == SIDS[0]
    board.beat("a", WorkerInfo(model="m", slice=SIDS[0], device="cpu", last_serve_ms=5))
    board.beat("b", WorkerInfo(model="m", slice=SIDS[0], device="cpu"))
    board_case.kill_worker("b")
    views = {v.worker_id: v for v in board.workers("m")}
    assert views["a"].alive and views["a"].last_serve_ms == 5
    assert not views["b"].alive and views["b"].slice_id == SIDS[0]
    assert board.worker_alive("a") and not board.worker_alive("b")
    assert not board.worker_alive("nobody")
    board.forget_worker("a")
    assert board.worker_info("a") is None and not board.workers("m")[0].alive


def test_workers_view_has_one_view_per_slice_a_worker_holds(board_case: BoardCase) -> None:
    board = board_case.board
    for sid in SIDS[:3]:
        board.set_target("m", sid, 1)
    held: list[str] = []
    while (sid := board.volunteer("m", "a", None, held)) is not None:
        held.append(sid)
    assert held == SIDS[:3] and board.assignments("m") == {"a": tuple(SIDS[:3])}
    holds = json.dumps({"m": SIDS[:2]})  # SIDS[2] still loading: not routable yet
    board.beat("a", WorkerInfo(model="m", slice=SIDS[2], device="cpu", holds=holds))
    views = board.workers("m")
    assert [(v.worker_id, v.slice_id, v.ready) for v in views] == [
        ("a", SIDS[0], True),
        ("a", SIDS[1], True),
        ("a", SIDS[2], False),
    ]
    assert board.release("m", "a", SIDS[1]) == (SIDS[1],)
    assert [v.slice_id for v in board.workers("m")] == [SIDS[0], SIDS[2]]
    assert board.retire("m", "a", SIDS[0]) is None, "still wanted"
    board.set_target("m", SIDS[0], 0)
    assert board.retire("m", "a", SIDS[0]) == SIDS[0]
    assert board.rejoin("m", "a", SIDS[0], SIDS[1]) == 2
    assert board.assignments("m") == {"a": tuple(SIDS[:3])}
    assert board.release("m", "a") == tuple(SIDS[:3])
    assert board.assignments("m") == {} and board.workers("m") == []


def test_a_second_copy_makes_room_for_an_uncovered_slice(board_case: BoardCase) -> None:
    """Coverage before copies: a copy held elsewhere too may be retired below its target
    while some wanted slice has no holder; the last copy of a slice never."""
    board = board_case.board
    board.set_target("m", SIDS[0], 2)
    board.set_target("m", SIDS[1], 1)
    assert board.volunteer("m", "a", None, []) == SIDS[0]
    assert board.volunteer("m", "b", None, []) == SIDS[1]
    assert board.volunteer("m", "c", None, []) == SIDS[0]
    assert board.retire("m", "a", SIDS[0]) is None, "every slice is covered: the copy stays"
    assert board.release("m", "b") == (SIDS[1],)
    assert board.retire("m", "a", SIDS[0]) == SIDS[0], "SIDS[1] has no holder"
    assert board.retire("m", "c", SIDS[0]) is None, "the last copy stays"
    assert board.volunteer("m", "a", None, []) == SIDS[1], "the uncovered slice first"


def test_a_beat_of_an_older_worker_lists_one_slice_per_model() -> None:
    old = WorkerInfo(model="m", slice=SIDS[0], device="cpu", holds=json.dumps({"m": SIDS[0]}))
    assert old.held() == {"m": (SIDS[0],)} and old.ready_for("m", SIDS[0])
    assert not old.ready_for("m", SIDS[1])


def test_coordinators_view_and_stats(board_case: BoardCase) -> None:
    board = board_case.board
    now_ms = int(time.time() * 1000)
    board.publish_slots(
        "c1",
        SlotState(model="m", busy=2, total=4, ts_ms=now_ms),
        CoordStats(completed=3, hot_hit_rate=0.5),
    )
    (view,) = board.coordinators("m")
    assert (view.coord, view.alive, view.state and view.state.busy) == ("c1", True, 2)
    assert board.coordinator_alive("c1") and not board.coordinator_alive("c2")
    assert board.coord_stats("c1") == CoordStats(completed=3, hot_hit_rate=0.5)
    board.forget_coordinator("m", "c1")
    assert board.coordinators("m") == []


def test_quarantine_verdicts_round_trip_and_the_latest_wins(board_case: BoardCase) -> None:
    board = board_case.board
    assert board.quarantined("m") == {}
    first = Quarantine(until_ms=5_000, mismatches=1, coord="c1", reason="row error 3.1")
    board.quarantine("m", "liar", first)
    board.quarantine("m", "other", Quarantine(until_ms=1, mismatches=1))
    assert board.quarantined("m")["liar"] == first
    banned = Quarantine(until_ms=9_000, mismatches=3, banned=True, coord="c2")
    board.quarantine("m", "liar", banned)
    got = board.quarantined("m")
    assert list(got) == ["liar", "other"] and got["liar"] == banned
    assert got["liar"].active(10**15) and not got["other"].active(2)
    assert board.quarantined("another-model") == {}


def test_a_corrupt_quarantine_value_reads_as_absent(board_case: BoardCase) -> None:
    board = board_case.board
    if not isinstance(board, RedisBoard):
        pytest.skip("only a server can hold a value no board wrote")
    board.r.hset(board.keys.model_quarantine("m"), "w", b"{not json")
    assert board.quarantined("m") == {}


def test_register_and_read_back_a_model(board_case: BoardCase, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    info = plan_model("m", path, 1, 4)
    board_case.board.register_model(info, base_replicas=2)
    assert board_case.board.model_info("m") == info
    assert board_case.board.model_info("other") is None
    assert {d.target for d in board_case.board.slice_demand("m").values()} == {2}
    state = ModelState(effective_target=3, ts_ms=1)
    board_case.board.publish_model_state("m", state)
    assert board_case.board.model_state("m") == state
    assert {d.target for d in board_case.board.slice_demand("m").values()} == {3}


def test_unregister_removes_a_model_until_registered_again(
    board_case: BoardCase, tmp_path: Path
) -> None:
    board = board_case.board
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    info = plan_model("m", path, 1, 4)
    board.register_model(info, base_replicas=1)
    sid = board.volunteer("m", "w1")
    assert sid is not None and not board.model_removed("m")
    assert board.unregister_model("m") == ["w1"]
    assert board.models() == [] and board.model_info("m") is None
    assert board.assignments("m") == {} and board.slice_demand("m") == {}
    assert board.model_removed("m") and not board.model_intact("m")
    assert board.register_model(info, 1, restore=True) is False, "no restore of a removed model"
    assert board.models() == []
    assert board.register_model(info, 1) is True and board.models() == ["m"]
    assert not board.model_removed("m")


def test_a_coordinator_that_ran_on_after_a_removal_leaves_nothing(
    board_case: BoardCase, tmp_path: Path
) -> None:
    """What a coordinator wrote of a model after `kvq model rm --force` (its slot poll, routed
    counts, a verdict) goes with `forget_removed_model`; a registered model's stays."""
    board = board_case.board
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    info = plan_model("m", path, 1, 4)
    board.register_model(info, base_replicas=1)
    sid = sorted(info.slices)[0]

    def write() -> None:  # what a running coordinator writes of the model
        now = int(board.now_ms())
        board.publish_slots("c1", SlotState(model="m", busy=0, total=4, ts_ms=now), CoordStats())
        board.add_routed("m", {sid: 3})
        board.quarantine("m", "w1", Quarantine(until_ms=now + 1000, mismatches=1))

    write()
    board.forget_removed_model("m", 1)
    assert board.coordinators("m") and board.quarantined("m"), "registered: nothing deleted"
    board.unregister_model("m")
    write()
    board.forget_removed_model("m", 1)
    assert board.coordinators("m") == [] and board.quarantined("m") == {}
    assert board.routed("m") == {} and board.model_removed("m")


@pytest.mark.parametrize("kind", ["memory"])
def test_memory_board_expires_heartbeats_on_its_clock(kind: str) -> None:
    now = [1000.0]
    board = MemoryBoard(Lifetimes(1.0, 10.0, 600), clock=lambda: now[0])
    board.set_target("m", SIDS[0], 1)
    board.volunteer("m", "a")
    board.beat("a", WorkerInfo(model="m", slice=SIDS[0], device="cpu"))
    now[0] += 0.9
    assert board.workers("m")[0].alive
    now[0] += 0.2
    assert not board.workers("m")[0].alive
    assert board.worker_info("a") is not None, "info outlives the heartbeat"
