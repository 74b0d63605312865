"""The gateway's own metrics on a real system: prompt tokens, the end-to-end latency
histogram, requests running and waiting, errors by model and status, and no `*_created`
series."""

from __future__ import annotations

import httpx
import pytest
from conftest import MODEL, System
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from kvq.api.metrics import ApiMetrics

pytestmark = pytest.mark.slow  # a system of kvq roles or processes


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(
    m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def test_calls_count_prompt_tokens_latency_and_errors_by_model(system: System) -> None:
    url = system.gateway()
    before = scrape(url)
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": ["one two", "three"], "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    unread = httpx.post(
        url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "x", "max_tokens": -1}
    )
    unknown = httpx.post(url + "/v1/completions", timeout=60, json={"model": "nope", "prompt": "x"})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    bad = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": tools,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
    )
    assert (unread.status_code, unknown.status_code, bad.status_code) == (400, 404, 400)
    after = scrape(url)
    assert not [name for name, _ in after if name.endswith("_created")]
    prompt = r.json()["usage"]["prompt_tokens"]
    assert prompt > 0
    wanted = [  # (name, labels, growth)
        ("kvq_api_prompt_tokens_total", {"model": MODEL}, prompt),
        ("kvq_api_request_duration_seconds_count", {"model": MODEL}, 2),  # the refused one too
        ("kvq_api_errors_total", {"model": MODEL, "status": "400"}, 1),
        ("kvq_api_errors_total", {"model": "", "status": "400"}, 1),  # before the model was read
        ("kvq_api_errors_total", {"model": "", "status": "404"}, 1),  # no label per bad name
    ]
    for name, labels, growth in wanted:
        assert value(after, name, **labels) - value(before, name, **labels) == growth, name
    assert not [labels for name, labels in after if ("model", "nope") in labels]
    for gauge in ("kvq_api_requests_running", "kvq_api_requests_waiting"):
        assert value(after, gauge, model=MODEL) == 0


def test_a_stream_is_running_until_it_ends(system: System) -> None:
    url = system.gateway()
    body = {
        "model": MODEL,
        "prompt": "run",
        "max_tokens": 200,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert value(scrape(url), "kvq_api_requests_running", model=MODEL) == 1
    wait_for(
        lambda: value(scrape(url), "kvq_api_requests_running", model=MODEL) == 0, 20, "the end"
    )
    assert value(scrape(url), "kvq_api_requests_waiting", model=MODEL) == 0


def test_a_call_waits_then_runs_then_ends_once() -> None:
    reg = CollectorRegistry()
    m = ApiMetrics(reg)
    t = m.track("m", 0.0)

    def gauges() -> tuple[float, float]:
        return (
            reg.get_sample_value("kvq_api_requests_waiting", {"model": "m"}) or 0.0,
            reg.get_sample_value("kvq_api_requests_running", {"model": "m"}) or 0.0,
        )

    assert gauges() == (1, 0)
    t.running()
    t.running()
    assert gauges() == (0, 1)
    t.end()
    t.end()
    assert gauges() == (0, 0)
    assert reg.get_sample_value("kvq_api_request_duration_seconds_count", {"model": "m"}) == 1
    m.track("m", 0.0).end()  # refused before its first event
    assert gauges() == (0, 0)
