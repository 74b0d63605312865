"""kvq.bus.shards against a real server (and, in `make test`'s second run, a real cluster):
a model's request shards read through one consumer per coordinator."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from kvq.bus import xadd
from kvq.bus.shards import ShardedConsumer
from kvq.config import Settings
from kvq.errors import ConfigError
from kvq.keys import COORDINATOR_GROUP, Keys, request_streams


def fill(r: redis.Redis, streams: list[str], per: int) -> dict[tuple[str, bytes], str]:
    """`per` entries on each stream; (stream, id) → the entry's payload."""
    made: dict[tuple[str, bytes], str] = {}
    for s in streams:
        for i in range(per):
            body = f"{s}/{i}"
            made[(s, xadd(r, s, {"n": body}, None))] = body
    return made


def test_every_shard_is_read_count_is_respected_and_acks_go_to_each_shard(
    r: redis.Redis, prefix: str
) -> None:
    streams = request_streams(Keys(prefix), "m", 3)
    c = ShardedConsumer(r, streams, COORDINATOR_GROUP, "c1")
    made = fill(r, streams, 4)
    got: list[tuple[str, bytes, dict[bytes, bytes]]] = []
    while batch := c.read(5, None):
        assert len(batch) <= 5, "never more than asked, though XREADGROUP gives 5 per stream"
        got += batch
    assert {(s, eid) for s, eid, _ in got} == set(made), "each entry once, from its own shard"
    assert all(f[b"n"].decode() == made[(s, eid)] for s, eid, f in got)
    # answer half: answers written, those entries acked and deleted on their own shard
    half = [(s, eid) for s, eid, _ in got[::2]]
    reply = f"{prefix}:{{r:x}}:reply"
    c.answer([(reply, {"k": "v"}, 60)], half, 10_000)
    assert r.xlen(reply) == 1
    for s in streams:
        left = {eid for eid, _ in r.xrange(s)}
        assert left == {eid for (st, eid) in made if st == s} - {eid for st, eid in half if st == s}
    assert sum(int(r.xpending(s, COORDINATOR_GROUP)["pending"]) for s in streams) == 12 - len(half)


def test_a_restarted_consumer_rereads_its_pending_entries_of_every_shard_first(
    r: redis.Redis, prefix: str
) -> None:
    streams = request_streams(Keys(prefix), "m", 3)
    first = ShardedConsumer(r, streams, COORDINATOR_GROUP, "c1")
    made = fill(r, streams, 2)
    taken = first.read(2, None)  # two entries delivered, then held back: all six are pending
    assert len(taken) == 2
    again = ShardedConsumer(r, streams, COORDINATOR_GROUP, "c1")  # same name: a restart
    seen: list[tuple[str, bytes]] = []
    while batch := again.read(10, None):
        seen += [(s, eid) for s, eid, _ in batch]
    assert sorted(seen) == sorted(made), "held entries were pending, not lost"
    assert len(seen) == len(set(seen))


def test_an_idle_read_blocks_and_wakes_on_any_shard(r: redis.Redis, prefix: str) -> None:
    streams = request_streams(Keys(prefix), "m", 3)
    c = ShardedConsumer(r, streams, COORDINATOR_GROUP, "c1")
    t0 = time.monotonic()
    assert c.read(4, 200) == []
    assert time.monotonic() - t0 >= 0.19, "blocked (or polled) for block_ms"
    late = threading.Timer(0.2, lambda: xadd(r, streams[2], {"n": "late"}, None))
    late.start()
    try:
        t0 = time.monotonic()
        got = c.read(4, 5000)
        waited = time.monotonic() - t0
    finally:
        late.join()
    assert [(s, f[b"n"]) for s, _, f in got] == [(streams[2], b"late")]
    assert waited < 2.0, "woke when the entry arrived, not at block_ms"


def test_two_coordinators_share_the_shards(r: redis.Redis, prefix: str) -> None:
    streams = request_streams(Keys(prefix), "m", 4)
    a = ShardedConsumer(r, streams, COORDINATOR_GROUP, "a")
    b = ShardedConsumer(r, streams, COORDINATOR_GROUP, "b")
    made = fill(r, streams, 5)
    got_a, got_b = [], []
    for _ in range(20):
        got_a += [(s, e) for s, e, _ in a.read(3, None)]
        got_b += [(s, e) for s, e, _ in b.read(3, None)]
    assert set(got_a) | set(got_b) == set(made)
    assert not set(got_a) & set(got_b), "the group hands each entry to one coordinator"
    assert got_a and got_b


def test_clients_put_requests_on_their_shard_and_the_count_cannot_change_under_them(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    from kvq import client
    from kvq.keys import request_shard
    from kvq.monitor import Monitor
    from kvq.tools.synth import make_tiny

    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=4, experts_used=2)
    mon = Monitor.from_settings(settings.model_copy(update={"request_shards": 3}))
    info = mon.register("m", model)
    assert info.request_shards == 3 and mon.board.model_info("m").request_shards == 3  # type: ignore[union-attr]
    keys = mon.board.keys
    ids = [f"r{i}" for i in range(12)]
    for rid in ids:
        client.submit(r, keys, "m", prompt="x", request_id=rid)
    streams = request_streams(keys, "m", 3)
    for i, s in enumerate(streams):
        on = [wire_id(f) for _, f in r.xrange(s)]
        assert on == [rid for rid in ids if request_shard(rid, 3) == i]
    assert all(r.xlen(s) for s in streams), "12 ids spread over all three"
    # a monitor with another count refuses while requests are queued, names the setting
    other = Monitor.from_settings(settings.model_copy(update={"request_shards": 2}))
    with pytest.raises(ConfigError, match="KVQ_REQUEST_SHARDS=2.*12 requests are still queued"):
        other.register("m", model)
    for s in streams:
        r.delete(s)
    assert other.register("m", model).request_shards == 2
    # a model id holding '#' would collide with a shard's tag
    with pytest.raises(ConfigError, match="'#'"):
        mon.register("a#1", model)


def wire_id(fields: dict[bytes, bytes]) -> str | None:
    from kvq import wire

    return wire.request_id_of(fields)
