"""The gateway's own Prometheus metrics (per process: sum them over gateways). The queue,
slot and worker gauges of the whole system are the monitor's (`docs/api.md`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvq.api.params import Call

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ApiMetrics:
    """Counters and histograms of one gateway."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "kvq_api_calls", "calls answered, by endpoint kind and outcome",
            ["kind", "outcome"], registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "kvq_api_completion_tokens", "tokens generated for answered calls", ["model"],
            registry=registry,
        )  # fmt: skip
        self.errors = Counter(
            "kvq_api_errors", "calls refused or failed, by HTTP status", ["status"],
            registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvq_api_time_to_first_event_seconds",
            "from the call to its first reply event (the first token, or the refusal)",
            buckets=_TTFT_BUCKETS, registry=registry,
        )  # fmt: skip

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, call: Call, tokens: int) -> None:
        kind = ("chat" if call.chat else "completion") + ("_stream" if call.stream else "")
        self.calls.labels(kind, "done").inc()
        self.tokens.labels(call.model).inc(tokens)

    def failed(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def cancelled(self) -> None:
        self.calls.labels("stream", "cancelled").inc()
