"""The gateway's own Prometheus metrics (per process: sum them over gateways). The queue,
slot and worker gauges of the whole system are the monitor's (`docs/api.md`).

No `*_created` series: `disable_created_metrics` drops the creation-time gauges that
prometheus-client adds beside every counter and histogram (Prometheus reads counter resets
without them)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from kvq.api.params import Call

disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class ApiMetrics:
    """Counters, gauges and histograms of one gateway."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "kvq_api_calls",
            "calls answered, by endpoint kind and outcome",
            ["kind", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "kvq_api_completion_tokens",
            "tokens generated for answered calls",
            ["model"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvq_api_prompt_tokens",
            "prompt tokens of answered calls (every prompt of a call)",
            ["model"],
            registry=registry,
        )
        self.errors = Counter(
            "kvq_api_errors",
            "calls refused or failed, by model and HTTP status "
            '(model "": before the call\'s model was read and found registered)',
            ["model", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "kvq_api_time_to_first_event_seconds",
            "from the call to its first reply event (the first token, or the refusal)",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "kvq_api_request_duration_seconds",
            "end to end: from the call to its last event (answered, failed or cancelled)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.waiting = Gauge(
            "kvq_api_requests_waiting",
            "calls admitted whose first reply event has not come",
            ["model"],
            registry=registry,
        )
        self.running = Gauge(
            "kvq_api_requests_running",
            "calls being answered: first event read, last not yet",
            ["model"],
            registry=registry,
        )

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, call: Call, tokens: int, prompt_tokens: int) -> None:
        kind = ("chat" if call.chat else "completion") + ("_stream" if call.stream else "")
        self.calls.labels(kind, "done").inc()
        self.tokens.labels(call.model).inc(tokens)
        self.prompt_tokens.labels(call.model).inc(prompt_tokens)

    def failed(self, status: int, model: str = "") -> None:
        self.errors.labels(model, str(status)).inc()

    def cancelled(self) -> None:
        self.calls.labels("stream", "cancelled").inc()

    def track(self, model: str, t0: float) -> Tracked:
        """A call of `model` that came at `t0` (time.monotonic), now waiting."""
        return Tracked(self, model, t0)


class Tracked:
    """One call's place in the running/waiting gauges, and its latency when it ends; each
    step counts once, whichever path (answer, error, disconnect) gets there first."""

    def __init__(self, m: ApiMetrics, model: str, t0: float) -> None:
        self.m, self.model, self.t0 = m, model, t0
        self.state = "waiting"
        self.streaming = False  # a stream has taken it over: the stream ends it
        m.waiting.labels(model).inc()

    def running(self) -> None:
        if self.state == "waiting":
            self.m.waiting.labels(self.model).dec()
            self.m.running.labels(self.model).inc()
            self.state = "running"

    def end(self) -> None:
        if self.state == "ended":
            return
        gauge = self.m.waiting if self.state == "waiting" else self.m.running
        gauge.labels(self.model).dec()
        self.m.latency.labels(self.model).observe(time.monotonic() - self.t0)
        self.state = "ended"
