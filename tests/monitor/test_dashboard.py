"""The monitor's live dashboard in a real browser (issue 30, items 1 and 8): a system of real
processes (monitor with its HTTP port, coordinator, two workers, `kvq api`), the page opened in
headless Chromium through Playwright, live data waited for, a worker killed and its slice cells
seen to change, and a screenshot that must not be blank. The same processes log as JSON
(`KVQ_LOG_FORMAT=json`): each role says "ready" once.

Chromium: Debian's `chromium` (`.ci/run` installs it, unpacked without root when needed) or
`KVQ_CHROMIUM`; without one the browser tests skip, saying so."""

from __future__ import annotations

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
from waiting import wait_for

from kvq.config import Settings, child_env
from kvq.monitor.alerts import ELSEWHERE, RULES
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


@dataclass
class Swarm:
    url: str  # the monitor's HTTP port: the dashboard
    api: str
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
    )
    sw = Swarm(f"http://127.0.0.1:{http}", f"http://127.0.0.1:{api}")
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
                    len(w["slices"])
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
            b_slices = next(w["slices"] for w in held if w["worker"] == "dash-b")
            sid = b_slices[0].split("/", 1)[1]
            cell = f'.cell[data-slice="{sid}"]'
            assert page.get_attribute(cell, "data-state") == "ok"
            assert page.get_attribute(cell, "data-live") == "1"
            assert page.locator("#coordinators tbody tr").count() == 1
            assert page.locator(".stream svg path").count() >= 3
            SHOTS.mkdir(exist_ok=True)
            before = SHOTS / "dashboard.png"
            page.screenshot(path=str(before), full_page=True)

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
