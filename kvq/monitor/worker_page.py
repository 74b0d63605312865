"""One worker's page (`GET /worker/{id}`, its data `GET /api/worker/{id}`): its `info` record
as it last beat, kernel path, the bytes of the slices it holds, jobs served, each model's
verdict on it now and every verdict before (`P:{m:M}:verdicts`: catches, operators' words),
when it departed, and its latency, load and queue over the range asked for (`?range=`), from
the monitor's sampled metrics (`kvq_worker_ms_per_row`, `kvq_worker_load`,
`kvq_worker_queued_rows`: `History`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec

from kvq.bus.redis_board import RedisBoard
from kvq.catalog import ModelInfo
from kvq.monitor.history import WINDOW_S, History, Sample, chart_range

HISTORY_SHOWN = 50  # verdicts per model, newest first

# chart -> (the metric, its unit)
CHARTS = {
    "ms_per_row": ("kvq_worker_ms_per_row", "ms per token row"),
    "load": ("kvq_worker_load", "share of the beat computing"),
    "queued_rows": ("kvq_worker_queued_rows", "token rows"),
}


def worker_page(
    board: RedisBoard, history: History, worker: str, range_s: float = WINDOW_S
) -> dict[str, Any] | None:
    """What the page draws, its charts over the last `range_s`; None for a worker the board
    knows nothing of."""
    models = board.models()
    held = {m: list(board.held_by(m, worker)) for m in models}
    held = {m: sids for m, sids in held.items() if sids}
    verdicts = {m: q for m in models if (q := board.quarantined(m).get(worker)) is not None}
    info = board.worker_info(worker)
    departed = board.departures().get(worker)
    if not held and not verdicts and info is None and departed is None:
        return None
    now_ms = board.now_ms()
    age = board.heartbeat_ages_s([worker]).get(worker)
    infos = {m: board.model_info(m) for m in held}
    return {
        "worker": worker,
        "alive": age is not None,
        "heartbeat_age_s": age,
        "info": msgspec.structs.asdict(info) if info is not None else None,
        "kernels": (info.kernels if info is not None else "") or "unknown",
        "served": info.served if info is not None else 0,
        "held": held,
        "held_bytes": _held_bytes(held, infos),
        "trust": [
            {"model": m, "active": q.active(now_ms), "drain": q.drain} | msgspec.structs.asdict(q)
            for m, q in sorted(verdicts.items())
        ],
        "history": [
            {"model": m} | msgspec.structs.asdict(q)
            for m in sorted(verdicts)
            for q in board.verdict_history(m, worker)[:HISTORY_SHOWN]
        ],
        "departed": msgspec.structs.asdict(departed) if departed is not None else None,
        "range": chart_range(_newest(history), range_s, history.keep_s),
        "charts": _charts(history.samples(range_s), worker),
    }


def _newest(history: History) -> float:
    got = history.samples(0.0)
    return got[-1].t if got else time.time()


def _held_bytes(held: Mapping[str, list[str]], infos: Mapping[str, ModelInfo | None]) -> int:
    total = 0
    for m, sids in held.items():
        info = infos.get(m)
        if info is not None:
            total += sum(info.slices[s].nbytes for s in sids if s in info.slices)
    return total


def _charts(samples: list[Sample], worker: str) -> dict[str, Any]:
    """Per chart its unit and, per model (the legend), [time s, value] of `worker` in each
    sample that has it: one pass over each sample (a large model's hold thousands of series)."""
    by_metric = {metric: name for name, (metric, _) in CHARTS.items()}
    series: dict[str, dict[str, list[list[float]]]] = {name: {} for name in CHARTS}
    for s in samples:
        for (metric, labels), v in s.series.items():
            name = by_metric.get(metric)
            if name is None:
                continue
            lb = dict(labels)
            if lb.get("worker") == worker:
                series[name].setdefault(lb.get("model", ""), []).append([round(s.t, 1), v])
    return {name: {"unit": unit, "series": series[name]} for name, (_, unit) in CHARTS.items()}
