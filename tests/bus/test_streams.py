"""kvq.bus.streams, the same tests on a real server and on fakeredis (the in-memory streams of
fast unit tests): groups, pending-first reads, trimming, dead letters. What fakeredis does
not do as a server does is marked `server_only`, with why."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from waiting import wait_for

from kvq import wire
from kvq.bus import Consumer, dead_letter, ensure_group, xadd
from kvq.bus.streams import DEAD_FIELDS_BYTES
from kvq.config import Settings
from kvq.keys import WORKER_GROUP, Keys
from kvq.monitor.quota import DEAD_ENTRY_BYTES

# what fakeredis does not do as a server does (these tests run on the server only)
BLOCKED = "a read blocked on one connection wakes for another connection's XADD"
LOST = "XREADGROUP on a deleted stream answers NOGROUP (fakeredis answers another error)"


@pytest.fixture(params=["redis", "memory"])
def r(request: pytest.FixtureRequest, r: redis.Redis) -> Iterator[redis.Redis]:
    """Each test on a real server (conftest's `r`) and on fakeredis, kvq's in-memory streams
    for fast unit tests: the same contract holds on both (`MemoryBoard` is the board's)."""
    if request.param == "redis":
        yield r
        return
    only = request.node.get_closest_marker("server_only")
    if only is not None:
        pytest.skip(f"a real server's behaviour, not fakeredis's: {only.args[0]}")
    fakeredis = pytest.importorskip("fakeredis")
    fr = fakeredis.FakeRedis()
    yield fr
    fr.close()


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)


@pytest.fixture
def stream(keys: Keys) -> str:
    return keys.worker_inbox("w1")


def add(r: redis.Redis, stream: str, n: int, start: int = 0) -> list[bytes]:
    return [xadd(r, stream, {"n": str(i)}, maxlen=10_000) for i in range(start, start + n)]


def ids_of(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[bytes]:
    return [eid for eid, _ in entries]


# -- ensure_group --------------------------------------------------------------------------
def test_ensure_group_is_idempotent(r: redis.Redis, stream: str) -> None:
    ensure_group(r, stream, WORKER_GROUP)
    ensure_group(r, stream, WORKER_GROUP)
    assert r.exists(stream) and r.xlen(stream) == 0  # MKSTREAM
    groups = r.xinfo_groups(stream)
    assert [g["name"] for g in groups] == [WORKER_GROUP.encode()]


def test_ensure_group_on_existing_stream_delivers_old_entries(r: redis.Redis, stream: str) -> None:
    old = add(r, stream, 3)
    ensure_group(r, stream, WORKER_GROUP)
    got = Consumer(r, stream, WORKER_GROUP, "c1").read(10, None)
    assert ids_of(got) == old  # the group starts at id 0


def test_ensure_group_raises_other_errors(r: redis.Redis, stream: str) -> None:
    r.set(stream, "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        ensure_group(r, stream, WORKER_GROUP)


# -- Consumer: blocking --------------------------------------------------------------------
def test_empty_read_returns_after_block(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    t0 = time.monotonic()
    assert c.read(10, 150) == []
    waited = time.monotonic() - t0
    assert 0.12 <= waited < 2.0
    t0 = time.monotonic()
    assert c.read(10, None) == []
    assert time.monotonic() - t0 < 0.1


@pytest.mark.server_only(BLOCKED)
def test_blocked_read_wakes_on_xadd(r: redis.Redis, stream: str, settings: Settings) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    assert c.read(10, None) == []  # pending phase done; the next read blocks on '>'
    other = redis.Redis.from_url(settings.redis_url)

    blocked = _blocked_reads(r)

    def later() -> None:
        wait_for(lambda: _blocked_reads(other) > blocked, 10, "the read to block")
        xadd(other, stream, {"n": "late"}, maxlen=1000)

    th = threading.Thread(target=later)
    t0 = time.monotonic()
    th.start()
    try:
        got = c.read(10, 10_000)
        waited = time.monotonic() - t0
    finally:
        th.join()
        other.close()
    assert [f for _, f in got] == [{b"n": b"late"}]
    assert waited < 5.0  # blocked (the server said so), woke on the XADD, not at the 10 s block


def _blocked_reads(r: redis.Redis) -> int:
    """Connections the server holds blocked in XREADGROUP (CLIENT LIST: flag b)."""
    return sum("b" in c["flags"] and c["cmd"] == "xreadgroup" for c in r.client_list())


@pytest.mark.server_only(BLOCKED)
def test_first_read_blocks_too_when_nothing_pending(
    r: redis.Redis, stream: str, settings: Settings
) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    other = redis.Redis.from_url(settings.redis_url)
    blocked = _blocked_reads(r)

    def later() -> None:
        wait_for(lambda: _blocked_reads(other) > blocked, 10, "the first read to block")
        xadd(other, stream, {"n": "x"}, maxlen=1000)

    th = threading.Thread(target=later)
    th.start()
    try:
        got = c.read(10, 10_000)
    finally:
        th.join()
        other.close()
    assert len(got) == 1


# -- Consumer: pending first ---------------------------------------------------------------
def test_new_entries_are_read_once(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    sent = add(r, stream, 5)
    got = c.read(3, None) + c.read(3, None)
    assert ids_of(got) == sent
    assert got[0][1] == {b"n": b"0"}
    assert c.read(3, None) == []


def test_restarted_consumer_rereads_own_pending_first(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    first = add(r, stream, 3)
    assert ids_of(c.read(10, None)) == first  # taken, never acked: c1 "crashes"
    later = add(r, stream, 2, start=3)

    again = Consumer(r, stream, WORKER_GROUP, "c1")
    pending = again.read(10, None)
    assert ids_of(pending) == first
    assert [f[b"n"] for _, f in pending] == [b"0", b"1", b"2"]
    again.ack(*ids_of(pending))
    assert ids_of(again.read(10, None)) == later
    assert again.read(10, None) == []


def test_pending_are_read_in_batches_of_count(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    first = add(r, stream, 5)
    assert ids_of(c.read(10, None)) == first
    new = add(r, stream, 1, start=5)
    again = Consumer(r, stream, WORKER_GROUP, "c1")
    seen: list[bytes] = []
    for _ in range(4):
        batch = again.read(2, None)
        assert len(batch) <= 2
        seen += ids_of(batch)
        again.ack(*ids_of(batch))
    assert seen == first + new


def test_other_consumer_does_not_get_my_pending(r: redis.Redis, stream: str) -> None:
    c1 = Consumer(r, stream, WORKER_GROUP, "c1")
    mine = add(r, stream, 2)
    assert ids_of(c1.read(10, None)) == mine
    new = add(r, stream, 1, start=2)
    c2 = Consumer(r, stream, WORKER_GROUP, "c2")
    assert ids_of(c2.read(10, None)) == new


def test_acked_entries_are_not_reread(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    sent = add(r, stream, 3)
    got = c.read(10, None)
    c.ack(got[0][0], got[2][0])
    c.ack()  # nothing: no call
    assert r.xpending(stream, WORKER_GROUP)["pending"] == 1
    again = Consumer(r, stream, WORKER_GROUP, "c1")
    assert ids_of(again.read(10, None)) == [sent[1]]
    again.ack(sent[1])
    assert Consumer(r, stream, WORKER_GROUP, "c1").read(10, None) == []


def test_reset_pending_rereads(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    sent = add(r, stream, 2)
    assert ids_of(c.read(10, None)) == sent
    assert c.read(10, None) == []
    c.reset_pending()
    assert ids_of(c.read(10, None)) == sent


def test_trimmed_pending_entry_is_dropped_and_acked(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    sent = add(r, stream, 3)
    assert ids_of(c.read(10, None)) == sent
    r.xdel(stream, sent[0])  # as MAXLEN trimming would
    again = Consumer(r, stream, WORKER_GROUP, "c1")
    assert ids_of(again.read(10, None)) == sent[1:]
    assert r.xpending(stream, WORKER_GROUP)["pending"] == 2  # the vanished one was acked


def test_pending_after_a_trimmed_batch_are_still_reread(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    sent = add(r, stream, 3)
    assert ids_of(c.read(10, None)) == sent
    r.xdel(stream, sent[0])
    again = Consumer(r, stream, WORKER_GROUP, "c1")
    seen: list[bytes] = []
    for _ in range(4):
        batch = again.read(1, None)
        seen += ids_of(batch)
        again.ack(*ids_of(batch))
    assert seen == sent[1:]


# -- trimming ------------------------------------------------------------------------------
def test_xadd_keeps_stream_near_maxlen(r: redis.Redis, stream: str) -> None:
    maxlen = 100
    pipe = r.pipeline(transaction=False)
    for i in range(5 * maxlen):
        xadd(pipe, stream, {"n": str(i)}, maxlen=maxlen)
    ids = pipe.execute()
    assert len(set(ids)) == 5 * maxlen
    assert maxlen <= r.xlen(stream) <= maxlen + 200
    last = r.xrevrange(stream, count=1)
    assert last[0][1] == {b"n": str(5 * maxlen - 1).encode()}  # trimming drops the oldest


def test_xadd_with_settings_maxlen(r: redis.Redis, stream: str, settings: Settings) -> None:
    eid = xadd(r, stream, {"a": b"\x00\xff", "b": 3}, maxlen=settings.stream_maxlen)
    assert r.xrange(stream) == [(eid, {b"a": b"\x00\xff", b"b": b"3"})]


# -- NOGROUP recovery ----------------------------------------------------------------------
@pytest.mark.server_only(LOST)
@pytest.mark.parametrize("block_ms", [None, 50])
def test_deleted_stream_is_recreated(r: redis.Redis, stream: str, block_ms: int | None) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    first = add(r, stream, 1)
    assert ids_of(c.read(10, None)) == first
    c.ack(*first)
    r.delete(stream)  # as a Redis restart without persistence would
    assert c.read(10, block_ms) == []
    assert r.exists(stream)
    assert [g["name"] for g in r.xinfo_groups(stream)] == [WORKER_GROUP.encode()]
    new = add(r, stream, 2, start=1)
    got = c.read(10, None)
    assert ids_of(got) == new
    c.ack(*new)
    assert c.read(10, None) == []


def test_destroyed_group_is_recreated(r: redis.Redis, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    sent = add(r, stream, 2)
    assert ids_of(c.read(10, None)) == sent
    r.xgroup_destroy(stream, WORKER_GROUP)
    assert c.read(10, None) == []
    # the new group starts at 0, so what is still in the stream is delivered again
    assert ids_of(c.read(10, None)) == sent


# -- dead letters --------------------------------------------------------------------------
def test_dead_letter_records_the_entry(r: redis.Redis, keys: Keys, stream: str) -> None:
    fields = {b"t": b"job", b"m": b"\xc1\x00\xff"}
    dead_letter(r, keys, stream, b"12-3", fields, "WireError: undecodable job", maxlen=1000)
    entries = r.xrange(keys.deadletter())
    assert len(entries) == 1
    got = entries[0][1]
    assert got[b"reason"] == b"WireError: undecodable job"
    assert got[b"source"] == stream.encode()
    assert got[b"entry_id"] == b"12-3"
    assert got[b"f.t"] == b"job"
    assert got[b"f.m"] == b"\xc1\x00\xff"  # raw bytes kept
    assert abs(int(got[b"ts_ms"]) - time.time() * 1000) < 60_000
    assert set(got) == {b"reason", b"source", b"entry_id", b"f.t", b"f.m", b"ts_ms"}


def test_dead_letter_str_fields_and_long_reason(r: redis.Redis, keys: Keys) -> None:
    dead_letter(r, keys, "src", "1-0", {"k": "v", "n": 5}, "x" * 5000, maxlen=1000)
    ((_, got),) = r.xrange(keys.deadletter())
    assert got[b"entry_id"] == b"1-0"
    assert got[b"f.k"] == b"v" and got[b"f.n"] == b"5"
    assert len(got[b"reason"]) == 2000


def test_a_dead_letter_keeps_at_most_a_mib_of_values(r: redis.Redis, keys: Keys) -> None:
    """What `dead_letter` writes stays under the monitor's bound (`kvq.monitor.quota`): a value
    past `DEAD_FIELDS_BYTES` is replaced by its size; the fields before it are kept whole."""
    fields = {b"a": b"x" * 1000, b"big": b"y" * (DEAD_FIELDS_BYTES + 1), b"z": b"tail"}
    dead_letter(r, keys, "src", "1-0", fields, "too big", maxlen=1000)
    ((_, got),) = r.xrange(keys.deadletter())
    assert got[b"f.a"] == b"x" * 1000 and got[b"f.z"] == b"tail"
    assert got[b"f.big"].startswith(b"(%d bytes, not kept" % (DEAD_FIELDS_BYTES + 1))
    assert sum(len(k) + len(v) for k, v in got.items()) < DEAD_ENTRY_BYTES


def test_undecodable_entry_goes_to_dead_letter(r: redis.Redis, keys: Keys, stream: str) -> None:
    """The intended use: a consumer reads, fails to decode, parks the entry and acks it."""
    c = Consumer(r, stream, WORKER_GROUP, "c1")
    job = wire.Job(
        job_id="j1",
        model="m",
        layer=0,
        slice="L000-001:E0000-0004",
        expert_start=0,
        expert_end=4,
        coord="c",
        reply_to="r",
        deadline_ms=10,
        x=wire.Tensor.of(np.arange(6, dtype=np.float32).reshape(2, 3)),
        ids=wire.Tensor.of(np.zeros((2, 2), np.int32)),
        weights=wire.Tensor.of(np.ones((2, 2), np.float16)),
    )
    good = xadd(r, stream, wire.encode(job), maxlen=1000)
    bad = xadd(r, stream, {"t": "job", "m": b"\x93garbage"}, maxlen=1000)
    decoded = []
    for eid, fields in c.read(10, None):
        try:
            decoded.append(wire.decode(fields, wire.Job))
        except wire.WireError as exc:
            dead_letter(r, keys, stream, eid, fields, str(exc), maxlen=1000)
        c.ack(eid)
    assert decoded == [job]
    ((_, dl),) = r.xrange(keys.deadletter())
    assert dl[b"entry_id"] == bad and dl[b"f.m"] == b"\x93garbage"
    assert good != bad and r.xpending(stream, WORKER_GROUP)["pending"] == 0


# -- answers in one round trip -------------------------------------------------------------
def test_answer_each_writes_every_answer_and_reports_each_refusal(
    r: redis.Redis, keys: Keys, stream: str
) -> None:
    """A batch of answers in one pipeline: the writable ones are written, a refused one (a
    key of another type) comes back in its place, and every entry is acked and deleted."""
    c = Consumer(r, stream, WORKER_GROUP, "w1")
    eids = add(r, stream, 3)
    assert ids_of(c.read(count=10, block_ms=None)) == eids
    good, bad = keys.worker_results("w1", "c1"), keys.worker_results("w1", "c2")
    r.set(bad, "not a stream")
    errors = c.answer_each(
        [(good, {"n": "0"}, 60), (bad, {"n": "1"}, 60), (good, {"n": "2"}, None)], eids, 100
    )
    assert [e is None for e in errors] == [True, False, True]
    assert "WRONGTYPE" in str(errors[1])
    assert [f[b"n"] for _, f in r.xrange(good)] == [b"0", b"2"]
    assert 0 < r.ttl(good) <= 60
    assert r.xlen(stream) == 0 and r.xpending(stream, WORKER_GROUP)["pending"] == 0
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # the one-answer form raises
        c.answer([(bad, {"n": "3"}, None)], [], 100)


def test_answer_and_read_takes_the_next_entries_in_the_same_round_trip(
    r: redis.Redis, keys: Keys, stream: str
) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "w1")
    first = add(r, stream, 2)
    assert ids_of(c.read(count=10, block_ms=None)) == first  # after an empty pending pass
    later = add(r, stream, 3, start=2)
    out = keys.worker_results("w1", "c1")
    calls: list[int] = []
    execute = redis.client.Pipeline.execute

    def counted(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        calls.append(len(self.command_stack))
        return execute(self, raise_on_error=raise_on_error)

    redis.client.Pipeline.execute = counted  # type: ignore[method-assign]
    try:
        errors = c.answer_and_read([(out, {"n": "0"}, None)], first, 100, 10, 100)
        assert errors == [None]
        assert ids_of(c.read(count=10, block_ms=None)) == later  # read with the answers
    finally:
        redis.client.Pipeline.execute = execute  # type: ignore[method-assign]
    assert calls == [4]  # XADD, XACK, XDEL, XREADGROUP: one round trip, nothing after it
    assert r.xpending(stream, WORKER_GROUP)["pending"] == 3  # the next batch, not yet answered


def test_answer_and_read_leaves_the_pending_pass_to_read(
    r: redis.Redis, keys: Keys, stream: str
) -> None:
    """Before its pending pass is over a consumer answers alone: its next `read` walks what it
    had taken before a restart, as ever."""
    Consumer(r, stream, WORKER_GROUP, "w1").read(count=10, block_ms=None)
    taken = add(r, stream, 2)
    assert ids_of(Consumer(r, stream, WORKER_GROUP, "w1").read(count=10, block_ms=None)) == taken
    again = Consumer(r, stream, WORKER_GROUP, "w1")  # restarted: both still pending
    (first, _), *_ = again.read(count=1, block_ms=None)
    errors = again.answer_and_read(
        [(keys.worker_results("w1", "c"), {"n": "0"}, None)], [first], 100, 10, 100
    )
    assert errors == [None]
    assert ids_of(again.read(count=10, block_ms=None)) == taken[1:]


@pytest.mark.server_only(LOST)
def test_answer_and_read_recreates_a_deleted_inbox(r: redis.Redis, keys: Keys, stream: str) -> None:
    c = Consumer(r, stream, WORKER_GROUP, "w1")
    eids = add(r, stream, 1)
    assert ids_of(c.read(count=10, block_ms=None)) == eids
    r.delete(stream)  # a FLUSHALL or an operator: the group goes with the stream
    assert c.answer_and_read(
        [(keys.worker_results("w1", "c"), {"n": "0"}, None)], [], 100, 10, None
    ) == [None]
    add(r, stream, 1, start=5)
    assert [f[b"n"] for _, f in c.read(count=10, block_ms=None)] == [b"5"]


@pytest.mark.server_only(BLOCKED)
def test_a_blocked_worker_wakes_to_every_job_of_one_send(
    r: redis.Redis, keys: Keys, stream: str, settings: Settings
) -> None:
    """The jobs of one `send_jobs` land together (MULTI/EXEC on one server): a worker blocked
    on its inbox reads them in one batch, not the first alone and the rest a round trip
    later."""
    from kvq.bus.redis_board import RedisBoard

    board = RedisBoard(r, keys, settings.lifetimes)
    c = Consumer(r, stream, WORKER_GROUP, "w1")
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(len(c.read(count=32, block_ms=5000))))
    blocked = _blocked_reads(r)
    reader.start()
    wait_for(lambda: _blocked_reads(r) > blocked, 10, "the reader blocked in XREADGROUP")
    board.send_jobs([("w1", {"n": str(i)}) for i in range(4)])
    reader.join(10)
    assert len(got) == 1
    assert got[0] == 4 or (board.cluster and got[0] >= 1)  # a cluster's appends: independent
