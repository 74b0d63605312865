"""The shipped alert rules (docs/alerts.yml): each fires and resolves under `promtool test
rules`, each has its own test group, and each names only metrics that `/metrics` exports.

promtool comes from PATH or `.tools/bin/` (`tests/promtool.py`); without it the promtool tests
skip, saying how to get it.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promtool import promtool

from kvq.api.metrics import ApiMetrics
from kvq.bus.records import CoordStats, SlotState, WorkerInfo
from kvq.config import Settings
from kvq.keys import COORDINATOR_GROUP
from kvq.monitor import Monitor
from kvq.monitor.metrics import make_registry
from kvq.tools.synth import make_tiny

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "alerts.yml"
UNIT = Path(__file__).with_name("alerts_test.yml")


def alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_rules_are_valid() -> None:
    out = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_fires_and_resolves() -> None:
    out = subprocess.run(
        [promtool(), "test", "rules", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=UNIT.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_its_own_unit_test() -> None:
    unit = yaml.safe_load(UNIT.read_text())
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)) >= 10
    tested: dict[str, set[str]] = {}
    for t in unit["tests"]:
        for case in t["alert_rule_test"]:
            tested.setdefault(case["alertname"], set()).add(
                "fires" if case.get("exp_alerts") else "quiet"
            )
    for name in names:
        assert tested.get(name) == {"fires", "quiet"}, f"{name}: needs a firing and a quiet eval"


def test_one_lost_worker_of_64_slices_is_one_alert(tmp_path: Path) -> None:
    """The worker holding all 64 slices of a model dies: one alert whose value is 64 (the rule
    was per slice: 64 alerts), from the exporter's per-span counts."""
    series = [  # its 64 slices in 4 layer spans of 16
        {
            "series": f'kvq_span_uncovered_slices{{model="big",layers="L{i:03d}-{i + 1:03d}"}}',
            "values": "0 16x9",
        }
        for i in range(4)
    ]
    fires = {
        "eval_time": "7m",
        "alertname": "KvqSliceWithoutLiveWorker",
        "exp_alerts": [
            {
                "exp_labels": {"severity": "warning", "model": "big"},
                "exp_annotations": {
                    "summary": "big: 64 wanted slices have no live worker",
                    "description": alert_named("KvqSliceWithoutLiveWorker")["annotations"][
                        "description"
                    ],
                },
            }
        ],
    }
    unit = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [fires]}],
    }
    path = tmp_path / "lost_worker_test.yml"
    path.write_text(yaml.safe_dump(unit))
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def alert_named(name: str) -> dict[str, Any]:
    return next(a for a in alerts() if a["alert"] == name)


def test_every_metric_an_alert_names_is_exported(settings: Settings, tmp_path: Path) -> None:
    """A scrape of a small live deployment (the monitor's, and a gateway's) has every `kvq_*`
    series the rules use."""
    gguf = tmp_path / "m.gguf"
    make_tiny(gguf, layers=2, experts=8)
    mon = Monitor.from_settings(settings.model_copy(update={"slice_experts": 4}))
    mon.register("m", gguf)
    board = mon.board
    sid = board.volunteer("m", "w0")
    assert sid is not None
    board.beat("w0", WorkerInfo(model="m", slice=sid, device="cpu"))
    board.send_jobs([("w0", {"i": "0"})])
    req = board.keys.model_requests("m")
    board.r.xadd(req, {"i": 0})
    board.r.xgroup_create(req, COORDINATOR_GROUP, id="0")
    ts = int(time.time() * 1000)
    board.publish_slots("c1", SlotState(model="m", busy=0, total=4, ts_ms=ts), CoordStats())
    text = generate_latest(make_registry(board)).decode()  # type: ignore[arg-type]
    gateway = CollectorRegistry()  # a gateway's own: one call refused, one answered
    api = ApiMetrics(gateway)
    api.failed(429, "m")
    api.track("m", time.monotonic()).end()
    text += generate_latest(gateway).decode()
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for rule in alerts():
        for metric in re.findall(r"\bkvq_[a-z_]+", rule["expr"]):
            assert metric in exported, f"{rule['alert']} uses {metric}, which is not exported"
