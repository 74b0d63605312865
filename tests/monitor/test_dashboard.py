"""The monitor's live dashboard in a real browser (issue 30, items 1 and 8): a system of real
processes (monitor with its HTTP port, coordinator, two workers, `kvq api`), the page opened in
headless Chromium through Playwright, live data waited for, a worker killed and its slice cells
seen to change, and a screenshot that must not be blank. The same processes log as JSON
(`KVQ_LOG_FORMAT=json`): each role says "ready" once.

Chromium: Debian's `chromium` (`.ci/run` installs it, unpacked without root when needed) or
`KVQ_CHROMIUM`; without one the browser tests skip, saying so."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from shapes import deepseek_v3_record
from waiting import wait_for

from kvq import client
from kvq.bus import cancel_keys, operator
from kvq.bus.deadletters import get_dead, list_dead
from kvq.bus.records import Quarantine, WorkerInfo
from kvq.bus.redis_board import open_board
from kvq.bus.streams import dead_letter
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.monitor.alerts import ELSEWHERE, RULES
from kvq.monitor.coverage import sid_ranges
from kvq.quant.kernels import describe
from kvq.tools.synth import make_tiny

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "tests" / "artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium() -> tuple[str, dict[str, str]] | None:
    """The browser binary and the environment it needs (LD_LIBRARY_PATH when unpacked)."""
    given = os.environ.get("KVQ_CHROMIUM")
    if given:
        return given, {}
    unpacked = ROOT / ".tools" / "chromium"
    if (unpacked / "usr/lib/chromium/chromium").exists():
        libs = [
            str(p)
            for p in (
                unpacked / "usr/lib/x86_64-linux-gnu",
                unpacked / "lib/x86_64-linux-gnu",
                unpacked / "usr/lib/chromium",
            )
        ]
        return str(unpacked / "usr/lib/chromium/chromium"), {"LD_LIBRARY_PATH": ":".join(libs)}
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return (found, {}) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


OPERATOR_TOKEN = "alice-dashboard-token-0123"


@dataclass
class Swarm:
    url: str  # the monitor's HTTP port: the dashboard
    api: str
    settings: Settings
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        return httpx.get(self.url + "/api/dashboard", timeout=10).json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def swarm(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    tmp = tmp_path_factory.mktemp("dashboard")
    model = tmp / "tiny.gguf"
    make_tiny(model, layers=2, experts=8, seed=5)  # 4 slices: 2 layers x 2 expert groups
    http, api = free_port(), free_port()
    s = Settings(redis_url=redis_server.url, prefix=f"dash{os.getpid()}")
    env = child_env(
        s,
        http_port=http,
        heartbeat_ttl_s=1.5,
        monitor_poll_s=0.2,
        volunteer_poll_s=0.1,
        slot_poll_s=0.2,
        worker_max_slices=2,
        log_format="json",
        state_dir=str(tmp / "state"),
        monitor_tokens=f"alice={OPERATOR_TOKEN}",
    )
    sw = Swarm(f"http://127.0.0.1:{http}", f"http://127.0.0.1:{api}", s)
    kvq = [sys.executable, "-m", "kvq"]
    cmds = {
        "monitor": [*kvq, "monitor", "--model", f"tiny={model}"],
        "coordinator": [
            *kvq,
            "coordinator",
            "--model",
            str(model),
            "--model-id",
            "tiny",
            "--id",
            "coord-dash",
        ],
        "worker-a": [*kvq, "worker", "--id", "dash-a"],
        "worker-b": [*kvq, "worker", "--id", "dash-b"],
        "api": [*kvq, "api", "--port", str(api)],
    }
    try:
        for name, cmd in cmds.items():
            sw.logs[name] = tmp / f"{name}.log"
            with sw.logs[name].open("wb") as out:
                sw.procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
            if name == "monitor":  # the others wait for the registration anyway
                wait_for(
                    lambda: httpx.get(sw.url + "/healthz", timeout=2).status_code == 200,
                    90,
                    "the monitor's HTTP port",
                    ignore=httpx.HTTPError,
                    poll_s=0.2,
                )
        wait_for(
            lambda: (
                sum(
                    w["slices"]
                    for w in sw.snapshot()["workers"]
                    if w["heartbeat_age_s"] is not None
                )
                == 4
                and all(c["live"] == 1 for m in sw.snapshot()["models"] for c in m["cells"])
            ),
            90,
            "both workers serving two slices each",
            ignore=httpx.HTTPError,
            poll_s=0.2,
        )
        yield sw
    finally:
        for p in sw.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in sw.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_alert_rules_match_docs_alerts_yml() -> None:
    doc = yaml.safe_load((ROOT / "docs" / "alerts.yml").read_text())
    names = [r["alert"] for g in doc["groups"] if g["name"] not in ELSEWHERE for r in g["rules"]]
    assert sorted(names) == sorted(RULES), "kvq/monitor/alerts.py must mirror docs/alerts.yml"
    assert set(ELSEWHERE) <= {g["name"] for g in doc["groups"]}


@pytest.mark.slow
def test_dashboard_json_and_the_ready_lines(swarm: Swarm) -> None:
    snap = swarm.snapshot()
    (m,) = snap["models"]
    assert m["model"] == "tiny" and m["layers"] == 2 and len(m["cells"]) == 4
    assert {w["worker"] for w in snap["workers"]} == {"dash-a", "dash-b"}
    # each worker's kernel path, as its info says (a slow float32 path would show here)
    assert {w["kernels"] for w in snap["workers"]} == {describe("cpu")}
    (c,) = snap["coordinators"]
    assert c["coordinator"] == "coord-dash" and c["slots"] >= 1
    assert any(s["stream"].startswith("requests") for s in snap["streams"])
    assert {a["alert"] for a in snap["alerts"]} <= set(RULES)
    httpx.post(
        swarm.api + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 4},
        timeout=60,
    ).raise_for_status()
    for role, log in swarm.logs.items():
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        ready = [x["message"] for x in lines if x["message"].startswith("ready:")]
        assert len(ready) == 1, (role, ready)
        assert ("tiny" in ready[0]) or role.startswith("worker"), ready
        splits = [x for x in lines if x["message"].startswith("capacity split")]
        assert len(splits) <= 3, (role, len(splits))


def open_page(pw: Any, exe: str, extra_env: dict[str, str], profile: Path) -> Any:
    return pw.chromium.launch_persistent_context(
        str(profile),
        executable_path=exe,
        headless=True,
        args=FLAGS,
        env=dict(os.environ) | extra_env,
        viewport={"width": 1280, "height": 1400},
    )


@pytest.mark.slow
def test_operator_actions_in_headless_chromium(swarm: Swarm, tmp_path: Path) -> None:
    """Read-only until signed in with an operator's token; then each button does what its CLI
    command does, seen in Redis: a dead letter requeued and one dropped, a request in flight
    cancelled (its reply ends `cancelled`), a worker drained, quarantined and released (each
    verdict names the operator). The swarm is left as it was (every slice live again)."""
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium: apt-get install chromium, or run .ci/run (it unpacks one)")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install kvq[test]")
    exe, extra_env = browser
    board = open_board(swarm.settings.bus, swarm.settings.lifetimes)
    r, keys = board.r, board.keys
    with playwright.sync_playwright() as pw:
        ctx = open_page(pw, exe, extra_env, tmp_path / "profile")
        try:
            page = ctx.new_page()
            page.goto(swarm.url + "/")
            page.wait_for_selector('#status[data-state="live"]', timeout=30_000)
            page.wait_for_selector('#operator[data-state="signed-out"]', timeout=30_000)
            page.wait_for_selector('tr[data-worker="dash-a"]', timeout=30_000)
            drain_a = 'tr[data-worker="dash-a"] button[data-action="drain"]'
            assert not page.is_visible(drain_a), "read-only: no action buttons"
            page.fill("#token", "wrong-token-0123456789")
            page.click("#signin button")
            page.wait_for_function(
                "() => document.getElementById('who').textContent.includes('wrong token')"
            )
            page.fill("#token", OPERATOR_TOKEN)
            page.click("#signin button")
            page.wait_for_selector('#operator[data-state="signed-in"]', timeout=30_000)
            assert page.inner_text("#who") == "operator: alice"
            _dead_letter_buttons(page, r, keys)
            _cancel_button(page, board)
            _worker_buttons(page, board, swarm)
        finally:
            ctx.close()
            board.r.close()


def _dead_letter_buttons(page: Any, r: Any, keys: Keys) -> None:
    """Requeue puts the letter's fields back on its source stream; drop deletes it."""
    source = keys.bench("dashboard-actions")  # a stream nobody reads: the requeued entry stays
    dead_letter(r, keys, source, b"1-1", {b"x": b"1"}, "test: requeue me", 1000)
    dead_letter(r, keys, source, b"1-2", {b"x": b"2"}, "test: drop me", 1000)
    ids = [d.id for d in list_dead(r, keys, 2)[::-1]]  # oldest first
    page.click(f'li[data-dead="{ids[0]}"] button[data-action="deadletter-requeue"]')
    wait_for(lambda: get_dead(r, keys, ids[0]) is None, 30, "the letter requeued")
    assert [f for _, f in r.xrange(source)] == [{b"x": b"1"}]
    page.wait_for_selector(f'li[data-dead="{ids[0]}"]', state="detached", timeout=30_000)
    assert "requeue dead letter" in page.inner_text("#action-status")
    page.click(f'li[data-dead="{ids[1]}"] button[data-action="deadletter-drop"]')
    wait_for(lambda: get_dead(r, keys, ids[1]) is None, 30, "the letter dropped")
    assert r.xlen(source) == 1, "dropped, not requeued"
    r.delete(source)


