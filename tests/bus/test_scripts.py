"""kvq.bus.scripts (the Lua scripts) against a real server: volunteer, release, rejoin."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
import redis

from kvq.bus import Scripts
from kvq.config import Settings
from kvq.keys import Keys, join_slices
from kvq.slices import slice_id

MODEL = "tiny"
S = [slice_id(0, 1, 4 * i, 4 * i + 4) for i in range(6)]  # S[0] < S[1] < ... as strings


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)


@pytest.fixture
def scripts(r: redis.Redis, keys: Keys) -> Scripts:
    return Scripts(r, keys)


def set_target(r: redis.Redis, keys: Keys, target: dict[str, int]) -> None:
    r.delete(keys.model_target(MODEL))
    if target:
        r.hset(keys.model_target(MODEL), mapping=target)


def set_coverage(r: redis.Redis, keys: Keys, coverage: dict[str, int]) -> None:
    r.delete(keys.model_coverage(MODEL))
    if coverage:
        r.hset(keys.model_coverage(MODEL), mapping=coverage)


def coverage(r: redis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(keys.model_coverage(MODEL)).items()}


def workers(r: redis.Redis, keys: Keys) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(keys.model_workers(MODEL)).items()}


# -- volunteer -----------------------------------------------------------------------------
def test_volunteer_takes_largest_demand(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 3, S[2]: 2})
    assert scripts.volunteer(r, MODEL, "w1") == S[1]
    assert coverage(r, keys) == {S[1]: 1}
    assert workers(r, keys) == {"w1": S[1]}


def test_volunteer_counts_coverage_in_demand(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 3, S[1]: 4})
    set_coverage(r, keys, {S[1]: 3})  # demand: S0 = 3, S1 = 1
    assert scripts.volunteer(r, MODEL, "w1") == S[0]


def test_volunteer_tie_goes_to_lower_coverage(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    # equal demand 2; S[1] has less coverage, though S[0] sorts first
    set_target(r, keys, {S[0]: 3, S[1]: 2})
    set_coverage(r, keys, {S[0]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[1]


def test_volunteer_tie_goes_to_lower_coverage_reversed(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[0]: 2, S[1]: 3})
    set_coverage(r, keys, {S[1]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]


def test_volunteer_full_tie_goes_to_lower_slice_id(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[3]: 1, S[1]: 1, S[2]: 1, S[4]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[1]
    assert scripts.volunteer(r, MODEL, "w2") == S[2]
    assert scripts.volunteer(r, MODEL, "w3") == S[3]
    assert scripts.volunteer(r, MODEL, "w4") == S[4]
    assert scripts.volunteer(r, MODEL, "w5") is None


def test_volunteer_covers_every_slice_before_any_second_copy(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    """Issue 33 item 2: a hot slice boosted to 4 copies (demand 3) waits until the cold,
    uncovered ones (demand 1) have a holder each."""
    set_target(r, keys, {S[0]: 4, S[1]: 1, S[2]: 1})
    set_coverage(r, keys, {S[0]: 1})
    r.hset(keys.model_routed(MODEL), mapping={S[0]: 1000})
    assert [scripts.volunteer(r, MODEL, w) for w in ("w1", "w2", "w3")] == [S[1], S[2], S[0]]


def test_volunteer_takes_the_hottest_of_the_covered_slices(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    """Every slice held once, two copies wanted of each: the slice with the most token rows
    routed to it gets its second copy first, whatever its id."""
    set_target(r, keys, {S[0]: 2, S[1]: 2, S[2]: 2})
    set_coverage(r, keys, {S[0]: 1, S[1]: 1, S[2]: 1})
    r.hset(keys.model_routed(MODEL), mapping={S[0]: 5, S[1]: 70, S[2]: 30})
    assert [scripts.volunteer(r, MODEL, w) for w in ("w1", "w2", "w3")] == [S[1], S[2], S[0]]


def test_volunteer_sequence_spreads_replicas(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 2, S[1]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]  # demand 2 vs 1
    assert scripts.volunteer(r, MODEL, "w2") == S[1]  # 1 vs 1, coverage 1 vs 0
    assert scripts.volunteer(r, MODEL, "w3") == S[0]
    assert scripts.volunteer(r, MODEL, "w4") is None
    assert coverage(r, keys) == {S[0]: 2, S[1]: 1}
    assert workers(r, keys) == {"w1": S[0], "w2": S[1], "w3": S[0]}


@pytest.mark.parametrize(
    ("target", "cov"),
    [
        ({}, {}),
        ({S[0]: 1}, {S[0]: 1}),
        ({S[0]: 0, S[1]: 0}, {}),
        ({S[0]: 1}, {S[0]: 3}),  # over-covered: negative demand
        ({S[0]: -2}, {}),
    ],
    ids=["no-target", "covered", "zero", "over-covered", "negative"],
)
def test_volunteer_none_without_demand(
    r: redis.Redis, keys: Keys, scripts: Scripts, target: dict[str, int], cov: dict[str, int]
) -> None:
    set_target(r, keys, target)
    set_coverage(r, keys, cov)
    assert scripts.volunteer(r, MODEL, "w1") is None
    assert coverage(r, keys) == cov
    assert workers(r, keys) == {}


def test_volunteer_is_idempotent(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 2})
    got = scripts.volunteer(r, MODEL, "w1")
    assert got == S[1]
    for _ in range(3):
        assert scripts.volunteer(r, MODEL, "w1") == got
    assert coverage(r, keys) == {S[1]: 1}
    set_target(r, keys, {})  # even when the slice is no longer wanted
    assert scripts.volunteer(r, MODEL, "w1") == got
    assert coverage(r, keys) == {S[1]: 1}


def test_volunteer_models_are_separate(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1})
    r.hset(keys.model_target("other"), mapping={S[5]: 1})
    assert scripts.volunteer(r, "other", "w1") == S[5]
    assert scripts.volunteer(r, MODEL, "w1") == S[0]
    assert coverage(r, keys) == {S[0]: 1}


def test_volunteer_concurrently(
    r: redis.Redis, keys: Keys, scripts: Scripts, settings: Settings
) -> None:
    target = {S[0]: 4, S[1]: 3, S[2]: 2, S[3]: 1}  # 10 replicas wanted
    set_target(r, keys, target)
    n = 20
    clients = [redis.Redis.from_url(settings.redis_url) for _ in range(n)]
    start = threading.Barrier(n + 1)
    got: dict[str, str | None] = {}
    errors: list[BaseException] = []
    over: list[dict[str, int]] = []
    done = threading.Event()

    def volunteer(i: int) -> None:
        try:
            mine = Scripts(clients[i], keys)
            start.wait(timeout=20)
            got[f"w{i}"] = mine.volunteer(clients[i], MODEL, f"w{i}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def watch() -> None:
        watcher = redis.Redis.from_url(settings.redis_url)
        try:
            start.wait(timeout=20)
            while not done.is_set():
                cov = {
                    k.decode(): int(v)
                    for k, v in watcher.hgetall(keys.model_coverage(MODEL)).items()
                }
                if any(cov.get(sid, 0) > want for sid, want in target.items()):
                    over.append(cov)
        finally:
            watcher.close()

    threads = [threading.Thread(target=volunteer, args=(i,)) for i in range(n)]
    watcher = threading.Thread(target=watch)
    for th in [*threads, watcher]:
        th.start()
    for th in threads:
        th.join(30)
    done.set()
    watcher.join(30)
    for c in clients:
        c.close()

    assert not errors, errors
    assert len(got) == n
    assigned = {w: sid for w, sid in got.items() if sid is not None}
    assert len(assigned) == 10
    assert Counter(assigned.values()) == Counter(target)
    assert coverage(r, keys) == target
    assert workers(r, keys) == assigned
    assert not over, over[:3]


# -- release -------------------------------------------------------------------------------
def test_release_decrements_then_deletes(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 2})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]
    assert scripts.volunteer(r, MODEL, "w2") == S[0]
    assert scripts.release(r, MODEL, "w1") == (S[0],)
    assert coverage(r, keys) == {S[0]: 1}
    assert workers(r, keys) == {"w2": S[0]}
    assert scripts.release(r, MODEL, "w2") == (S[0],)
    assert not r.hexists(keys.model_coverage(MODEL), S[0])  # deleted at zero, not left at 0
    assert workers(r, keys) == {}
    assert scripts.release(r, MODEL, "w2") == ()  # nothing held any more


def test_release_unknown_worker_changes_nothing(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[0]: 1})
    scripts.volunteer(r, MODEL, "w1")
    assert scripts.release(r, MODEL, "ghost") == ()
    assert coverage(r, keys) == {S[0]: 1}
    assert workers(r, keys) == {"w1": S[0]}


def test_release_with_lost_coverage_does_not_go_negative(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    r.hset(keys.model_workers(MODEL), "w1", S[0])  # coverage hash lost, workers hash kept
    assert scripts.release(r, MODEL, "w1") == (S[0],)
    assert coverage(r, keys) == {}


def test_released_slice_is_volunteered_again(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]
    assert scripts.volunteer(r, MODEL, "w2") is None
    scripts.release(r, MODEL, "w1")
    assert scripts.volunteer(r, MODEL, "w2") == S[0]


# -- rejoin --------------------------------------------------------------------------------
def test_rejoin_readds_a_reaped_worker(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1})
    sid = scripts.volunteer(r, MODEL, "w1")
    assert sid == S[0]
    scripts.release(r, MODEL, "w1")  # the monitor reaped it, yet it is still serving
    assert workers(r, keys) == {} and coverage(r, keys) == {}
    assert scripts.rejoin(r, MODEL, "w1", sid) == 1
    assert workers(r, keys) == {"w1": sid}
    assert coverage(r, keys) == {sid: 1}


def test_rejoin_is_a_no_op_when_held(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 2})
    sid = scripts.volunteer(r, MODEL, "w1")
    scripts.volunteer(r, MODEL, "w2")
    before = (coverage(r, keys), workers(r, keys))
    for _ in range(3):
        assert scripts.rejoin(r, MODEL, "w1", sid) == 0
    assert (coverage(r, keys), workers(r, keys)) == before


def test_rejoin_after_data_loss(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    r.delete(keys.model_coverage(MODEL), keys.model_workers(MODEL))  # Redis lost everything
    assert scripts.rejoin(r, MODEL, "w1", S[2]) == 1
    assert scripts.rejoin(r, MODEL, "w2", S[2]) == 1
    assert coverage(r, keys) == {S[2]: 2}
    assert workers(r, keys) == {"w1": S[2], "w2": S[2]}


def test_rejoin_adds_a_slice_beside_those_held(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[0]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]
    assert scripts.rejoin(r, MODEL, "w1", S[1]) == 1
    assert coverage(r, keys) == {S[0]: 1, S[1]: 1}
    assert workers(r, keys) == {"w1": join_slices([S[0], S[1]])}


def test_rejoin_several_slices_at_once(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 1, S[2]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]
    scripts.release(r, MODEL, "w1")  # reaped while it kept serving
    assert scripts.rejoin(r, MODEL, "w1", S[2], S[0], S[2]) == 2  # repeats count once
    assert workers(r, keys) == {"w1": f"{S[0]},{S[2]}"}  # sorted, joined by ","
    assert coverage(r, keys) == {S[0]: 1, S[2]: 1}
    assert scripts.rejoin(r, MODEL, "w1", S[0], S[2]) == 0


# -- several slices of one model per worker (issue 10 item 4) -------------------------------
def test_one_worker_takes_distinct_slices_until_no_demand(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 2, S[2]: 1})
    got: list[str] = []
    while (sid := scripts.volunteer(r, MODEL, "w1", held=got)) is not None:
        assert sid not in got, "never a slice it holds"
        got.append(sid)
    assert got == [S[1], S[0], S[2]]  # largest demand first, then the lower id
    assert workers(r, keys) == {"w1": ",".join(sorted(got))}
    assert coverage(r, keys) == {S[0]: 1, S[1]: 1, S[2]: 1}
    # S[1] still wants one more replica, but never from the worker holding it
    assert scripts.volunteer(r, MODEL, "w2", held=()) == S[1]


def test_one_worker_takes_slices_until_no_room(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 1, S[2]: 1})
    r.hset(keys.model_slices(MODEL), mapping={s: json.dumps({"bytes": 100}) for s in S[:3]})
    first = scripts.volunteer(r, MODEL, "w1", room=250)
    assert first == S[0]
    second = scripts.volunteer(r, MODEL, "w1", room=150, held=[first])
    assert second == S[1]
    assert scripts.volunteer(r, MODEL, "w1", room=50, held=[first, second]) is None
    assert coverage(r, keys) == {S[0]: 1, S[1]: 1}, "no reservation beyond its room"


def test_a_retried_ask_gets_the_slice_whose_answer_was_lost(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 1, S[2]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]
    assert scripts.volunteer(r, MODEL, "w1", held=[S[0]]) == S[1]  # this answer is lost
    for _ in range(3):  # the retry names only S[0]: S[1] comes back, nothing new is taken
        assert scripts.volunteer(r, MODEL, "w1", held=[S[0]]) == S[1]
    assert coverage(r, keys) == {S[0]: 1, S[1]: 1}
    assert scripts.volunteer(r, MODEL, "w1", held=[S[0], S[1]]) == S[2]


def test_a_lost_answer_that_does_not_fit_the_room_is_given_back(
    r: redis.Redis, keys: Keys, scripts: Scripts
) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 1, S[2]: 1})
    r.hset(keys.model_slices(MODEL), mapping={s: json.dumps({"bytes": 100}) for s in S[:3]})
    assert scripts.volunteer(r, MODEL, "w1", room=300) == S[0]
    assert scripts.volunteer(r, MODEL, "w1", room=200, held=[S[0]]) == S[1]  # lost
    # the worker filled its budget some other way: with room 0 the lost S[1] is given back
    # and nothing new is taken
    assert scripts.volunteer(r, MODEL, "w1", room=0, held=[S[0]]) is None
    assert workers(r, keys) == {"w1": S[0]} and coverage(r, keys) == {S[0]: 1}
    # one that fits is still returned, not given back
    assert scripts.volunteer(r, MODEL, "w1", room=100, held=[S[0]]) == S[1]
    assert scripts.volunteer(r, MODEL, "w1", room=100, held=[S[0]]) == S[1]
    assert coverage(r, keys) == {S[0]: 1, S[1]: 1}
    assert scripts.volunteer(r, MODEL, "w2", room=0) is None  # nothing listed: no write
    assert workers(r, keys) == {"w1": f"{S[0]},{S[1]}"}


def test_release_one_slice_or_all(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 1, S[2]: 1})
    held: list[str] = []
    for _ in range(3):
        held.append(scripts.volunteer(r, MODEL, "w1", held=held) or "")
    assert scripts.release(r, MODEL, "w1", S[1]) == (S[1],)
    assert workers(r, keys) == {"w1": f"{S[0]},{S[2]}"}
    assert coverage(r, keys) == {S[0]: 1, S[2]: 1}
    assert scripts.release(r, MODEL, "w1", S[1]) == (), "not held any more"
    assert scripts.release(r, MODEL, "w1") == (S[0], S[2])  # None: all (the reaper)
    assert workers(r, keys) == {} and coverage(r, keys) == {}


def test_retire_one_slice_keeps_the_others(r: redis.Redis, keys: Keys, scripts: Scripts) -> None:
    set_target(r, keys, {S[0]: 1, S[1]: 1})
    assert scripts.volunteer(r, MODEL, "w1") == S[0]
    assert scripts.volunteer(r, MODEL, "w1", held=[S[0]]) == S[1]
    assert scripts.retire(r, MODEL, "w1", S[0]) is None, "still needed"
    set_target(r, keys, {S[0]: 0, S[1]: 1})
    assert scripts.retire(r, MODEL, "w1", S[1]) is None, "S[1] is still needed"
    assert scripts.retire(r, MODEL, "w1", S[0]) == S[0]
    assert workers(r, keys) == {"w1": S[1]}
    assert coverage(r, keys) == {S[1]: 1}
    assert scripts.retire(r, MODEL, "w1", S[0]) is None, "not held any more"
