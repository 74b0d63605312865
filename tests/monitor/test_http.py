"""The monitor's HTTP API and /metrics on a real Redis (K13, D7)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvq.bus.records import CoordStats, Quarantine, SlotState
from kvq.config import Settings
from kvq.keys import COORDINATOR_GROUP
from kvq.monitor import Monitor
from kvq.monitor.http import serve_api
from kvq.tools.synth import make_tiny

SLICES = 2 * (8 // 4)  # layers × expert groups of the tiny model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("http") / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    return path


@pytest.fixture
def mon(settings: Settings, model: Path) -> Monitor:
    s = settings.model_copy(update={"slice_experts": 4, "base_replicas": 1, "boost_replicas": 1})
    m = Monitor.from_settings(s)
    m.register("m", model)
    return m


@pytest.fixture
def url(mon: Monitor) -> Iterator[str]:
    server, thread = serve_api(mon.board, "127.0.0.1", 0, volunteer="open")
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def call(url: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url + path, data=body, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
        exc.close()
    if path == "/metrics" and status == 200:
        return status, raw.decode()
    return status, json.loads(raw) if raw else None


def volunteer(url: str, worker: str) -> tuple[int, Any]:
    return call(url, "/api/expert-volunteer", json.dumps({"worker": worker}).encode())


def saturate(mon: Monitor, busy: int) -> None:
    ts = int(time.time() * 1000)
    mon.board.publish_slots("c1", SlotState(model="m", busy=busy, total=4, ts_ms=ts), CoordStats())


def test_recruitment_reports_saturation(mon: Monitor, url: str, r: redis.Redis) -> None:
    saturate(mon, busy=mon.s.saturation_threshold)
    mon.poll("m")
    status, got = call(url, "/api/moe/recruitment")
    assert status == 200
    assert got["models"] == [
        {
            "model": "m",
            "busy": mon.s.saturation_threshold,
            "total": 4,
            "saturated": True,
            "coordinators": 1,
            "base_target": 1,
            "effective_target": 2,
        },
    ]


def test_demand_then_volunteer_until_exhausted(mon: Monitor, url: str, model: Path) -> None:
    status, got = call(url, "/api/expert-demand")
    assert status == 200
    (m,) = got["models"]
    assert m["model"] == "m" and m["recruiting"] is True and len(m["slices"]) == SLICES
    assert all(
        s["target"] == 1 and s["coverage"] == 0 and s["demand"] == 1 and s["recruiting"]
        for s in m["slices"]
    )
    taken = set()
    for i in range(SLICES):
        status, got = volunteer(url, f"w{i}")
        assert status == 200, got
        assert got["model"] == "m" and got["source"] == str(model)
        assert got["bytes"] == sum(rg["nbytes"] for rg in got["ranges"]) > 0
        taken.add(got["slice"])
    assert len(taken) == SLICES
    assert volunteer(url, "late") == (204, None)
    _, got = call(url, "/api/expert-demand")
    (m,) = got["models"]
    assert m["recruiting"] is False
    assert {(s["coverage"], s["demand"]) for s in m["slices"]} == {(1, 0)}


def test_a_worker_names_what_it_holds_and_takes_more(mon: Monitor, url: str) -> None:
    """Through the door a worker takes several slices of one model by naming the ones it
    holds (`held`), as `kvq worker` does; `room` leaves out slices that do not fit."""
    taken: list[str] = []
    for _ in range(2):
        body = {"worker": "edge", "model": "m", "held": {"m": taken}}
        status, got = call(url, "/api/expert-volunteer", json.dumps(body).encode())
        assert status == 200, got
        assert got["slice"] not in taken
        taken.append(got["slice"])
    assert mon.board.held_by("m", "edge") == tuple(sorted(taken))
    again = {"worker": "edge", "held": {"m": taken[:1]}}  # the second answer was lost
    assert call(url, "/api/expert-volunteer", json.dumps(again).encode())[1]["slice"] == taken[1]
    small = {"worker": "edge", "held": {"m": taken}, "room": 1}  # no slice is 1 byte
    assert call(url, "/api/expert-volunteer", json.dumps(small).encode()) == (204, None)
    assert mon.board.held_by("m", "edge") == tuple(sorted(taken))


def test_bad_volunteer_bodies_are_400(url: str) -> None:
    for body in (
        b"{not json",
        b"[1]",
        b'{"worker": ""}',
        b'{"worker": 3}',
        b'{"model": "m"}',
        b'{"worker": "w", "held": ["s"]}',
        b'{"worker": "w", "held": {"m": "s"}}',
        b'{"worker": "w", "room": -1}',
        b'{"worker": "w", "room": "9"}',
    ):
        status, got = call(url, "/api/expert-volunteer", body)
        assert status == 400, body
        assert got["type"] == "BadRequest" and got["retryable"] is False and got["message"]
    status, got = call(url, "/api/expert-volunteer", b'{"worker": "w", "model": "nope"}')
    assert status == 404 and got["type"] == "UnknownModel"


MALFORMED = [
    b'{"worker": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",  # nested past the parser's limit
    b'{"worker": "w", "held": ' + b'{"m": ' * 500 + b"[]" + b"}" * 500 + b"}",
    b'{"worker": "a:b"}',
    b'{"worker": "w{x}"}',
    b'{"worker": "w*"}',
    b'{"worker": "\\ud800"}',
    b'{"worker": "' + b"x" * 65 + b'"}',
    b'{"worker": " w"}',
    b'{"worker": "w", "model": "\\udc00"}',
    b'{"worker": "w", "held": {"\\ud800": ["s"]}}',
    b'{"worker": "w", "room": 1e400}',
    b'{"worker": "w", "room": 18446744073709551616}',
    b"\xff\xfe",
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_volunteer_bodies_are_400_never_500(url: str, body: bytes) -> None:
    status, got = call(url, "/api/expert-volunteer", body)
    assert status == 400, (body[:80], got)
    assert got["type"] == "BadRequest" and got["message"]


def test_a_chunked_body_over_the_cap_is_413(url: str) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(160):  # 10 MiB, no Content-Length
            yield b" " * 65536

    t0 = time.monotonic()
    resp = httpx.post(url + "/api/expert-volunteer", content=chunks(), timeout=30)
    assert resp.request.headers.get("transfer-encoding") == "chunked"
    assert resp.status_code == 413 and resp.json()["type"] == "BadRequest"
    assert time.monotonic() - t0 < 5


def test_metrics_read_redis_on_scrape(mon: Monitor, url: str, r: redis.Redis) -> None:
    req = mon.board.keys.model_requests("m")
    for i in range(3):
        r.xadd(req, {"i": i})
    r.xgroup_create(req, COORDINATOR_GROUP, id="0")
    r.xreadgroup(COORDINATOR_GROUP, "c1", {req: ">"}, count=1)
    volunteer(url, "w0")
    status, text = call(url, "/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if v))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    req_labels = (("model", "m"), ("stream", "requests"))
    assert samples["kvq_stream_length", req_labels] == 3
    assert samples["kvq_group_pending", req_labels] == 1
    demand = {k[1]: v for k, v in samples.items() if k[0] == "kvq_span_demand"}
    assert sum(demand.values()) == SLICES - 1, "one slice is covered"
    assert samples["kvq_model_saturated", (("model", "m"),)] == 0
    assert samples["kvq_workers_alive", (("model", "m"),)] == 0  # w0 never heartbeat
    assert samples["kvq_deadletter_length", ()] == 0


def test_healthz_and_unknown_path(url: str) -> None:
    assert call(url, "/healthz") == (200, {"ok": True})
    status, got = call(url, "/api/nothing")
    assert status == 404 and got["type"] == "NotFound"
    assert call(url, "/healthz")[0] == 200  # still serving after the error


def test_trust_lists_quarantined_and_banned_workers(mon: Monitor, url: str) -> None:
    """Issue 11: a coordinator's verdicts (P:{m:M}:quarantine) in the API and the metrics."""
    now = int(time.time() * 1000)
    assert call(url, "/api/trust") == (200, {"models": [{"model": "m", "workers": []}]})
    mon.board.quarantine(
        "m",
        "liar",
        Quarantine(
            until_ms=now + 60_000, mismatches=1, coord="c1", reason="row error 2.3", ts_ms=now
        ),
    )
    mon.board.quarantine("m", "served-time", Quarantine(until_ms=now - 1, mismatches=1))
    mon.board.quarantine("m", "banned", Quarantine(until_ms=0, mismatches=3, banned=True))
    status, got = call(url, "/api/trust")
    assert status == 200
    (entry,) = got["models"]
    by_worker = {w["worker"]: w for w in entry["workers"]}
    assert by_worker["liar"] == {
        "worker": "liar",
        "quarantined": True,
        "until_ms": now + 60_000,
        "mismatches": 1,
        "banned": False,
        "coord": "c1",
        "reason": "row error 2.3",
        "ts_ms": now,
        "operator": "",  # a coordinator's catch; an operator's verdict names them
        "drain": False,
    }
    assert not by_worker["served-time"]["quarantined"]
    assert by_worker["banned"]["quarantined"] and by_worker["banned"]["banned"]
    status, text = call(url, "/metrics")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples["kvq_worker_quarantined", (("model", "m"), ("worker", "liar"))] == 1
    assert samples["kvq_worker_quarantined", (("model", "m"), ("worker", "served-time"))] == 0
    assert samples["kvq_worker_banned", (("model", "m"), ("worker", "banned"))] == 1
    assert samples["kvq_worker_mismatches", (("model", "m"), ("worker", "banned"))] == 3
    assert samples["kvq_workers_quarantined", (("model", "m"),)] == 2


