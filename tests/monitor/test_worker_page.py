"""One worker's page data (`GET /api/worker/{id}`) on a real Redis: its info, kernel path, the
bytes it holds, jobs served, each model's verdict (an operator's included), and its latency,
load and queue over the monitor's samples; 404 for a worker nobody knows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvq.bus import operator
from kvq.bus.records import Quarantine, WorkerInfo
from kvq.config import Settings
from kvq.monitor import Monitor
from kvq.monitor.history import History, read_registry
from kvq.monitor.http import serve_api
from kvq.monitor.metrics import make_registry
from kvq.monitor.worker_page import worker_page
from kvq.tools.synth import make_tiny


@pytest.fixture
def mon(settings: Settings, tmp_path: Path) -> Monitor:
    path = tmp_path / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    m = Monitor.from_settings(settings.model_copy(update={"slice_experts": 4}))
    m.register("m", path)
    return m


@pytest.fixture
def url(mon: Monitor) -> Iterator[str]:
    server, thread = serve_api(mon.board, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def beat(mon: Monitor, sid: str, ms_per_row: float, load: float) -> None:
    info = WorkerInfo(
        model="m",
        slice=sid,
        device="cpu",
        served=7,
        ms_per_row=ms_per_row,
        load=load,
        queued_rows=3,
        kernels="int8 test-path",
    )
    mon.board.beat("w1", info)


def test_a_worker_s_page(mon: Monitor) -> None:
    board = mon.board
    sid = board.volunteer("m", "w1")
    assert sid is not None
    history = History(lambda: read_registry(make_registry(board)))
    beat(mon, sid, 2.5, 0.25)
    history.take()
    beat(mon, sid, 4.0, 0.5)
    history.take()
    caught = Quarantine(until_ms=1, mismatches=1, coord="c1", reason="row error 3", ts_ms=1)
    board.quarantine("m", "w1", caught)
    operator.drain(board, "w1", "alice")
    got = worker_page(board, history, "w1")
    assert got is not None
    assert got["alive"] and got["kernels"] == "int8 test-path" and got["served"] == 7
    assert got["held"] == {"m": [sid]}
    info = board.model_info("m")
    assert info is not None and got["held_bytes"] == info.slices[sid].nbytes > 0
    assert got["info"]["device"] == "cpu" and got["info"]["ms_per_row"] == 4.0
    (verdict,) = got["trust"]
    assert verdict["model"] == "m" and verdict["drain"] and verdict["operator"] == "alice"
    assert not verdict["active"] and verdict["reason"] == "drained by operator alice"
    assert [(v["coord"], v["operator"], v["reason"]) for v in got["history"]] == [
        ("", "alice", "drained by operator alice"),
        ("c1", "", "row error 3"),
    ], "every verdict, newest first"
    charts = got["charts"]
    assert [v for _, v in charts["ms_per_row"]["series"]["m"]] == [2.5, 4.0]
    assert [v for _, v in charts["load"]["series"]["m"]] == [0.25, 0.5]
    assert [v for _, v in charts["queued_rows"]["series"]["m"]] == [3, 3]
    assert charts["ms_per_row"]["unit"] == "ms per token row"
    times = [t for t, _ in charts["load"]["series"]["m"]]
    assert times == sorted(times) and times[0] > 1.7e9, "wall-clock seconds, oldest first"


def test_unknown_and_bad_ids_are_404(url: str, mon: Monitor) -> None:
    assert httpx.get(url + "/api/worker/nobody").status_code == 404
    assert httpx.get(url + "/api/worker/a%20b").status_code == 404
    assert mon.board.volunteer("m", "w2") is not None
    got = httpx.get(url + "/api/worker/w2").json()
    assert got["worker"] == "w2" and not got["alive"] and got["info"] is None
    page = httpx.get(url + "/worker/w2")
    assert page.status_code == 200 and "/static/worker.js" in page.text