def _cancel_button(page: Any, board: Any) -> None:
    """A long greedy request (500 tokens: no EOS on this model) shows in the table with its
    coordinator; its cancel button ends it with `finish: cancelled`."""
    r, keys = board.r, board.keys
    rid = client.send(r, keys, "tiny", prompt="x", max_tokens=500)
    # a few seconds of generation: the page is told to redraw as soon as the record says so
    wait_for(
        lambda: any(f.request == str(rid) for f in board.in_flight(["coord-dash"])),
        30,
        "the request in coord-dash's inflight record",
        poll_s=0.02,
    )
    page.evaluate("poll(true)")
    row = f'tr[data-request="{rid}"]'
    page.wait_for_selector(row, timeout=30_000)
    text = page.inner_text(row)
    assert "coord-dash" in text and "tiny" in text and "expert" in text, text
    SHOTS.mkdir(exist_ok=True)
    page.locator("#requests").screenshot(path=str(SHOTS / "dashboard-request-in-flight.png"))
    page.click(f'{row} button[data-action="cancel"]')
    wait_for(lambda: cancel_keys.marked(r, keys, [str(rid)]), 30, "the request's cancel key")
    done = [e for e in client.events(r, keys, rid, timeout_s=60) if e.kind == "done"]
    assert done[-1].finish == "cancelled" and (done[-1].index or 0) < 500, done
    page.wait_for_selector(row, state="detached", timeout=30_000)
    page.screenshot(path=str(SHOTS / "dashboard-actions.png"), full_page=True)


