"""The alert rules of `docs/alerts.yml`, evaluated on the monitor's own samples for the
dashboard: which conditions hold now. Prometheus stays the alerting system (it adds each rule's
`for:` and routes notifications); this shows an operator at a glance what it would fire on.
Each rule here has the same name, threshold and grouping as its PromQL (a test compares the
names with the file); rates and increases use `kvq.monitor.history.History` (the last 10
minutes, at most the rule's own window).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvq.monitor.history import Labels, Sample, increase, pick, since

Fired = list[dict[str, Any]]
# groups of docs/alerts.yml on each gateway's own /metrics, which the monitor does not scrape
ELSEWHERE = ("kvq-gateway",)


def _over(name: str, value: float, labels: dict[str, str], summary: str) -> dict[str, Any]:
    return {"alert": name, "labels": labels, "value": round(value, 3), "summary": summary}


def _max_by(s: Sample, metric: str, by: tuple[str, ...], **want: str) -> dict[Labels, float]:
    out: dict[Labels, float] = {}
    for labels, v in pick(s.series, metric, **want):
        key = tuple((k, labels.get(k, "")) for k in by)
        out[key] = max(out.get(key, v), v)
    return out


def _gauge_rule(
    name: str,
    metric: str,
    by: tuple[str, ...],
    test: Callable[[float], bool],
    what: str,
    **want: str,
) -> Callable[[list[Sample]], Fired]:
    def rule(samples: list[Sample]) -> Fired:
        got = _max_by(samples[-1], metric, by, **want)
        return [
            _over(name, v, dict(k), f"{' '.join(x for _, x in k)}: {what} {v:g}")
            for k, v in got.items()
            if test(v)
        ]

    return rule


def _slice_without_worker(samples: list[Sample]) -> Fired:
    """One per model (`sum by (model)` of the per-span counts), its value the wanted slices
    without a live worker."""
    per: dict[str, int] = {}
    for lb, v in pick(samples[-1].series, "kvq_span_uncovered_slices"):
        per[lb["model"]] = per.get(lb["model"], 0) + int(v)
    per = {m: n for m, n in per.items() if n > 0}
    return [
        _over(
            "KvqSliceWithoutLiveWorker",
            n,
            {"model": m},
            f"{m}: {n} wanted slices have no live worker",
        )
        for m, n in sorted(per.items())
    ]


def _dead_letters(samples: list[Sample]) -> Fired:
    grew = sum(increase(since(samples, 600.0), "kvq_deadletter_added_total").values())
    return (
        [_over("KvqDeadLetters", grew, {}, f"{grew:g} dead letters in the last 10 minutes")]
        if grew > 0
        else []
    )


def _ratio(
    name: str, top: str, bottom: str, limit: float, what: str, **top_want: str
) -> Callable[[list[Sample]], Fired]:
    def rule(samples: list[Sample]) -> Fired:
        pair = since(samples, 300.0)
        num: dict[str, float] = {}
        den: dict[str, float] = {}
        for lb, v in increase(pair, top).items():
            d = dict(lb)
            if all(_match(d.get(k, ""), x) for k, x in top_want.items()):
                num[d.get("model", "")] = num.get(d.get("model", ""), 0) + v
        for lb, v in increase(pair, bottom).items():
            m = dict(lb).get("model", "")
            den[m] = den.get(m, 0) + v
        return [
            _over(name, num.get(m, 0) / d, {"model": m}, f"{m}: {num.get(m, 0) / d:.0%} of {what}")
            for m, d in den.items()
            if d > 0 and num.get(m, 0) / d > limit
        ]

    return rule


def _match(value: str, want: str) -> bool:
    return value in want.split("|")


def _p95(name: str, metric: str, limit: float, what: str) -> Callable[[list[Sample]], Fired]:
    def rule(samples: list[Sample]) -> Fired:
        per: dict[str, dict[float, float]] = {}
        for lb, v in increase(since(samples, 300.0), metric + "_bucket").items():
            d = dict(lb)
            le = float("inf") if d["le"] == "+Inf" else float(d["le"])
            buckets = per.setdefault(d.get("model", ""), {})
            buckets[le] = buckets.get(le, 0) + v
        out = []
        for m, buckets in per.items():
            q = _quantile(0.95, buckets)
            if q is not None and q > limit:
                out.append(_over(name, q, {"model": m}, f"{m}: p95 {what} is {q:.2f}s"))
        return out

    return rule


def _quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative buckets (linear inside a bucket, as Prometheus)."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / max(buckets[le] - below, 1e-12)
        lo, below = le, buckets[le]
    return lo


def _absent(samples: list[Sample]) -> Fired:
    if pick(samples[-1].series, "kvq_deadletter_length"):
        return []
    return [_over("KvqMetricsAbsent", 1, {}, "no kvq metrics: is Redis up?")]


RULES: dict[str, Callable[[list[Sample]], Fired]] = {
    "KvqRequestBacklog": _gauge_rule(
        "KvqRequestBacklog",
        "kvq_group_lag",
        ("model",),
        lambda v: v > 50,
        "requests unread",
        stream="requests",
    ),
    "KvqRequestsWaiting": _gauge_rule(
        "KvqRequestsWaiting",
        "kvq_group_oldest_unread_age_seconds",
        ("model",),
        lambda v: v > 60,
        "oldest unread request (s)",
        stream="requests",
    ),
    "KvqOrphanedRequests": _gauge_rule(
        "KvqOrphanedRequests",
        "kvq_requests_orphaned",
        ("model",),
        lambda v: v > 0,
        "orphaned requests",
    ),
    "KvqInboxStuck": _gauge_rule(
        "KvqInboxStuck",
        "kvq_group_oldest_unread_age_seconds",
        ("model", "worker"),
        lambda v: v > 10,
        "oldest unread job (s)",
        stream="inbox",
    ),
    "KvqDeadLetters": _dead_letters,
    "KvqNoLiveCoordinator": _gauge_rule(
        "KvqNoLiveCoordinator",
        "kvq_coordinators_alive",
        ("model",),
        lambda v: v == 0,
        "live coordinators",
    ),
    "KvqSliceWithoutLiveWorker": _slice_without_worker,
    "KvqJobFallbacks": _ratio(
        "KvqJobFallbacks",
        "kvq_jobs_total",
        "kvq_jobs_sent_total",
        0.1,
        "remote jobs fall back to local compute",
        kind="fallback|error",
    ),
    "KvqRequestErrors": _ratio(
        "KvqRequestErrors",
        "kvq_requests_total",
        "kvq_requests_total",
        0.05,
        "requests end in an error",
        finish="error",
    ),
    "KvqSlowFirstToken": _p95(
        "KvqSlowFirstToken", "kvq_time_to_first_token_seconds", 5.0, "time to first token"
    ),
    "KvqSlowTokens": _p95("KvqSlowTokens", "kvq_token_gap_seconds", 1.0, "gap between tokens"),
    "KvqMetricsAbsent": _absent,
    "KvqRedisRefusesWrites": _gauge_rule(
        "KvqRedisRefusesWrites",
        "kvq_redis_refusing_writes",
        ("reason",),
        lambda v: v > 0,
        "redis refuses writes",
    ),
}


def holding(samples: list[Sample]) -> Fired:
    """Every alert condition that holds on the newest sample (and its window)."""
    if not samples:
        return []
    out: Fired = []
    for rule in RULES.values():
        out += rule(samples)
    return out
