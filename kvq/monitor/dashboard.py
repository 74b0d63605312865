"""What the monitor's live dashboard (`GET /`, `kvq/monitor/static/`) shows, as one JSON
snapshot (`GET /api/dashboard`): each model's coverage (totals, per layer span, and the cells of
the spans asked for: `kvq.monitor.coverage`), workers (their slices as a count and ranges;
serving, late or lost), the workers reaped in the last hour with when and why, coordinators, every stream's depth, lag and pending age over the
last minutes, dead letters, and the alert rules of `docs/alerts.yml` whose condition holds now.

Everything is read from Redis: the board for coverage, workers and trust, and the monitor's own
Prometheus registry (the numbers `/metrics` exports) for streams, coordinators and alerts. The
registry is sampled every `SAMPLE_S` on a background thread into `History`, so charts, rates
and the `increase(...)` of an alert see the last `WINDOW_S` however often the page polls.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from kvq.bus.deadletters import list_dead
from kvq.bus.records import WorkerView
from kvq.bus.redis_board import RedisBoard
from kvq.catalog import ModelInfo
from kvq.monitor.alerts import holding
from kvq.monitor.coverage import model_view, sid_ranges, span_keys
from kvq.monitor.history import (
    History,
    Labels,
    Sample,
    Series,
    increase,
    pick,
    read_registry,
    since,
)

HELD_SHOWN = 32  # slice ids listed per worker (its count and ranges say the rest)
DEPARTED_SHOWN = 50


class Dashboard:
    """The snapshot the page draws."""

    def __init__(self, board: RedisBoard, registry: CollectorRegistry) -> None:
        self.board = board
        self.history = History(lambda: read_registry(registry))

    def snapshot(self, open_spans: Mapping[str, Collection[int]] | None = None) -> dict[str, Any]:
        """`open_spans`: model → the layer starts whose cells to send (a large model's spans
        come as counts only)."""
        now = self.history.latest(max_age_s=2.0)
        samples = self.history.samples()
        models = self.board.models()
        infos = {m: self.board.model_info(m) for m in models}
        listed = self._workers(models, infos)
        return {
            "ts": now.t,
            "models": [self._model(m, infos[m], (open_spans or {}).get(m, ())) for m in models],
            "workers": listed,
            "departed": self._departed({w["worker"] for w in listed}),
            "coordinators": self._coordinators(models, samples),
            "streams": _streams(samples),
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
            key=lambda r: (rank.get(str(r["state"]), 3), r["trust"] == "trusted", str(r["worker"])),
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
        "heartbeat_age_s": None,
    }


def _worker_state(row: Mapping[str, Any], age: float | None, late_s: float) -> str:
    if age is None or not row["alive"]:
        return "lost"  # its heartbeat expired; the monitor reaps it at its next tick
    if age > late_s:
        return "late"
    return "serving" if row["ready"] else "loading"


def _streams(samples: list[Sample]) -> list[dict[str, Any]]:
    """Per stream: its depth, group lag and oldest pending age now, and as series."""
    if not samples:
        return []
    names = ("kvq_stream_length", "kvq_group_lag", "kvq_group_oldest_pending_age_seconds")
    keys = sorted({lb for (n, lb) in samples[-1].series if n == names[0]})[:60]
    out = []
    for lb in keys:
        label = dict(lb)
        series = {}
        for n in names:
            per = [(s.t, _sum_group(s.series, n, lb)) for s in samples]
            series[n.removeprefix("kvq_")] = [[round(t, 1), v] for t, v in per if v is not None]
        name = label.get("stream", "?")
        for k in ("model", "worker", "coordinator"):
            if label.get(k):
                name += f" {label[k]}"
        out.append({"stream": name, "labels": label, "series": series})
    return out


def _sum_group(series: Series, name: str, lb: Labels) -> float | None:
    """The value of `name` for a stream's labels (groups of one stream summed)."""
    want = dict(lb)
    got = [
        v for labels, v in pick(series, name) if all(labels.get(k) == x for k, x in want.items())
    ]
    return sum(got) if got else None
