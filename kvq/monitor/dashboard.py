"""What the monitor's live dashboard (`GET /`, `kvq/monitor/static/`) shows, as one JSON
snapshot (`GET /api/dashboard`): each model's coverage (totals, per layer span, and the cells of
the spans asked for: `kvq.monitor.coverage`), workers (their slices as a count and ranges;
serving, late or lost), the workers reaped in the last hour with when and why, coordinators,
the requests they generate now, every stream's depth, lag and pending age over the range asked
for (`?range=`: the last 10 minutes by default, up to `KVQ_MONITOR_HISTORY_S`), dead letters,
and the alert rules of `docs/alerts.yml` whose condition holds now.

Everything is read from Redis: the board for coverage, workers and trust, and the monitor's own
Prometheus registry (the numbers `/metrics` exports) for streams, coordinators and alerts. The
registry is sampled every `SAMPLE_S` on a background thread into `History`, so charts, rates
and the `increase(...)` of an alert see their window however often the page polls; alerts
always read the last `WINDOW_S`, whatever range the charts show.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from kvq.bus.deadletters import list_dead
from kvq.bus.records import WorkerView
from kvq.bus.redis_board import RedisBoard
from kvq.catalog import ModelInfo
from kvq.monitor.alerts import holding
from kvq.monitor.coverage import model_view, sid_ranges, span_keys
from kvq.monitor.history import (
    HISTORY_S,
    MAX_SAMPLES,
    WINDOW_S,
    History,
    Labels,
    Sample,
    Series,
    chart_range,
    increase,
    pick,
    read_registry,
    since,
)
from kvq.monitor.requests_view import requests_view

HELD_SHOWN = 32  # slice ids listed per worker (its count and ranges say the rest)
DEPARTED_SHOWN = 50


class Dashboard:
    """The snapshot the page draws."""

    def __init__(
        self, board: RedisBoard, registry: CollectorRegistry, history_s: float = HISTORY_S
    ) -> None:
        self.board = board
        self.history = History(lambda: read_registry(registry), history_s)
        self._rows: RowCache = {}  # each sample's stream rows, read once (an hour: 393 samples)

    def snapshot(
        self, open_spans: Mapping[str, Collection[int]] | None = None, range_s: float = WINDOW_S
    ) -> dict[str, Any]:
        """`open_spans`: model → the layer starts whose cells to send (a large model's spans
        come as counts only); `range_s`: how far back the stream charts look."""
        now = self.history.latest(max_age_s=2.0)
        samples = self.history.samples()  # WINDOW_S: alerts and rates
        charted = samples if range_s == WINDOW_S else self.history.samples(range_s)
        models = self.board.models()
        infos = {m: self.board.model_info(m) for m in models}
        listed = self._workers(models, infos)
        return {
            "ts": now.t,
            "models": [self._model(m, infos[m], (open_spans or {}).get(m, ())) for m in models],
            "workers": listed,
            "departed": self._departed({w["worker"] for w in listed}),
            "coordinators": self._coordinators(models, samples),
            "requests": requests_view(self.board, models, infos),
            "range": chart_range(now.t, range_s, self.history.keep_s),
            "streams": stream_charts(charted, self._rows),
            "deadletters": self._deadletters(now.series),
            "alerts": holding(samples),
        }

    def _model(
        self, model: str, info: ModelInfo | None, open_spans: Collection[int]
    ) -> dict[str, Any]:
        now_ms = self.board.now_ms()
        barred = {w for w, q in self.board.quarantined(model).items() if q.active(now_ms)}
        live = sum(1 for c in self.board.coordinators(model) if c.alive)
        view = model_view(
            info.slices if info else {},
            self.board.slice_demand(model),
            self.board.workers(model),
            barred,
            live,
            open_spans,
        )
        meta = info.meta if info else None
        return {
            "model": model,
            "layers": meta.block_count if meta else 0,
            "experts": meta.expert_count if meta else 0,
            **view,
        }

    def _workers(
        self, models: list[str], infos: Mapping[str, ModelInfo | None]
    ) -> list[dict[str, Any]]:
        """One row per worker: its slices as a count and ranges, its state (serving, loading,
        late: a beat missed, lost: no heartbeat, not reaped yet), trust and load."""
        now_ms = self.board.now_ms()
        rows: dict[str, dict[str, Any]] = {}
        held: dict[str, dict[str, list[str]]] = {}
        for m in models:
            trust = self.board.quarantined(m)
            for v in self.board.workers(m):
                row = rows.setdefault(v.worker_id, _worker_row(v))
                row["ready"] = row["ready"] and v.ready
                held.setdefault(v.worker_id, {}).setdefault(m, []).append(v.slice_id)
                q = trust.get(v.worker_id)
                if q is not None and q.active(now_ms):
                    row["trust"] = "banned" if q.banned else "quarantined"
                elif q is not None and q.drain and row["trust"] == "trusted":
                    row["trust"] = "draining"  # an operator's drain: no new work
        late_s = self.board.lifetimes.late_after_s()
        for w, age in self.board.heartbeat_ages_s(list(rows)).items():
            row = rows[w]
            row["heartbeat_age_s"] = age
            row["state"] = _worker_state(row, age, late_s)
            per = held[w]
            row["slices"] = sum(len(sids) for sids in per.values())
            row["ranges"] = [
                f"{m}: {r}" for m, sids in sorted(per.items()) for r in sid_ranges(sids)
            ]
            row["spans"] = [k for m, sids in sorted(per.items()) for k in span_keys(m, sids)]
            row["held"] = [f"{m}/{sid}" for m, sids in sorted(per.items()) for sid in sorted(sids)][
                :HELD_SHOWN
            ]
        rank = {"lost": 0, "late": 1, "loading": 2, "serving": 3}
        return sorted(
            rows.values(),
            key=lambda r: (rank.get(str(r["state"]), 3), r["trust"] == "trusted", _natural(r)),
        )

    def _departed(self, listed: set[str]) -> list[dict[str, Any]]:
        """Workers reaped in the last hour (`records.DEPARTED_KEEP_S`) and not back since."""
        now_ms = self.board.now_ms()
        return [
            {
                "worker": w,
                "when_ms": d.ts_ms,
                "ago_s": round(max(0.0, now_ms - d.ts_ms) / 1000, 1),
                "why": d.why,
                "held": d.held,
            }
            for w, d in sorted(self.board.departures().items(), key=lambda kv: -kv[1].ts_ms)
            if w not in listed
        ][:DEPARTED_SHOWN]

    def _coordinators(self, models: list[str], samples: list[Sample]) -> list[dict[str, Any]]:
        tokens = increase(since(samples, 60.0), "kvq_tokens_total")
        pair = since(samples, 60.0)
        span = (pair[1].t - pair[0].t) if pair else 0.0
        out = []
        for m in models:
            for c in self.board.coordinators(m):
                stats = self.board.coord_stats(c.coord)
                remote = stats.remote_rows if stats else 0
                local = stats.local_rows if stats else 0
                grew = sum(v for lb, v in tokens.items() if dict(lb).get("coordinator") == c.coord)
                out.append(
                    {
                        "coordinator": c.coord,
                        "model": m,
                        "alive": c.alive,
                        "busy": c.state.busy if c.state else 0,
                        "slots": c.state.total if c.state else 0,
                        "tokens_per_s": round(grew / span, 2) if span > 0 else None,
                        "remote_share": round(remote / (remote + local), 3)
                        if remote + local
                        else 0.0,
                    }
                )
        return out

    def _deadletters(self, series: Series) -> dict[str, Any]:
        total = sum(v for _, v in pick(series, "kvq_deadletter_length"))
        newest = list_dead(self.board.r, self.board.keys, 5)
        return {
            "length": int(total),
            "newest": [{k: v for k, v in d.describe().items() if k != "fields"} for d in newest],
        }


def _worker_row(v: WorkerView) -> dict[str, Any]:
    return {
        "worker": v.worker_id,
        "slices": 0,
        "ranges": [],
        "held": [],
        "spans": [],
        "alive": v.alive,
        "ready": True,
        "state": "serving",
        "trust": "trusted",
        "ms_per_row": v.ms_per_row,
        "queued_rows": v.queued_rows,
        "load": v.load,
        "device": v.device,
        # what computes its products: a slow path ("float32 (no int8 kernel: ...)") shows here
        "kernels": v.kernels or "unknown",
        "heartbeat_age_s": None,
    }


def _natural(row: Mapping[str, Any]) -> list[tuple[int, str]]:
    """A worker id's sort key with its numbers as numbers (ds-2 before ds-10)."""
    return [
        (int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", str(row["worker"]))
    ]


def _worker_state(row: Mapping[str, Any], age: float | None, late_s: float) -> str:
    if age is None or not row["alive"]:
        return "lost"  # its heartbeat expired; the monitor reaps it at its next tick
    if age > late_s:
        return "late"
    return "serving" if row["ready"] else "loading"


# a stream's charts: metric -> (its name in the snapshot, how a row's series combine: the
# groups of one stream, or the inboxes of one model when they are many)
_CHARTS: dict[str, tuple[str, Callable[[float, float], float]]] = {
    "kvq_stream_length": ("stream_length", operator.add),
    "kvq_group_lag": ("group_lag", operator.add),
    "kvq_group_oldest_pending_age_seconds": ("group_oldest_pending_age_seconds", max),
}
_ROW_LABELS = ("stream", "model", "worker", "coordinator")
RowCache = dict[tuple[float, bool], dict[Labels, dict[str, float]]]
INBOXES_SHOWN = 8  # more inboxes than this: one row per model, summed (ages: the oldest)
STREAMS_SHOWN = 60


def stream_charts(samples: list[Sample], cache: RowCache | None = None) -> list[dict[str, Any]]:
    """Per stream (or per model's inboxes, when there are many): its depth, group lag and
    oldest pending age now, and as series. Each sample is read once (a model of thousands of
    slices puts thousands of other series beside the streams'), and once only across calls
    given a `cache` (the dashboard's: an hour of samples at every poll)."""
    if not samples:
        return []
    inboxes = {
        lb
        for (n, lb) in samples[-1].series
        if n == "kvq_stream_length" and dict(lb).get("stream") == "inbox"
    }
    merge = len(inboxes) > INBOXES_SHOWN
    per_sample = [_cached_values(s, merge, cache) for s in samples]
    rows = sorted(per_sample[-1])[:STREAMS_SHOWN]
    out = []
    for row in rows:
        label = dict(row)
        series = {
            chart: [
                [round(s.t, 1), got[row][chart]]
                for s, got in zip(samples, per_sample, strict=True)
                if chart in got.get(row, {})
            ]
            for chart, _ in _CHARTS.values()
        }
        name = label.get("stream", "?")
        for k in ("model", "worker", "coordinator"):
            if label.get(k):
                name += f" {label[k]}"
        if merge and label.get("stream") == "inbox":
            n = sum(1 for lb in inboxes if dict(lb).get("model", "") == label.get("model", ""))
            name += f" ({n} workers)"
        out.append({"stream": name, "labels": label, "series": series})
    return out


def _cached_values(
    sample: Sample, merge_inboxes: bool, cache: RowCache | None
) -> dict[Labels, dict[str, float]]:
    if cache is None:
        return _stream_values(sample, merge_inboxes)
    key = (sample.t, merge_inboxes)
    got = cache.get(key)
    if got is None:
        if len(cache) > 2 * MAX_SAMPLES:
            cache.clear()  # samples gone from the history: start again (bounded)
        got = cache[key] = _stream_values(sample, merge_inboxes)
    return got


def _stream_values(sample: Sample, merge_inboxes: bool) -> dict[Labels, dict[str, float]]:
    """Row (its labels) -> chart -> value, in one pass over the sample."""
    out: dict[Labels, dict[str, float]] = {}
    for (name, lb), v in sample.series.items():
        chart = _CHARTS.get(name)
        if chart is None:
            continue
        d = dict(lb)
        keep = _ROW_LABELS[:2] if merge_inboxes and d.get("stream") == "inbox" else _ROW_LABELS
        row = tuple((k, d[k]) for k in keep if d.get(k))
        got = out.setdefault(row, {})
        key, combine = chart
        got[key] = combine(got[key], v) if key in got else v
    return out