@pytest.mark.parametrize("mode", ["acl", "off"])
def test_http_volunteering_is_bound_to_the_worker_s_acl_user(mon: Monitor, mode: str) -> None:
    """Issue 11: with KVQ_HTTP_VOLUNTEER=acl only a caller holding worker W's `kvq acl`
    password may take a slice as W (checked by an AUTH as that user); off refuses everyone."""
    from kvq.security import acl

    made = acl.apply(mon.board.r, [acl.role_user(mon.board.keys, "worker", "wa")])
    (password,) = made.values()
    server, thread = serve_api(mon.board, "127.0.0.1", 0, volunteer=mode)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    body = json.dumps({"worker": "wa"}).encode()

    def post(token: str | None) -> int:
        req = urllib.request.Request(base + "/api/expert-volunteer", data=body, method="POST")
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            exc.close()
            return int(exc.code)

    try:
        if mode == "off":
            assert post(password) == 403
        else:
            assert post(None) == 401 and post("wrong-password") == 401
            assert mon.board.assignments("m") == {}, "nothing taken without the password"
            assert post(password) == 200
            assert "wa" in mon.board.assignments("m")
    finally:
        acl.remove(mon.board.r, made)
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize("path", ["/api/dashboard", "/api/worker/w1"])
def test_the_charts_range_parameter(mon: Monitor, url: str, path: str) -> None:
    """`?range=`: seconds or `all` (what KVQ_MONITOR_HISTORY_S keeps); absent: 10 minutes;
    anything else a 400 naming it."""
    assert mon.board.volunteer("m", "w1") is not None
    for query, seconds in (("", 600.0), ("?range=60", 60.0), ("?range=3600", 3600.0)):
        status, got = call(url, path + query)
        assert status == 200, got
        rng = got["range"]
        assert rng["seconds"] == seconds and rng["kept_s"] == 3600.0
        assert rng["to"] - rng["from"] == pytest.approx(seconds, abs=0.2)
    for query in ("?range=all", "?range=86400"):  # more than is kept: what is kept
        status, got = call(url, path + query)
        assert status == 200 and got["range"]["seconds"] == 3600.0, got
    for bad in ("0", "-5", "abc", "nan", "inf", "1h"):
        status, got = call(url, f"{path}?range={bad}")
        assert status == 400, (bad, got)
        assert got["type"] == "BadRequest" and "'range'" in got["message"], got


def test_the_history_kept_is_kvq_monitor_history_s(mon: Monitor) -> None:
    server, thread = serve_api(mon.board, "127.0.0.1", 0, history_s=7200.0)
    try:
        status, got = call(
            f"http://127.0.0.1:{server.server_address[1]}", "/api/dashboard?range=all"
        )
        assert status == 200 and got["range"]["seconds"] == got["range"]["kept_s"] == 7200.0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