def _worker_buttons(page: Any, board: Any, swarm: Swarm) -> None:
    """Drain, release, quarantine, release: each a verdict by alice in `P:{m:tiny}:quarantine`;
    after the last release the worker takes its slices back."""
    row = 'tr[data-worker="dash-a"]'
    page.click(f'{row} button[data-action="drain"]')
    wait_for(lambda: _verdict(board).drain, 30, "dash-a drained")
    assert _verdict(board).operator == "alice"
    page.wait_for_selector(f"{row} td.trust-draining", timeout=30_000)
    page.click(f'{row} button[data-action="release"]')
    wait_for(lambda: not _verdict(board).drain, 30, "dash-a released")
    page.wait_for_selector(f'{row} button[data-action="quarantine"]', timeout=30_000)
    page.click(f'{row} button[data-action="quarantine"]')
    wait_for(lambda: _verdict(board).active(board.now_ms()), 30, "dash-a quarantined")
    # the monitor takes its slices back: it leaves the table for the departed list
    gone = 'li[data-departed="dash-a"]'
    page.wait_for_selector(gone, timeout=30_000)
    assert "quarantined by operator alice: its slices taken back" in page.inner_text(gone)
    page.click(f'{gone} button[data-action="release"]')
    wait_for(lambda: not _verdict(board).idle(board.now_ms()), 30, "dash-a released")
    assert _verdict(board).reason == "released by operator alice"
    wait_for(
        lambda: (
            len(board.held_by("tiny", "dash-a")) == 2
            and all(c["live"] == 1 for m in swarm.snapshot()["models"] for c in m["cells"])
        ),
        60,
        "dash-a serving its slices again",
        poll_s=0.2,
    )


