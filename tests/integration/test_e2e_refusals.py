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
    body: dict[str, object] = {"v": 1, "request_id": f"bad-{bad}", "model": "tiny",
                               "prompt": "hi", "max_tokens": 4}  # fmt: skip
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
