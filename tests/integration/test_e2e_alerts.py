"""Alerts on what a real coordinator does (X5, issue 12 item 12).

60 requests for a coordinator with one slot: the documented `KvqRequestBacklog` of old
(`kvq_group_pending > 50`) cannot fire, since a coordinator reads only as many requests as it
has free slots; the shipped rule (on `kvq_group_lag`) fires on the same scrape. Then the
coordinator's published counters and histograms add up.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from e2e_helpers import wait_for
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promtool import promtool

from kvq import client
from kvq.config import Settings
from kvq.coordinator import Coordinator
from kvq.monitor import Monitor
from kvq.monitor.metrics import make_registry

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
N = 60
OLD_RULE = 'max by (model) (kvq_group_pending{stream="requests"}) > 50'


def _scrape(mon: Monitor) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(make_registry(mon.board)).decode()  # type: ignore[arg-type]
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if v)): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _promtool_fires(tmp: Path, lag: float, pending: float, old_rule: str | None) -> None:
    """`promtool test rules`: whether KvqRequestBacklog fires after 3m of this scrape's values
    (the shipped rule must; the old documented one, `old_rule`, must not)."""
    rules = ROOT / "docs" / "alerts.yml"
    expected: list[dict[str, object]] = []
    if old_rule is not None:
        rules = tmp / "old.yml"
        rule = {"alert": "KvqRequestBacklog", "expr": old_rule, "for": "2m"}
        rules.write_text(yaml.safe_dump({"groups": [{"name": "old", "rules": [rule]}]}))
    else:
        expected = [
            {
                "exp_labels": {"severity": "warning", "model": "tiny"},
                "exp_annotations": {
                    "summary": f"tiny: {lag:g} requests wait for a free coordinator slot",
                    "description": "Add coordinators (or KVQ_N_SLOTS); see kvq_coordinators_alive.",
                },
            }
        ]
    series = [
        {"series": f'kvq_group_{name}{{stream="requests",model="tiny"}}', "values": f"{v:g}x5"}
        for name, v in (("lag", lag), ("pending", pending))
    ]
    test = {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "KvqRequestBacklog", "exp_alerts": expected}
        ],
    }
    unit = tmp / "unit.yml"
    unit.write_text(
        yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [test]})
    )
    out = subprocess.run(
        [promtool(), "test", "rules", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_backlog_fires_on_lag_and_coordinator_counters_add_up(
    settings: Settings, tiny_model: Path, tmp_path: Path, run_in_thread
) -> None:
    s = settings.model_copy(update={"n_slots": 1, "saturation_threshold": 1})
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    r, keys = mon.board.r, mon.board.keys
    rids = [client.send(r, keys, "tiny", prompt=f"request {i}", max_tokens=4) for i in range(N)]
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    coord.tick()  # admits what fits its one slot
    coord.slots.poll_once()
    got = _scrape(mon)
    req = frozenset({("model", "tiny"), ("stream", "requests")})
    pending, lag = got["kvq_group_pending", req], got["kvq_group_lag", req]
    assert pending == 1, "a coordinator takes only what fits its slots"
    assert lag == N - 1
    assert got["kvq_coordinators_alive", frozenset({("model", "tiny")})] == 1
    _promtool_fires(tmp_path, lag, pending, None)
    _promtool_fires(tmp_path, lag, pending, OLD_RULE)  # never fires: pending <= N_SLOTS

    run_in_thread(coord)
    for rid in rids:
        assert [e.kind for e in client.events(r, keys, rid, 120)][-1] == "done"
    c = frozenset({("model", "tiny"), ("coordinator", "c1")})

    def published() -> bool:
        coord.slots.poll_once()
        return sum(v for k, v in _scrape(mon).items() if k[0] == "kvq_requests_total") == N

    wait_for(published, 30, "the coordinator's counters")
    got = _scrape(mon)
    assert got["kvq_group_lag", req] == 0 and got["kvq_group_pending", req] == 0
    tokens = got["kvq_tokens_total", c]
    ttft, gaps = (
        got["kvq_time_to_first_token_seconds_count", c],
        got["kvq_token_gap_seconds_count", c],
    )
    assert tokens > 0 and ttft > 0
    assert ttft + gaps == tokens, "each token is a first token or follows a gap"
    assert got["kvq_requests_total", c | {("finish", "error")}] == 0
    assert got["kvq_jobs_total", c | {("kind", "local")}] > 0