@pytest.mark.slow
def test_a_worker_s_page_in_headless_chromium(swarm: Swarm, tmp_path: Path) -> None:
    """A worker's row links to its page: kernel path, memory, jobs served, its info record, its
    trust history, and three charts (latency, load, queue) with a clock-time axis, a unit and
    a legend."""
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium: apt-get install chromium, or run .ci/run (it unpacks one)")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install kvq[test]")
    exe, extra_env = browser
    board = open_board(swarm.settings.bus, swarm.settings.lifetimes)
    operator.release(board, "dash-a", "carol")  # a harmless verdict: its history has a row
    board.r.close()
    with playwright.sync_playwright() as pw:
        ctx = open_page(pw, exe, extra_env, tmp_path / "profile")
        try:
            page = ctx.new_page()
            page.goto(swarm.url + "/")
            page.wait_for_selector('tr[data-worker="dash-a"] a.worker-link', timeout=30_000)
            page.click('tr[data-worker="dash-a"] a.worker-link')
            page.wait_for_url("**/worker/dash-a", timeout=30_000)
            page.wait_for_selector('#status[data-state="live"]', timeout=30_000)
            assert page.inner_text('#summary tr[data-key="kernels"] td') == describe("cpu")
            memory = page.inner_text('#summary tr[data-key="memory"] td')
            assert "MiB of expert slices (tiny: 2 slices)" in memory, memory
            served = int(page.inner_text('#summary tr[data-key="jobs served"] td'))
            assert served >= 0
            assert page.inner_text('#info tr[data-key="device"] td') == "cpu"
            history = page.inner_text("#history tbody")
            assert "released by operator carol" in history, history
            # the monitor samples every 5 s: wait for a line of two points in each chart
            page.wait_for_function(
                "() => [...document.querySelectorAll('.chart path[data-model=tiny]')]"
                ".filter((p) => (p.getAttribute('d').match(/L/g) || []).length >= 1).length === 3",
                timeout=30_000,
            )
            for name, unit in (
                ("ms_per_row", "ms per token row"),
                ("load", "share of the beat computing"),
                ("queued_rows", "token rows"),
            ):
                box = f'.chart-box[data-chart="{name}"]'
                labels = page.locator(f"{box} .axis-label").all_text_contents()
                assert labels == ["time (UTC)", unit], labels
                ticks = page.locator(f"{box} .x-tick").all_text_contents()
                assert len(ticks) == 5 and all(len(t) == 8 and t[2] == ":" for t in ticks), ticks
                legend = page.inner_text(f'{box} .legend .key[data-model="tiny"]')
                assert legend.startswith("tiny: ") and legend.endswith(f"{unit} now"), legend
            SHOTS.mkdir(exist_ok=True)
            page.screenshot(path=str(SHOTS / "dashboard-worker-page.png"), full_page=True)
            _switch_range(page, "#charts", "dashboard-worker-page-1h.png")
            gone = httpx.get(swarm.url + "/api/worker/nobody", timeout=10)
            assert gone.status_code == 404
        finally:
            ctx.close()


def _stream_charts(page: Any) -> None:
    """The streams' charts: one per measure, a UTC time axis, a y axis in its unit, and a
    legend of the streams (one line each)."""
    for name, unit in (("depth", "entries"), ("lag", "entries"), ("oldest pending age", "seconds")):
        box = f'#streams .chart-box[data-chart="{name}"]'
        labels = page.locator(f"{box} .axis-label").all_text_contents()
        assert labels == ["time (UTC)", unit], labels
        ticks = page.locator(f"{box} .x-tick").all_text_contents()
        assert len(ticks) == 5 and all(len(t) == 8 and t[2] == ":" for t in ticks), ticks
        keys = page.locator(f'{box} .legend .key[data-model^="requests"]').all_text_contents()
        assert keys and all(k.endswith(f"{unit} now") for k in keys), keys
        lines = page.locator(f"{box} svg path[data-model]").count()
        assert lines == page.locator(f"{box} .legend .key[data-model]").count() >= 3


SPANS = """sel => [...document.querySelectorAll(sel + ' svg.chart')]
  .map((s) => Number(s.dataset.t1) - Number(s.dataset.t0))"""


