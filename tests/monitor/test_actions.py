"""The dashboard's actions over HTTP on a real Redis: read-only without `KVQ_MONITOR_TOKENS`
(403), a wrong or missing token 401, and with an operator's token each action does what its
CLI command does, logged with the operator's name; the requests-in-flight snapshot."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvq.bus import cancel_keys
from kvq.bus.deadletters import list_dead
from kvq.bus.records import CoordStats, InFlight, SlotState
from kvq.bus.streams import dead_letter
from kvq.config import Settings
from kvq.errors import ConfigError
from kvq.monitor import Monitor
from kvq.monitor.actions import parse_tokens
from kvq.monitor.http import serve_api
from kvq.tools.synth import make_tiny

TOKEN = "alice-token-0123456789"
TOKENS = f"alice={TOKEN},bob=bob-token-0123456789"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("actions") / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    return path


@pytest.fixture
def mon(settings: Settings, model: Path) -> Monitor:
    m = Monitor.from_settings(settings.model_copy(update={"slice_experts": 4}))
    m.register("m", model)
    return m


def serve(mon: Monitor, tokens: str) -> Iterator[str]:
    server, thread = serve_api(mon.board, "127.0.0.1", 0, tokens=tokens)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def url(mon: Monitor) -> Iterator[str]:
    yield from serve(mon, TOKENS)


@pytest.fixture
def readonly(mon: Monitor) -> Iterator[str]:
    yield from serve(mon, "")


def post(url: str, action: str, body: Any, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{url}/api/actions/{action}", json=body, headers=headers, timeout=10)


def test_without_tokens_the_dashboard_is_read_only(readonly: str) -> None:
    assert httpx.get(readonly + "/api/operator").json() == {"actions": False, "who": None}
    got = post(readonly, "cancel", {"model": "m", "request": "r1"})
    assert got.status_code == 403 and "KVQ_MONITOR_TOKENS" in got.json()["message"]


def test_a_wrong_or_missing_token_is_401(url: str, r: redis.Redis, mon: Monitor) -> None:
    assert httpx.get(url + "/api/operator").json() == {"actions": True, "who": None}
    for token in (None, "nope", TOKEN + "x", TOKEN[:-1]):
        got = post(url, "cancel", {"model": "m", "request": "r1"}, token)
        assert got.status_code == 401, (token, got.text)
    assert not cancel_keys.marked(r, mon.board.keys, ["r1"]), "nothing done"
    who = httpx.get(url + "/api/operator", headers={"Authorization": "Bearer nope"})
    assert who.status_code == 401
    who = httpx.get(url + "/api/operator", headers={"Authorization": f"Bearer {TOKEN}"})
    assert who.json() == {"actions": True, "who": "alice"}


def test_cancel_marks_the_request_and_is_logged_with_who(
    url: str, r: redis.Redis, mon: Monitor, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvq.monitor.actions"):
        got = post(url, "cancel", {"model": "m", "request": "r-7"}, "bob-token-0123456789")
    assert got.status_code == 200 and got.json()["by"] == "bob", got.text
    keys = mon.board.keys
    assert cancel_keys.marked(r, keys, ["r-7"]) == {"r-7"}
    assert r.xlen(keys.model_cancels("m")) == 1, "the coordinators are told at once too"
    assert any("operator bob" in m and "cancel request r-7 of m" in m for m in caplog.messages)


def test_dead_letters_requeued_and_dropped(url: str, r: redis.Redis, mon: Monitor) -> None:
    keys = mon.board.keys
    source = keys.model_requests("m")
    for i in range(2):
        dead_letter(r, keys, source, f"1-{i}".encode(), {b"x": str(i).encode()}, "test", 100)
    first, second = (d.id for d in list_dead(r, keys, 10)[::-1])
    got = post(url, "deadletter-requeue", {"ids": [first]})
    assert got.status_code == 200 and got.json()["result"][0]["id"] == first
    assert r.xlen(source) == 1 and [d.id for d in list_dead(r, keys, 10)] == [second]
    got = post(url, "deadletter-drop", {"ids": [second]})
    assert got.json()["result"] == {"purged": 1} and r.xlen(keys.deadletter()) == 0


def test_worker_verdicts_by_hand(url: str, mon: Monitor) -> None:
    board = mon.board
    assert board.volunteer("m", "w1") is not None
    got = post(url, "quarantine", {"worker": "w1", "for_s": 60})
    assert got.json()["result"] == {"models": ["m"]}
    q = board.quarantined("m")["w1"]
    assert q.operator == "alice" and q.active(board.now_ms())
    post(url, "drain", {"worker": "w1"})
    assert board.quarantined("m")["w1"].drain
    post(url, "release", {"worker": "w1", "model": "m"})
    assert not board.quarantined("m")["w1"].idle(board.now_ms() + 1)


@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("cancel", {"model": "m"}),
        ("cancel", {"model": "m", "request": ""}),
        ("cancel", []),
        ("deadletter-drop", {"ids": ["not-an-id"]}),
        ("deadletter-drop", {"ids": []}),
        ("quarantine", {"worker": "a b"}),
        ("quarantine", {"worker": "w", "for_s": -1}),
        ("drain", {}),
    ],
)
def test_bad_bodies_are_400(url: str, action: str, body: Any) -> None:
    got = post(url, action, body)
    assert got.status_code == 400, got.text


def test_unknown_action_is_404(url: str) -> None:
    assert post(url, "reboot", {}).status_code == 404


def test_tokens_setting_is_checked() -> None:
    assert parse_tokens(TOKENS) == {TOKEN: "alice", "bob-token-0123456789": "bob"}
    assert parse_tokens("") == {}
    for bad in ("just-a-token-0123456789", "alice=short", "a b=0123456789abcdef0"):
        with pytest.raises(ConfigError, match="KVQ_MONITOR_TOKENS"):
            parse_tokens(bad)
    with pytest.raises(ValueError):
        Settings(monitor_tokens="alice=short")
    from kvq.config import redact

    assert redact("monitor_tokens", TOKENS) == "***"


def test_requests_in_flight_in_the_snapshot(readonly: str, mon: Monitor) -> None:
    now = int(mon.board.now_ms())
    state = SlotState(model="m", busy=1, total=4, ts_ms=now)
    row = InFlight(
        request="r-1",
        model="m",
        coordinator="c1",
        grain="expert",
        state="prefill",
        prompt_tokens=9,
        generated=0,
        max_tokens=32,
        queued_ms=now - 2500,
    )
    mon.board.publish_slots("c1", state, CoordStats(), [row])
    (got,) = httpx.get(readonly + "/api/dashboard").json()["requests"]
    assert got["request"] == "r-1" and got["coordinator"] == "c1" and got["state"] == "prefill"
    assert 2.4 <= got["age_s"] < 30
    stale = SlotState(model="m", busy=1, total=4, ts_ms=now - 10**7)
    mon.board.publish_slots("c1", stale, CoordStats(), [row])
    assert httpx.get(readonly + "/api/dashboard").json()["requests"] == [], "a dead one's: not"


def test_queued_requests_in_the_snapshot(readonly: str, mon: Monitor, r: redis.Redis) -> None:
    """A request no coordinator has read yet shows as `queued` (its prompt tokens when sent
    as ids); once a coordinator's group read delivers it, no longer."""
    from kvq import client
    from kvq.keys import COORDINATOR_GROUP

    keys = mon.board.keys
    rid = client.send(r, keys, "m", prompt_ids=[1, 2, 3], max_tokens=8)
    (got,) = httpx.get(readonly + "/api/dashboard").json()["requests"]
    assert got["request"] == str(rid) and got["state"] == "queued" and got["coordinator"] == ""
    assert got["prompt_tokens"] == 3 and got["max_tokens"] == 8 and got["grain"] == "expert"
    stream = keys.model_requests("m")
    r.xgroup_create(stream, COORDINATOR_GROUP, id="0", mkstream=True)
    (got,) = httpx.get(readonly + "/api/dashboard").json()["requests"]
    assert got["state"] == "queued", "a group that has read nothing: still queued"
    r.xreadgroup(COORDINATOR_GROUP, "c1", {stream: ">"}, count=1)
    assert httpx.get(readonly + "/api/dashboard").json()["requests"] == []
