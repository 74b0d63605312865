"""Issue 29 items 3 and 5 on a real Redis, without a coordinator: request ids read past invalid
UTF-8, `send`'s `RequestId`, and `kvq.client.events` ending a request Redis lost."""

from __future__ import annotations

import time

import msgspec
import pytest
import redis

from kvq import client, wire
from kvq.keys import Keys


def _with_bad_utf8(body: dict[str, object], field: str) -> bytes:
    marker = "\x01" * 7
    return msgspec.msgpack.encode({**body, field: marker}).replace(
        b"\xa7" + marker.encode(), b"\xa2\xff\xfe"
    )


def test_request_id_is_read_past_invalid_utf8() -> None:
    body: dict[str, object] = {"v": 2, "request_id": "r1", "model": "m", "prompt": "p"}
    assert wire.request_id_of({b"m": _with_bad_utf8(body, "prompt")}) == "r1"
    assert wire.request_id_of({b"m": _with_bad_utf8(body, "model")}) == "r1"
    bad_id = _with_bad_utf8(body, "request_id")
    assert wire.request_id_of({b"m": bad_id}) is None
    assert wire.request_id_of({b"m": bad_id, b"request_id": b"r1"}) == "r1"
    assert wire.request_id_of({b"m": b"\xc1 not msgpack", b"request_id": b"r2"}) == "r2"
    assert wire.request_id_of({b"m": b"\xc1", b"request_id": b"\xff"}) is None
    assert wire.request_id_of({b"m": msgspec.msgpack.encode({"request_id": "x" * 513})}) is None


def _registered(r: redis.Redis, keys: Keys) -> None:
    r.sadd(keys.models(), "m")
    r.hset(keys.model_meta("m"), "request_shards", 1)


def test_send_returns_the_entry_and_stream_it_queued(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    _registered(r, keys)
    rid = client.send(r, keys, "m", prompt="hi", request_id="mine")
    assert rid == "mine" and isinstance(rid, str)
    assert rid.stream == keys.model_requests("m")
    assert r.xrange(rid.stream, rid.entry, rid.entry)
    sub = client.submit(r, keys, "m", prompt="hi")
    assert isinstance(sub.request_id, client.RequestId) and sub.request_id.entry == sub.entry


def test_a_request_redis_lost_ends_in_a_lost_error(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    _registered(r, keys)
    rid = client.send(r, keys, "m", prompt="hi")
    r.delete(rid.stream)  # FLUSHALL, a restart without persistence: nobody will answer it
    t0 = time.monotonic()
    with pytest.raises(client.RequestFailed, match="was lost") as caught:
        list(client.events(r, keys, rid, timeout_s=30, lost_after_s=0.5))
    assert caught.value.failure is not None and caught.value.failure.type == "Lost"
    assert caught.value.failure.retryable
    assert time.monotonic() - t0 < 3


def test_a_queued_request_is_waited_for(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    _registered(r, keys)
    rid = client.send(r, keys, "m", prompt="hi")
    with pytest.raises(TimeoutError):  # still queued: no loss, the caller's timeout
        list(client.events(r, keys, rid, timeout_s=1.5, lost_after_s=0.2))


def test_an_answer_written_before_the_entry_went_is_read(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    _registered(r, keys)
    rid = client.send(r, keys, "m", prompt="hi")
    tok = wire.ReplyEvent(kind="token", index=0, token_id=7, attempt=1, entry=rid.entry)
    done = wire.ReplyEvent(kind="done", index=1, attempt=1, entry=rid.entry)
    for ev in (tok, done):
        r.xadd(keys.request_reply(rid), wire.encode(ev))
    r.delete(rid.stream)  # as a coordinator acks and deletes after its `done`
    got = list(client.events(r, keys, rid, timeout_s=5, lost_after_s=0.1))
    assert [e.kind for e in got] == ["token", "done"]


def test_tokens_lost_from_the_reply_stream_end_in_a_lost_error(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    _registered(r, keys)
    rid = client.send(r, keys, "m", prompt="hi")
    for i in (0, 2):  # index 1 vanished with its reply stream
        ev = wire.ReplyEvent(kind="token", index=i, token_id=i, attempt=1, entry=rid.entry)
        r.xadd(keys.request_reply(rid), wire.encode(ev))
    with pytest.raises(client.RequestFailed, match="tokens 1 to 1 vanished"):
        list(client.events(r, keys, rid, timeout_s=5))


def test_another_entrys_refusal_is_not_ours(r: redis.Redis, prefix: str) -> None:
    """Issue 29 item 5: a duplicate's refusal on the shared reply stream is ignored by the
    first request's reader, given only what `send` returned."""
    keys = Keys(prefix)
    _registered(r, keys)
    first = client.send(r, keys, "m", prompt="hi", request_id="dup")
    second = client.send(r, keys, "m", prompt="hi", request_id="dup")
    refusal = wire.ReplyEvent(
        kind="error",
        error=wire.Failure("BadRequest", "refused: duplicate request id 'dup'"),
        entry=second.entry,
    )
    done = wire.ReplyEvent(kind="done", index=0, attempt=1, entry=first.entry)
    for ev in (refusal, done):
        r.xadd(keys.request_reply("dup"), wire.encode(ev))
    assert [e.kind for e in client.events(r, keys, first, timeout_s=5)] == ["done"]
    with pytest.raises(client.RequestFailed, match="duplicate"):
        list(client.events(r, keys, second, timeout_s=5))


def test_a_request_id_goes_back_on_the_wire_as_a_plain_str(r: redis.Redis, prefix: str) -> None:
    """The codec encodes no `str` subclass: cancelling, or reusing the id, takes a `RequestId`."""
    keys = Keys(prefix)
    _registered(r, keys)
    rid = client.send(r, keys, "m", prompt="hi")
    client.cancel(r, keys, "m", rid)
    again = client.send(r, keys, "m", prompt="hi", request_id=rid)
    assert again == rid and again.entry != rid.entry
    ((_, fields),) = r.xrange(keys.model_cancels("m"))
    assert wire.decode(fields, wire.Cancel).request_id == rid