def _switch_range(page: Any, charts: str, shot: str) -> None:
    """The range buttons change every chart's time span: 10 minutes, 1 h, all kept (an hour
    by default), and back."""
    assert page.evaluate(SPANS, charts) == pytest.approx([600.0] * 3, abs=0.5)
    first = page.locator(f"{charts} .x-tick").first.text_content()
    for value, seconds in (("3600", 3600.0), ("all", 3600.0), ("600", 600.0)):
        page.click(f'.range-btn[data-range="{value}"]')
        page.wait_for_function(
            f"sel => (({SPANS})(sel)).filter((s) => Math.abs(s - {seconds}) < 0.5).length === 3",
            arg=charts,
            timeout=15_000,
        )
        assert page.get_attribute(f'.range-btn[data-range="{value}"]', "aria-pressed") == "true"
        if value == "3600":
            assert page.locator(f"{charts} .x-tick").first.text_content() != first
            page.screenshot(path=str(SHOTS / shot), full_page=True)
    assert page.inner_text('.range-btn[data-range="all"]') == "all kept (1 h)"


def _verdict(board: Any) -> Quarantine:
    """dash-a's verdict now (none yet: an empty one, until the page's fetch lands)."""
    got = board.quarantined("tiny").get("dash-a")
    return got if got is not None else Quarantine(until_ms=0, mismatches=0)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_the_page_in_headless_chromium(swarm: Swarm, tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium: apt-get install chromium, or run .ci/run (it unpacks one)")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install kvq[test]")
    exe, extra_env = browser
    with playwright.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=exe,
            headless=True,
            args=FLAGS,
            env=dict(os.environ) | extra_env,
            viewport={"width": 1280, "height": 1400},
        )
        try:
            page = ctx.new_page()
            page.goto(swarm.url + "/")
            page.wait_for_selector('#status[data-state="live"]', timeout=30_000)
            page.wait_for_selector('tr[data-worker="dash-b"]', timeout=30_000)
            held = swarm.snapshot()["workers"]
            b_slices = next(w["held"] for w in held if w["worker"] == "dash-b")
            sid = b_slices[0].split("/", 1)[1]
            cell = f'.cell[data-slice="{sid}"]'
            assert page.get_attribute(cell, "data-state") == "ok"
            assert page.get_attribute(cell, "data-live") == "1"
            assert page.locator("#coordinators tbody tr").count() == 1
            _stream_charts(page)
            SHOTS.mkdir(exist_ok=True)
            before = SHOTS / "dashboard.png"
            page.screenshot(path=str(before), full_page=True)
            _switch_range(page, "#streams", "dashboard-range-1h.png")

            swarm.procs["worker-b"].kill()  # its slices lose their only live replica
            page.wait_for_function(
                "sel => document.querySelector(sel)?.dataset.state === 'none'",
                arg=cell,
                timeout=30_000,
            )
            assert page.get_attribute(cell, "data-live") == "0"
            assert page.locator(".cell[data-state='none']").count() == len(b_slices)
            # the alert condition of docs/alerts.yml that now holds, as Prometheus would see it
            page.wait_for_selector('li[data-alert="KvqSliceWithoutLiveWorker"]', timeout=30_000)
            # reaped by the monitor: kept on the page with when and why
            page.wait_for_selector('li[data-departed="dash-b"]', timeout=30_000)
            gone = page.inner_text('li[data-departed="dash-b"]')
            assert "lost: no heartbeat for 1.5s" in gone and "reaped" in gone, gone
            assert page.locator('tr[data-worker="dash-b"]').count() == 0
            after = SHOTS / "dashboard-worker-killed.png"
            page.screenshot(path=str(after), full_page=True)
            assert_not_blank(page, before, red=False)
            assert_not_blank(page, after, red=True)
        finally:
            ctx.close()


# the saved PNG decoded by the browser itself (no imaging library here): its size, how many
# distinct colours, and whether the green of a covered cell is in it
COUNT_PIXELS = """async (data) => {
  const img = new Image();
  img.src = "data:image/png;base64," + data;
  await img.decode();
  const c = document.createElement("canvas");
  c.width = img.width; c.height = img.height;
  const g = c.getContext("2d");
  g.drawImage(img, 0, 0);
  const px = g.getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  let green = 0, red = 0;
  for (let i = 0; i < px.length; i += 4) {
    seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
    if (px[i] === 0x2f && px[i + 1] === 0x9e && px[i + 2] === 0x44) green++;
    if (px[i] === 0xd9 && px[i + 1] === 0x48 && px[i + 2] === 0x0f) red++;
  }
  return {width: c.width, height: c.height, colours: seen.size, green, red};
}"""


