"""The coordinators' own counters and histograms, as Prometheus families (X5).

Each coordinator counts jobs, tokens, finished requests and three latencies in process and
overwrites its stats record (`P:{c:C}:stats`, `kvq.bus.records.CoordStats`) at every slot poll;
the monitor reads the records of every coordinator in the model's set on each scrape. The
counters restart from 0 when a coordinator restarts, which `rate()` and `increase()` handle.
Labels: `model`, `coordinator`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvq.bus.histogram import Histogram
from kvq.bus.records import CoordStats

_LABELS = ["model", "coordinator"]
_JOB_KINDS = (  # kvq_jobs_total{kind}: how each slice job of a MoE layer was answered
    ("local", "local_jobs"),
    ("remote", "remote_jobs"),
    ("fallback", "fallback_jobs"),
    ("error", "remote_errors"),
)
_HISTOGRAMS = (
    ("kvq_job_round_trip_seconds", "job_rtt_s", "remote expert job: sent -> result read"),
    ("kvq_time_to_first_token_seconds", "ttft_s", "request admitted -> first token written"),
    ("kvq_token_gap_seconds", "token_gap_s", "between two token events of one request"),
)
_COUNTERS = (
    ("kvq_jobs_sent", "remote_sent", "expert jobs sent to workers"),
    ("kvq_late_results", "late_results", "results for jobs already answered, dropped"),
    ("kvq_tokens", "tokens", "tokens generated"),
    ("kvq_requests_claimed", "claimed", "requests taken over from dead coordinators"),
    ("kvq_rescues", "rescues", "workers lost while this coordinator was using them"),
    ("kvq_results_verified", "verified", "remote results recomputed here before use"),
    ("kvq_result_mismatches", "mismatches", "verified results that disagreed (worker caught)"),
    ("kvq_results_nonfinite", "nonfinite_results", "results with NaN or inf, recomputed here"),
    ("kvq_results_barred", "barred_results", "results of quarantined workers, not used"),
    ("kvq_quarantines", "quarantines", "workers this coordinator quarantined"),
    ("kvq_remote_rows", "remote_rows", "token rows of remote results received"),
    ("kvq_local_rows", "local_rows", "token rows of expert slices computed here"),
    ("kvq_verified_rows", "verified_rows", "token rows recomputed here to check results"),
    ("kvq_local_expert_seconds", "local_expert_s", "seconds computing expert slices here"),
    ("kvq_remote_wait_seconds", "remote_wait_s", "seconds layers waited for remote results"),
    ("kvq_remote_send_seconds", "remote_send_s", "seconds making and sending remote jobs"),
)


class CoordMetrics:
    """Families filled from the stats records of one scrape."""

    def __init__(self) -> None:
        self.jobs = CounterMetricFamily(
            "kvq_jobs", "slice jobs by how they were answered", labels=[*_LABELS, "kind"]
        )
        self.requests = CounterMetricFamily(
            "kvq_requests",
            "requests answered, by finish reason (eos, length, context) or error",
            labels=[*_LABELS, "finish"],
        )
        self.counters = [
            (CounterMetricFamily(name, doc, labels=_LABELS), field)
            for name, field, doc in _COUNTERS
        ]
        self.histograms = [
            (HistogramMetricFamily(name, doc, labels=_LABELS), field)
            for name, field, doc in _HISTOGRAMS
        ]

    def add(self, model: str, coord: str, stats: CoordStats) -> None:
        labels = [model, coord]
        for kind, field in _JOB_KINDS:
            self.jobs.add_metric([*labels, kind], getattr(stats, field))
        for family, field in self.counters:
            family.add_metric(labels, getattr(stats, field))
        finishes = dict.fromkeys(("eos", "length", "context", "error"), 0)
        for reason, n in (finishes | _finishes(stats.finishes)).items():
            self.requests.add_metric([*labels, reason], n)
        for hfamily, field in self.histograms:
            h = Histogram.from_text(getattr(stats, field)) or Histogram()
            hfamily.add_metric(labels, buckets=h.cumulative(), sum_value=h.sum)

    def families(self) -> Iterator[Metric]:
        yield self.jobs
        yield self.requests
        yield from (family for family, _ in self.counters)
        yield from (family for family, _ in self.histograms)


def _finishes(text: str) -> dict[str, int]:
    try:
        d = json.loads(text)
        return {str(k): int(v) for k, v in d.items()} if isinstance(d, dict) else {}
    except (ValueError, TypeError):
        return {}
