"""Claiming a dead consumer's pending entries, and the retire script (real Redis)."""

from __future__ import annotations

import redis
from waiting import wait_for

from kvq.bus import Consumer, Scripts, claim_from_dead
from kvq.keys import Keys


def test_claim_takes_only_from_dead_consumers(r: redis.Redis, prefix: str) -> None:
    stream = f"{prefix}:s"
    dead, live = Consumer(r, stream, "g", "dead"), Consumer(r, stream, "g", "live")
    for i in range(3):
        r.xadd(stream, {"n": i})
    assert len(dead.read(2, None)) == 2
    assert len(live.read(1, None)) == 1
    wait_for(lambda: _idle_ms(r, stream) > 20, 10, "the entries idle over 20 ms")
    assert claim_from_dead(r, stream, "g", "me", lambda name: name == "live", 10_000) == 0, (
        "not idle long enough"
    )
    assert claim_from_dead(r, stream, "g", "me", lambda name: name == "live", 20) == 2
    me = Consumer(r, stream, "g", "me")
    assert sorted(f[b"n"] for _, f in me.read(10, None)) == [b"0", b"1"]
    consumers = {c["name"] for c in r.xinfo_consumers(stream, "g")}
    assert b"dead" not in consumers and b"live" in consumers


def test_pending_pass_returns_each_entry_once(r: redis.Redis, prefix: str) -> None:
    """A caller that keeps entries un-acked still moves on to new entries."""
    stream = f"{prefix}:s"
    c = Consumer(r, stream, "g", "c")
    ids = [r.xadd(stream, {"n": i}) for i in range(3)]
    assert [e for e, _ in c.read(3, None)] == ids
    c2 = Consumer(r, stream, "g", "c")  # restart: pending first, once
    assert [e for e, _ in c2.read(2, None)] == ids[:2]
    assert [e for e, _ in c2.read(2, None)] == ids[2:]
    new = r.xadd(stream, {"n": 3})
    assert [e for e, _ in c2.read(2, None)] == [new]


def test_retire_only_when_over_covered(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    s = Scripts(r, keys)
    r.hset(keys.model_target("m"), "S", 2)
    assert s.volunteer(r, "m", "a") == "S" and s.volunteer(r, "m", "b") == "S"
    assert s.retire(r, "m", "a", "S") is None, "coverage 2 == target 2: still needed"
    r.hset(keys.model_target("m"), "S", 1)
    assert s.retire(r, "m", "a", "S") == "S"
    assert s.retire(r, "m", "b", "S") is None, "the last replica stays"
    assert r.hget(keys.model_coverage("m"), "S") == b"1"
    assert r.hgetall(keys.model_workers("m")) == {b"b": b"S"}


def test_claim_on_a_lost_stream_or_group_makes_them_again(r: redis.Redis, prefix: str) -> None:
    """Issue 29: the takeover's `XINFO CONSUMERS` on a stream Redis lost (`no such key`), or on
    a stream whose group it lost (`NOGROUP`), claims nothing and leaves both made again."""
    stream = f"{prefix}:s"
    Consumer(r, stream, "g", "dead")
    r.delete(stream)
    assert claim_from_dead(r, stream, "g", "me", lambda name: False, 0) == 0
    assert [g["name"] for g in r.xinfo_groups(stream)] == [b"g"]
    r.xgroup_destroy(stream, "g")
    assert claim_from_dead(r, stream, "g", "me", lambda name: False, 0) == 0
    assert [g["name"] for g in r.xinfo_groups(stream)] == [b"g"]


def test_unanswered_of_a_lost_inbox_is_empty(r: redis.Redis, prefix: str) -> None:
    from kvq.bus.streams import unanswered

    assert unanswered(r, f"{prefix}:gone") == []


def test_market_scripts_heal_lost_coverage(r: redis.Redis, prefix: str) -> None:
    """Issue 29: coverage counts the workers the workers hash lists. Lost alone, it is counted
    again from the workers hash by the next script; with the workers hash lost, the workers'
    rejoins count each of them once, not on top of what coverage still held."""
    keys = Keys(prefix)
    s = Scripts(r, keys)
    r.hset(keys.model_target("m"), mapping={"S": 2, "T": 1})
    assert {s.volunteer(r, "m", w) for w in ("a", "b", "c")} == {"S", "T"}
    before = r.hgetall(keys.model_coverage("m"))
    assert before == {b"S": b"2", b"T": b"1"}
    r.delete(keys.model_coverage("m"))
    assert s.rejoin(r, "m", "a", *s.release(r, "m", "a")) == 1  # any script call heals first
    assert r.hgetall(keys.model_coverage("m")) == before
    r.delete(keys.model_workers("m"))
    for w in ("a", "b", "c"):
        held = s.rejoin(r, "m", w, "S" if w != "c" else "T")
        assert held == 1
    assert r.hgetall(keys.model_coverage("m")) == before, "each worker counted once"


def _idle_ms(r: redis.Redis, stream: str) -> int:
    """The shortest time any pending entry of group g has waited since its delivery."""
    return min(e["time_since_delivered"] for e in r.xpending_range(stream, "g", "-", "+", 100))