def assert_not_blank(page: Any, png: Path, red: bool) -> None:
    """A screenshot with the page in it: many colours, a covered (green) cell, and a cell
    without a live replica (red) after the kill."""
    import base64

    got = page.evaluate(COUNT_PIXELS, base64.b64encode(png.read_bytes()).decode())
    assert got["width"] >= 1000 and got["height"] >= 600, got
    assert got["colours"] > 50, f"{png}: blank ({got})"
    assert got["green"] > 500, got
    assert (got["red"] > 500) == red, got


@pytest.mark.slow
def test_the_page_at_deepseek_v3_scale(settings: Settings, tmp_path: Path) -> None:
    """3,712 slices, 32 workers (one lost, one late), no coordinator: the page stays under two
    screens, the coverage reads per layer span (grey: nothing served; red: the lost worker's
    spans) with a drill-down to one span's slices and to a worker's spans, a worker's slices
    as a count and ranges, 20 worker rows and a button for the rest, the 32 inboxes as one
    line of the streams' charts, and the lost worker's 116 slices are one alert line."""
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium: apt-get install chromium, or run .ci/run (it unpacks one)")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install kvq[test]")
    from kvq.monitor.http import serve_api

    tiny = tmp_path / "tiny.gguf"
    make_tiny(tiny, layers=2, experts=8, seed=5)
    info = deepseek_v3_record(tiny)
    board = open_board(settings.bus, dataclasses.replace(settings.lifetimes, heartbeat_ttl_s=120))
    late = open_board(settings.bus, dataclasses.replace(settings.lifetimes, heartbeat_ttl_s=50))
    board.register_model(info, 1)
    sids = sorted(info.slices)
    n, per = 32, 116  # 32 x 116 = 3,712
    for i in range(n):
        worker, mine = f"ds-{i}", sids[i * per : (i + 1) * per]
        assert board.rejoin("dsv3", worker, *mine) == per
        beat = WorkerInfo(model="dsv3", slice=mine[0], device="cpu")
        if i == n - 2:
            late.beat(worker, beat)  # its beat ends in 50 s: 70 s late on a 120 s lifetime
        elif i != n - 1:  # the last never beats: lost
            board.beat(worker, beat)
    gone, slow = f"ds-{n - 1}", f"ds-{n - 2}"
    server, _ = serve_api(board, "127.0.0.1", 0)
    url = "http://{}:{}".format(*server.server_address)
    exe, extra_env = browser
    height = 900
    try:
        with playwright.sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"),
                executable_path=exe,
                headless=True,
                args=FLAGS,
                env=dict(os.environ) | extra_env,
                viewport={"width": 1280, "height": height},
            )
            try:
                page = ctx.new_page()
                page.goto(url + "/")
                page.wait_for_selector('#status[data-state="live"]', timeout=60_000)
                strip = '.spans[data-model="dsv3"] .span'
                assert page.locator(strip).count() == 58
                lost = len({info.slices[sid].layer_start for sid in sids[(n - 1) * per :]})
                assert page.locator(f'{strip}[data-state="none"]').count() == lost
                assert page.locator(f'{strip}[data-state="idle"]').count() == 58 - lost
                assert page.locator(".cell").count() == 0, "a large model's spans start closed"
                page.wait_for_selector('li[data-alert="KvqSliceWithoutLiveWorker"]', timeout=30_000)
                alerts = page.locator('li[data-alert="KvqSliceWithoutLiveWorker"]')
                assert alerts.count() == 1 and "116 wanted slices" in alerts.inner_text()
                assert page.get_attribute(f'tr[data-worker="{gone}"]', "data-state") == "lost"
                assert page.get_attribute(f'tr[data-worker="{slow}"]', "data-state") == "late"
                assert page.get_attribute('tr[data-worker="ds-0"]', "data-state") == "serving"
                row = page.inner_text(f'tr[data-worker="{gone}"]')
                ranges = "; ".join(f"dsv3: {r}" for r in sid_ranges(sids[(n - 1) * per :]))
                assert f"116: {ranges}" in row and ranges.startswith("dsv3: L59 E48-255"), row
                assert page.locator("#workers tbody tr[data-worker]").count() == 20
                assert page.inner_text("#workers button.more") == f"show {n - 20} more"
                inbox = page.locator(
                    '.chart-box[data-chart="depth"] .key[data-model^="inbox dsv3"]'
                )
                assert inbox.count() == 1 and "(32 workers)" in inbox.inner_text()
                SHOTS.mkdir(exist_ok=True)
                page.screenshot(path=str(SHOTS / "dashboard-deepseek-v3.png"), full_page=True)
                tall = page.evaluate("document.documentElement.scrollHeight")
                assert tall <= 2 * height, f"{tall}px: more than two screens"
                page.click(f'{strip}[data-state="none"] >> nth=0')
                page.wait_for_selector('.grid[data-model="dsv3"] .cell.mini', timeout=30_000)
                assert page.locator(".cell.mini").count() == 64
                assert page.locator('.cell.mini[data-state="none"]').count() >= 1
                page.screenshot(path=str(SHOTS / "dashboard-deepseek-v3-span.png"), full_page=True)
                tall = page.evaluate("document.documentElement.scrollHeight")
                assert tall <= 2 * height, f"{tall}px with one span open"
                page.click(f'tr[data-worker="{gone}"]')  # its row opens the spans it holds
                page.wait_for_function(
                    "n => document.querySelectorAll('.cell.mini').length === n",
                    arg=64 * lost,
                    timeout=30_000,
                )
                assert page.locator('.cell.mini[data-state="none"]').count() == per
                tall = page.evaluate("document.documentElement.scrollHeight")
                assert tall <= 2 * height, f"{tall}px with a worker's {lost} spans open"
            finally:
                ctx.close()
    finally:
        server.shutdown()
        board.r.close()
        late.r.close()


