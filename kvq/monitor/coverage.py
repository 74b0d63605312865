"""The dashboard's coverage view, readable at thousands of slices (DeepSeek-V3: 3,712 of 4
experts): per model, totals and one row per layer span (how many slices are covered, short of
their target, without a live holder), the cells of a span only when it is open (a small model's
always are); a worker's slices as a count and ranges (`L3-10 E0-255`).

A cell's state: `ok` (live replicas >= target), `under` (some, fewer than wanted), `none` (no
live replica), `idle` in place of `ok` while no coordinator of the model is alive (the slices
are held, nothing is served).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from kvq.bus.records import SliceDemand, WorkerView
from kvq.slices import SliceSpec, parse_slice_id

SMALL = 64  # a model of at most this many slices: every span open
STATES = ("none", "under", "ok", "idle")  # worst first


def cell_state(live: int, target: int, serving: bool) -> str:
    if live == 0:
        return "none" if target > 0 else ("ok" if serving else "idle")
    if live < target:
        return "under"
    return "ok" if serving else "idle"


def model_view(
    specs: Mapping[str, SliceSpec],
    demand: Mapping[str, SliceDemand],
    views: Sequence[WorkerView],
    barred: Collection[str],
    coordinators: int,
    open_spans: Collection[int] = (),
) -> dict[str, Any]:
    """Totals, spans and the open spans' cells of one model (`open_spans`: layer starts)."""
    serving = coordinators > 0
    by_slice: dict[str, list[WorkerView]] = defaultdict(list)
    for v in views:
        by_slice[v.slice_id].append(v)
    spans: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for sid, spec in sorted(specs.items(), key=lambda kv: (kv[1].layer_start, kv[1].expert_start)):
        d = demand.get(sid)
        cell = _cell(spec, d.target if d else 0, by_slice.get(sid, []), barred, serving)
        spans[(spec.layer_start, spec.layer_end)].append(cell)
    every_open = len(specs) <= SMALL
    rows = [
        _span(span, cells, every_open or span[0] in open_spans) for span, cells in spans.items()
    ]
    totals = {s: sum(r[s] for r in rows) for s in STATES}
    return {
        "serving": serving,
        "coordinators": coordinators,
        "slices": len(specs),
        "totals": totals,
        "quarantined": sum(r["quarantined"] for r in rows),
        "spans": rows,
        "cells": [c for r in rows for c in r["cells"]],
    }


def _cell(
    spec: SliceSpec, target: int, views: list[WorkerView], barred: Collection[str], serving: bool
) -> dict[str, Any]:
    holders = [
        {
            "worker": v.worker_id,
            "alive": v.alive,
            "ready": v.ready,
            "quarantined": v.worker_id in barred,
        }
        for v in views
    ]
    live = sum(1 for h in holders if h["alive"] and h["ready"] and not h["quarantined"])
    return {
        "slice": spec.sid,
        "layers": [spec.layer_start, spec.layer_end],
        "experts": [spec.expert_start, spec.expert_end],
        "live": live,
        "target": target,
        "state": cell_state(live, target, serving),
        "holders": holders,
        "quarantined": any(h["quarantined"] for h in holders),
    }


def _span(span: tuple[int, int], cells: list[dict[str, Any]], is_open: bool) -> dict[str, Any]:
    counts = {s: sum(1 for c in cells if c["state"] == s) for s in STATES}
    worst = next(s for s in STATES if counts[s]) if cells else "ok"
    return {
        "layers": list(span),
        "slices": len(cells),
        **counts,
        "state": worst,
        "quarantined": sum(1 for c in cells if c["quarantined"]),
        "open": is_open,
        "cells": cells if is_open else [],
    }


def sid_ranges(sids: Iterable[str]) -> list[str]:
    """`slice_ranges` of slice ids (an id that is none is left out)."""
    bounds = []
    for sid in sids:
        try:
            bounds.append(parse_slice_id(sid))
        except ValueError:
            continue
    return slice_ranges(bounds)


def slice_ranges(bounds: Iterable[tuple[int, int, int, int]]) -> list[str]:
    """Slices as ranges: each layer span's experts merged where they touch, then consecutive
    spans with the same expert ranges merged (`L0-2 E0-15`: layers 0-2, experts 0-15; ends
    inclusive)."""
    experts: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for ls, le, es, ee in sorted(bounds):
        got = experts[(ls, le)]
        if got and got[-1][1] >= es:
            got[-1] = (got[-1][0], max(got[-1][1], ee))
        else:
            got.append((es, ee))
    merged: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    for (ls, le), ex in sorted(experts.items()):
        if merged and merged[-1][1] == ls and merged[-1][2] == tuple(ex):
            merged[-1] = (merged[-1][0], le, merged[-1][2])
        else:
            merged.append((ls, le, tuple(ex)))
    return [
        f"L{_span_text(ls, le)} " + ",".join(f"E{es}-{ee - 1}" for es, ee in ex)
        for ls, le, ex in merged
    ]


def _span_text(start: int, end: int) -> str:
    return f"{start}" if end - start == 1 else f"{start}-{end - 1}"


def span_keys(model: str, sids: Iterable[str]) -> list[str]:
    """`model:first layer` of every layer span `sids` touch (the page's drill-down keys)."""
    starts = set()
    for sid in sids:
        try:
            starts.add(parse_slice_id(sid)[0])
        except ValueError:
            continue
    return [f"{model}:{s}" for s in sorted(starts)]
