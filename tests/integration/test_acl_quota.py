"""A volunteer exhausting what the swarm shares, under its own `kvq acl` user on a real server,
with the monitor running under its own: each attack is refused by Redis (the worker's
selectors) or stopped by the monitor's quota watch within seconds (`kvq.monitor.quota`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from acl_helpers import RoleSettings
from e2e_helpers import wait_for

from kvq.bus.records import SlotState
from kvq.config import Settings
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.monitor.quota import DEAD_ENTRY_BYTES, INFO_BYTES, SWEEP_S
from kvq.security import acl

QUOTA_MIB = 8  # KVQ_WORKER_QUOTA_MIB here: small, so that a flood crosses it fast
STOPPED_S = 5.0  # "within seconds": from the attack's last write to the user off


@pytest.fixture
def world(
    settings: Settings, r: redis.Redis, as_role: RoleSettings, run_in_thread: Callable[..., object]
) -> Iterator[tuple[Keys, Settings, Monitor]]:
    """A monitor under its ACL user with a small worker quota, a coordinator `c1` listed for a
    model, and the ACL user of worker `evil` (its settings)."""
    keys = Keys(settings.prefix)
    r.sadd(keys.models(), "tiny")
    r.sadd(keys.model_coordinators("tiny"), "c1")
    slots = SlotState(model="tiny", busy=0, total=1, ts_ms=int(time.time() * 1000))
    r.hset(keys.coord_slots("c1"), mapping=slots.to_hash())
    evil = as_role("worker", "evil")
    ms = as_role("monitor").model_copy(
        update={"worker_quota_mib": QUOTA_MIB, "monitor_poll_s": 0.2}
    )
    mon = Monitor.from_settings(ms)
    run_in_thread(mon)
    wait_for(lambda: mon.active, 10, "the monitor active")
    yield keys, evil, mon


def _user(keys: Keys) -> str:
    return acl.user_name(keys.prefix, "worker", "evil")


def _off(r: redis.Redis, keys: Keys) -> bool:
    return "off" in r.acl_getuser(_user(keys))["flags"]


def _stopped(r: redis.Redis, keys: Keys, since: float) -> float:
    """Seconds from `since` until the worker's user is off with no connection left."""
    wait_for(lambda: _off(r, keys), 10 + STOPPED_S, "the worker's user disabled")
    wait_for(lambda: _conns(r, keys) == 0, 10, "its connections closed")
    return time.monotonic() - since


def _wait_listed(mon: Monitor, keys: Keys) -> None:
    """The watch lists a user it turned off after the ACL call returns: wait for the list."""
    assert mon.quota is not None
    wait_for(lambda: mon.quota.disabled, 5, "the user listed")  # type: ignore[union-attr]
    assert mon.quota.disabled == [_user(keys)]


def _conns(r: redis.Redis, keys: Keys) -> int:
    return sum(1 for c in r.client_list() if c.get("user") == _user(keys))


