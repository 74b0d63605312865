"""Refused requests are answered, not left hanging (issue 12 item 1), on a real Redis with a
real coordinator: the client refuses what it can check itself; the coordinator answers an
entry it cannot decode with an error event on the sender's reply stream, and dead-letters it."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from e2e_helpers import start_with_worker, wait_for

from kvq import client, wire
from kvq.config import Settings
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.monitor import Monitor


def test_client_refuses_what_it_can_check(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    mon, keys, _ = start_with_worker(settings, "tiny", tiny_model, run_in_thread)
    r = mon.board.r
    with pytest.raises(client.RequestFailed, match="max_tokens"):
        client.send(r, keys, "tiny", prompt="hi", max_tokens=0)
    t0 = time.monotonic()
    with pytest.raises(client.RequestFailed, match="not registered"):
        client.send(r, keys, "nope", prompt="hi")
    assert time.monotonic() - t0 < 1.0
    assert not r.exists(keys.model_requests("nope")), "no stream left behind"


@pytest.mark.parametrize("bad", ["version", "max_tokens", "unknown_field", "negative_id"])
def test_undecodable_request_gets_an_error_event(
    settings: Settings, tiny_model: Path, run_in_thread, bad: str
) -> None:
    mon, keys, _ = start_with_worker(settings, "tiny", tiny_model, run_in_thread)
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    r = mon.board.r
    body: dict[str, object] = {
        "v": 1,
        "request_id": f"bad-{bad}",
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 4,
    }
    if bad == "version":
        body["v"] = 99
    elif bad == "max_tokens":
        body["max_tokens"] = 0
    elif bad == "unknown_field":
        body["surprise"] = True
    else:
        body.pop("prompt")
        body["prompt_ids"] = [-1]
    r.xadd(keys.model_requests("tiny"), {"m": msgspec.msgpack.encode(body)})
    t0 = time.monotonic()
    with pytest.raises(client.RequestFailed, match="refused"):
        list(client.events(r, keys, f"bad-{bad}", timeout_s=20))
    assert time.monotonic() - t0 < 10, "answered, not timed out"
    dead = wait_for(lambda: r.xrange(keys.deadletter()), what="the dead letter")
    (entry,) = [f for _, f in dead if f[b"source"] == keys.model_requests("tiny").encode()]
    assert entry[b"reason"] and f"bad-{bad}".encode() in entry[b"f.m"]
    # a healthy request still goes through after the bad one
    assert client.generate(r, keys, "tiny", prompt="hi", max_tokens=2, timeout_s=60)
    assert wire.request_id_of({b"m": msgspec.msgpack.encode(body)}) == f"bad-{bad}"


def test_answered_entries_leave_the_streams(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    """Issue 12 item 6: a job answered, a result read, a request done are deleted, so the
    inbox, results and request streams hold only work in flight, not the last MAXLEN."""
    s = settings.model_copy(
        update={"coordinator_experts": "none", "slice_experts": 8, "slice_layers": 2}
    )
    mon, keys, w = start_with_worker(s, "tiny", tiny_model, run_in_thread)
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    r = mon.board.r
    for p in ("one", "two", "three"):
        assert client.generate(r, keys, "tiny", prompt=p, max_tokens=4, timeout_s=60)
    assert coord.dispatch.stats.remote_jobs > 0 and w.served > 0
    wait_for(lambda: r.xlen(keys.model_requests("tiny")) == 0, what="requests deleted")
    assert r.xlen(keys.worker_inbox("w0")) == 0
    # the results the coordinator read last go with its next read (no extra round trip):
    # at most one layer call's worth stays, not the 12 layer calls x 3 requests it has read
    assert r.xlen(keys.worker_results("w0", "c1")) <= 1
    assert r.exists(keys.worker_inbox("w0")), "the stream and its group stay"


def test_an_empty_text_prompt_is_served_and_no_tokens_are_refused(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    """Issue 12 item 14 (docs/streams.md): `prompt=""` starts from BOS with a tokenizer that
    adds one (make-tiny's); a prompt of no tokens at all is refused."""
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    r, keys = mon.board.r, Keys(settings.prefix)
    rid = client.send(r, keys, "tiny", prompt="", max_tokens=3)
    events = list(client.events(r, keys, rid, timeout_s=60))
    assert events[-1].kind == "done" and any(e.kind == "token" for e in events)
    rid = client.send(r, keys, "tiny", prompt_ids=[], max_tokens=3)
    with pytest.raises(client.RequestFailed, match="empty prompt"):
        list(client.events(r, keys, rid, timeout_s=60))


def _bad_utf8(body: dict[str, object], field: str) -> bytes:
    """`body` packed with the string value of `field` replaced by the bytes ff fe (invalid
    UTF-8: no msgpack decoder accepts the map)."""
    marker = "\x01" * 7
    packed = msgspec.msgpack.encode({**body, field: marker})
    return packed.replace(b"\xa7" + marker.encode(), b"\xa2\xff\xfe")


@pytest.mark.parametrize("where", ["prompt", "model", "readable_copy_only"])
def test_a_request_of_invalid_utf8_is_answered_on_its_reply_stream(
    settings: Settings, tiny_model: Path, run_in_thread, where: str
) -> None:
    """Issue 29 item 3: an entry whose msgpack holds invalid UTF-8 is dead-lettered and its
    sender, named by a readable `request_id` (in the map, or only in the readable copy),
    gets an `error` event; one with no readable id is dead-lettered only."""
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    r, keys = mon.board.r, Keys(settings.prefix)
    rid = f"utf8-{where}"
    body: dict[str, object] = {"v": 2, "request_id": rid, "model": "tiny", "prompt": "hi"}
    fields: dict[str, bytes | str] = {"t": "request"}
    if where == "readable_copy_only":  # the id's own bytes are bad: only the copy names it
        fields["m"] = _bad_utf8(body, "request_id")
        fields["request_id"] = rid
    else:
        fields["m"] = _bad_utf8(body, where)
    r.xadd(keys.model_requests("tiny"), fields)
    r.xadd(keys.model_requests("tiny"), {"m": _bad_utf8(body, "request_id")})  # no id at all
    t0 = time.monotonic()
    with pytest.raises(client.RequestFailed, match="refused") as caught:
        list(client.events(r, keys, rid, timeout_s=20))
    assert caught.value.failure is not None and caught.value.failure.type == "BadRequest"
    assert time.monotonic() - t0 < 10, "answered, not timed out"
    dead = wait_for(
        lambda: len(r.xrange(keys.deadletter())) == 2 and r.xrange(keys.deadletter()),
        what="both dead letters",
    )
    assert all(b"UTF-8" in f[b"reason"] for _, f in dead), dead
    wait_for(lambda: r.xlen(keys.model_requests("tiny")) == 0, what="both entries acked")
    assert client.generate(r, keys, "tiny", prompt="hi", max_tokens=2, timeout_s=60)


def test_a_duplicate_ids_refusal_is_not_taken_for_the_first_requests_own(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    """Issue 29 item 5: a second request reusing an id is refused on the shared reply stream;
    the first request's reader (given only what `send` returned) still ends with its own
    `done`, and the second's reader gets the refusal."""
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    r, keys = mon.board.r, Keys(settings.prefix)
    first = client.send(r, keys, "tiny", prompt="mine", max_tokens=6, request_id="twice")
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    wait_for(
        lambda: any(e.kind == "token" for e in coord.board.reply_events("twice")),
        what="the first request's first token",
    )
    second = client.send(r, keys, "tiny", prompt="yours", max_tokens=6, request_id="twice")
    assert first == second == "twice" and first.entry != second.entry
    with pytest.raises(client.RequestFailed, match="duplicate request id"):
        list(client.events(r, keys, second, timeout_s=30))
    got = list(client.events(r, keys, first, timeout_s=30))
    assert got[-1].kind == "done" and all(e.entry == first.entry for e in got)
    # a reader that knows only the id follows the entry of the tokens it sees first
    seen = client.ReplyFilter()
    kinds = [ev.kind for ev in coord.board.reply_events("twice") if seen.accept(ev)]
    assert "error" not in kinds and kinds[-1] == "done", kinds


def test_a_request_that_fails_to_start_is_refused_and_serving_goes_on(
    settings: Settings, tiny_model: Path, run_in_thread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 item 3, "whatever else is wrong": an unexpected failure while starting one
    request (here its prompt's preparation) answers it with an error event and a dead letter;
    the coordinator goes on serving."""
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    honest = coord.intake.prompt

    def prompt(req: wire.Request) -> tuple[str | None, list[int]]:
        if req.prompt == "boom":
            raise RuntimeError("the tokenizer broke")
        return honest(req)

    monkeypatch.setattr(coord.intake, "prompt", prompt)
    run_in_thread(coord)
    r, keys = mon.board.r, Keys(settings.prefix)
    rid = client.send(r, keys, "tiny", prompt="boom", max_tokens=3)
    with pytest.raises(client.RequestFailed, match="refused: RuntimeError: the tokenizer broke"):
        list(client.events(r, keys, rid, timeout_s=30))
    dead = wait_for(lambda: r.xrange(keys.deadletter()), what="the dead letter")
    assert b"the tokenizer broke" in dead[0][1][b"reason"]
    assert client.generate(r, keys, "tiny", prompt="hi", max_tokens=2, timeout_s=60)
