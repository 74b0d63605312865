"""What the monitor's live dashboard (`GET /`, `kvq/monitor/static/`) shows, as one JSON
snapshot (`GET /api/dashboard`): each model's coverage grid (layers x slices, live replicas,
quarantined holders), workers, coordinators, every stream's depth, lag and pending age over the
last minutes, dead letters, and the alert rules of `docs/alerts.yml` whose condition holds now.

Everything is read from Redis: the board for coverage, workers and trust, and the monitor's own
Prometheus registry (the numbers `/metrics` exports) for streams, coordinators and alerts. The
registry is sampled every `SAMPLE_S` on a background thread into `History`, so charts, rates
and the `increase(...)` of an alert see the last `WINDOW_S` however often the page polls.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from kvq.bus.deadletters import list_dead
from kvq.bus.redis_board import RedisBoard
from kvq.monitor.alerts import holding
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


class Dashboard:
    """The snapshot the page draws."""

    def __init__(self, board: RedisBoard, registry: CollectorRegistry) -> None:
        self.board = board
        self.history = History(lambda: read_registry(registry))

    def snapshot(self) -> dict[str, Any]:

        now = self.history.latest(max_age_s=2.0)
        samples = self.history.samples()
        models = self.board.models()
        return {
            "ts": now.t,
            "models": [self._model(m) for m in models],
            "workers": self._workers(models),
            "coordinators": self._coordinators(models, samples),
            "streams": _streams(samples),
            "deadletters": self._deadletters(now.series),
            "alerts": holding(samples),
        }

    def _model(self, model: str) -> dict[str, Any]:
        info = self.board.model_info(model)
        demand = self.board.slice_demand(model)
        views = self.board.workers(model)
        now_ms = self.board.now_ms()
        barred = {w for w, q in self.board.quarantined(model).items() if q.active(now_ms)}
        cells = []
        for sid, spec in sorted(
            (info.slices if info else {}).items(),
            key=lambda kv: (kv[1].layer_start, kv[1].expert_start),
        ):
            holders = [
                {
                    "worker": v.worker_id,
                    "alive": v.alive,
                    "ready": v.ready,
                    "quarantined": v.worker_id in barred,
                }
                for v in views
                if v.slice_id == sid
            ]
            live = sum(1 for h in holders if h["alive"] and h["ready"] and not h["quarantined"])
            d = demand.get(sid)
            cells.append(
                {
                    "slice": sid,
                    "layers": [spec.layer_start, spec.layer_end],
                    "experts": [spec.expert_start, spec.expert_end],
                    "live": live,
                    "target": d.target if d else 0,
                    "holders": holders,
                    "quarantined": any(h["quarantined"] for h in holders),
                }
            )
        meta = info.meta if info else None
        return {
            "model": model,
            "cells": cells,
            "layers": meta.block_count if meta else 0,
            "experts": meta.expert_count if meta else 0,
        }

    def _workers(self, models: list[str]) -> list[dict[str, Any]]:
        now_ms = self.board.now_ms()
        rows: dict[str, dict[str, Any]] = {}
        for m in models:
            trust = self.board.quarantined(m)
            for v in self.board.workers(m):
                row = rows.setdefault(
                    v.worker_id,
                    {
                        "worker": v.worker_id,
                        "slices": [],
                        "alive": v.alive,
                        "trust": "trusted",
                        "ms_per_row": v.ms_per_row,
                        "queued_rows": v.queued_rows,
                        "load": v.load,
                        "device": v.device,
                        "heartbeat_age_s": None,
                    },
                )
                row["slices"].append(f"{m}/{v.slice_id}")
                q = trust.get(v.worker_id)
                if q is not None and q.active(now_ms):
                    row["trust"] = "banned" if q.banned else "quarantined"
        for w, age in self.board.heartbeat_ages_s(list(rows)).items():
            rows[w]["heartbeat_age_s"] = age
        return sorted(rows.values(), key=lambda r: str(r["worker"]))

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