def test_filling_its_own_record_disables_it(
    world: tuple[Keys, Settings, Monitor], r: redis.Redis
) -> None:
    keys, evil, mon = world
    w = redis.Redis.from_url(evil.redis_url)
    fields = {f"f{i}": b"x" * 100 for i in range(INFO_BYTES // 100 + 1000)}
    for start in range(0, len(fields), 2000):
        w.hset(keys.worker_info("evil"), mapping=dict(list(fields.items())[start : start + 2000]))
    took = _stopped(r, keys, time.monotonic())
    assert took < STOPPED_S and not r.exists(keys.worker_info("evil"))
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(evil.redis_url).ping()
    _wait_listed(mon, keys)


def test_flooding_its_results_stream_is_stopped(
    world: tuple[Keys, Settings, Monitor], r: redis.Redis
) -> None:
    keys, evil, _ = world
    results = keys.worker_results("evil", "c1")
    sent: list[float] = []

    def flood() -> None:
        w = redis.Redis.from_url(evil.redis_url)
        try:
            while True:
                w.xadd(results, {"x": b"r" * 65536})  # no MAXLEN: a raw XADD
                sent.append(time.monotonic())
        except redis.RedisError:
            return

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    wait_for(lambda: _off(r, keys), 30, "the flood stopped")
    t.join(10)
    took = _stopped(r, keys, sent[-1])
    assert took < STOPPED_S and not r.exists(results)
    assert sent[-1] - sent[0] < STOPPED_S, "the flood lasted seconds"


def test_a_connection_flood_is_cut(world: tuple[Keys, Settings, Monitor], r: redis.Redis) -> None:
    keys, evil, _ = world
    conns: list[redis.Redis] = []
    t0 = time.monotonic()
    try:
        for _ in range(400):  # until refused: the watch may cut it before the last
            c = redis.Redis.from_url(evil.redis_url)
            conns.append(c)
            c.ping()
    except redis.RedisError:
        pass
    finally:
        took = _stopped(r, keys, t0)
        for c in conns:
            c.close()
    assert took < STOPPED_S + 5, "cut within seconds of the flood's start"
    with pytest.raises(redis.RedisError):
        redis.Redis.from_url(evil.redis_url).ping()
    r.ping()  # the admin, and the roles, connect as before


def test_64_mb_in_its_beat_is_stopped_and_nowhere_else_refused(
    world: tuple[Keys, Settings, Monitor], r: redis.Redis
) -> None:
    keys, evil, _ = world
    w = redis.Redis.from_url(evil.redis_url)
    big = b"x" * (64 << 20)
    for key in (keys.worker_info("evil"), keys.worker_results("evil", "c1"), keys.market()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            w.set(key, big)
    w.set(keys.worker_heartbeat("evil"), big)  # its beat is a string: SET it may
    took = _stopped(r, keys, time.monotonic())
    assert took < STOPPED_S and not r.exists(keys.worker_heartbeat("evil"))


def test_8_mb_in_the_dead_letters_is_deleted(
    world: tuple[Keys, Settings, Monitor], r: redis.Redis
) -> None:
    """Written by a role that may write the shared stream (here the admin, as a coordinator
    could): the watch deletes the entry no `dead_letter` writes."""
    keys, _, mon = world
    small = r.xadd(keys.deadletter(), {"source": "x", "reason": "fine"})
    big = r.xadd(keys.deadletter(), {"source": "x", "f.x": b"d" * (8 << 20)})
    t0 = time.monotonic()
    wait_for(lambda: not r.xrange(keys.deadletter(), big, big), 10, "the 8 MB entry deleted")
    assert time.monotonic() - t0 < STOPPED_S
    assert r.xrange(keys.deadletter(), small, small), "an entry within the bound stays"
    assert mon.quota is not None
    # the watch counts after its XDEL returns: the entry can be gone a moment before the count
    wait_for(lambda: mon.quota.dead.deleted >= 1, 5, "the watch's count")  # type: ignore[union-attr]
    assert mon.quota.dead.deleted == 1
    assert 8 << 20 > DEAD_ENTRY_BYTES


def test_a_workers_dead_letters_reach_the_shared_stream_under_its_own_name(
    world: tuple[Keys, Settings, Monitor], r: redis.Redis
) -> None:
    """It may not write `P:deadletter` (where `MAXLEN 0` would erase every role's): it writes
    its own stream, and the monitor moves each entry, saying which worker wrote it and with
    its inbox as the source whatever the entry claims; an oversized one is dropped."""
    keys, evil, mon = world
    w = redis.Redis.from_url(evil.redis_url)
    before = r.xadd(keys.deadletter(), {"source": "c1", "reason": "a coordinator's"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        w.xadd(keys.deadletter(), {"source": "x"}, maxlen=0, approximate=False)
    fields = {"source": "P:{m:tiny}:requests", "worker": "c1", "reason": "bad job", "f.t": "x"}
    w.xadd(keys.worker_dead("evil"), fields)
    w.xadd(keys.worker_dead("evil"), {"reason": "big", "f.x": b"d" * (2 << 20)})
    wait_for(lambda: r.xlen(keys.worker_dead("evil")) == 0, 10, "its dead letters moved")
    got = {eid: f for eid, f in r.xrange(keys.deadletter()) if eid != before}
    assert r.xrange(keys.deadletter(), before, before), "the others' letters stay"
    assert [f[b"reason"] for f in got.values()] == [b"bad job"]
    (moved,) = got.values()
    assert moved[b"worker"] == b"evil"
    assert moved[b"source"] == keys.worker_inbox("evil").encode()
    assert moved[b"f.t"] == b"x"
    assert mon.quota is not None
    wait_for(lambda: mon.quota.relayed >= 1, 5, "the watch's count")  # type: ignore[union-attr]
    assert mon.quota.relayed == 1 and not _off(r, keys)


def test_asks_whose_doorbell_was_trimmed_away_are_answered(
    world: tuple[Keys, Settings, Monitor], r: redis.Redis
) -> None:
    """Any worker may `XADD P:market MAXLEN 0` (an ACL cannot bound an argument), erasing the
    others' doorbells: the monitor answers every worker user's waiting asks all the same."""
    keys, evil, _ = world
    w = redis.Redis.from_url(evil.redis_url)
    w.xadd(keys.worker_asks("evil"), {"v": "1", "op": "volunteer", "nonce": "n1", "held": ""})
    w.xadd(keys.market(), {"worker": "evil"}, maxlen=0, approximate=False)  # no doorbell left
    assert r.xlen(keys.market()) == 0
    wait_for(lambda: r.xlen(keys.worker_answers("evil")) > 0, 10, "the ask answered")
    ((_, answer),) = r.xrange(keys.worker_answers("evil"))
    assert answer[b"nonce"] == b"n1"
    assert r.xlen(keys.worker_asks("evil")) == 0


def test_another_database_is_refused(world: tuple[Keys, Settings, Monitor]) -> None:
    _, evil, _ = world
    w = redis.Redis.from_url(evil.redis_url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        w.execute_command("SELECT", "1")


def test_results_streams_for_coordinators_that_never_were_count_in_its_quota(
    world: tuple[Keys, Settings, Monitor], r: redis.Redis
) -> None:
    """Its user may `XADD` to `P:{w:W}:results:*` for any coordinator id: thousands of
    streams to made-up coordinators, none of which the per-second pass names, are found by the
    monitor's sweep and counted, and the user is turned off and the streams deleted."""
    keys, evil, mon = world
    w = redis.Redis.from_url(evil.redis_url)
    t0 = time.monotonic()
    try:
        for start in range(0, 20_000, 1000):
            pipe = w.pipeline(transaction=False)
            for i in range(start, start + 1000):
                pipe.xadd(keys.worker_results("evil", f"nobody{i}"), {"y": "x" * 400})
            pipe.execute()
    except (redis.ConnectionError, redis.AuthenticationError):
        pass  # cut off mid-flood
    took = _stopped(r, keys, t0)
    assert took < SWEEP_S + STOPPED_S
    wait_for(
        lambda: not list(r.scan_iter(match=keys.worker_results("evil", "*"), count=1000)),
        SWEEP_S + 5,
        "every stream it made deleted",
    )
    _wait_listed(mon, keys)