def test_the_page_at_64_slices_with_a_worker_lost(settings: Settings, tmp_path: Path) -> None:
    """The `small` preset's slice count (64: 8 layers of 32 experts, 4 a slice), two workers
    of 32 slices each, one of them lost (its heartbeat gone): one alert line naming the 32
    slices it left, its row `lost`, the page within two 900 px screens."""
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium: apt-get install chromium, or run .ci/run (it unpacks one)")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install kvq[test]")
    from kvq.gguf.registry import plan_model
    from kvq.monitor.http import serve_api

    model = tmp_path / "m64.gguf"
    make_tiny(model, layers=8, experts=32, seed=5)
    info = plan_model("m64", model, 1, 4)
    assert len(info.slices) == 64
    board = open_board(settings.bus, dataclasses.replace(settings.lifetimes, heartbeat_ttl_s=120))
    board.register_model(info, 1)
    sids = sorted(info.slices)
    for i, worker in enumerate(("w-alive", "w-lost")):
        mine = sids[i * 32 : (i + 1) * 32]
        assert board.rejoin("m64", worker, *mine) == 32
        if worker == "w-alive":  # the other never beats: lost
            board.beat(worker, WorkerInfo(model="m64", slice=mine[0], device="cpu"))
    server, _ = serve_api(board, "127.0.0.1", 0)
    url = "http://{}:{}".format(*server.server_address)
    exe, extra_env = browser
    try:
        with playwright.sync_playwright() as pw:
            ctx = open_page(pw, exe, extra_env, tmp_path / "profile")
            try:
                page = ctx.new_page()
                page.set_viewport_size({"width": 1280, "height": 900})
                page.goto(url + "/")
                page.wait_for_selector('li[data-alert="KvqSliceWithoutLiveWorker"]', timeout=60_000)
                alerts = page.locator('li[data-alert="KvqSliceWithoutLiveWorker"]')
                assert alerts.count() == 1 and "32 wanted slices" in alerts.inner_text()
                assert page.get_attribute('tr[data-worker="w-lost"]', "data-state") == "lost"
                assert page.get_attribute('tr[data-worker="w-alive"]', "data-state") == "serving"
                SHOTS.mkdir(exist_ok=True)
                page.screenshot(path=str(SHOTS / "dashboard-64-worker-lost.png"), full_page=True)
                tall = page.evaluate("document.documentElement.scrollHeight")
                assert tall <= 2 * 900, f"{tall}px: more than two screens"
            finally:
                ctx.close()
    finally:
        server.shutdown()
        board.r.close()
