"""The dashboard's coverage view at scale (`kvq.monitor.coverage`): slices as ranges, spans
aggregated, cells sent only for open spans of a large model, grey without a coordinator."""

from __future__ import annotations

import time
from typing import Any

from kvq.bus.records import SliceDemand, WorkerView
from kvq.monitor.coverage import SMALL, model_view, sid_ranges, slice_ranges, span_keys
from kvq.monitor.dashboard import stream_charts
from kvq.monitor.history import MAX_SAMPLES, Labels, Sample
from kvq.slices import SliceSpec, TensorRange, slice_id


def specs(layers: int, groups: int, per: int = 4) -> dict[str, SliceSpec]:
    """A slice table of `layers` x `groups` slices of `per` experts (no byte ranges)."""
    out = {}
    for layer in range(layers):
        for g in range(groups):
            sid = slice_id(layer, layer + 1, g * per, g * per + per)
            rng = TensorRange(f"blk.{layer}.ffn_gate_exps.weight", "gate", 0, 1, 0, (1,))
            out[sid] = SliceSpec(sid, layer, layer + 1, g * per, g * per + per, (rng,), ("0",))
    return out


def test_a_workers_slices_read_as_ranges() -> None:
    assert slice_ranges([(3, 4, 0, 4), (3, 4, 4, 8), (4, 5, 0, 4), (4, 5, 4, 8)]) == ["L3-4 E0-7"]
    assert slice_ranges([(0, 1, 0, 4), (0, 1, 8, 12), (2, 3, 0, 4)]) == [
        "L0 E0-3,E8-11",
        "L2 E0-3",
    ]
    every = specs(58, 64)  # DeepSeek-V3's MoE layers at 4 experts a slice: 3,712 slices
    assert sid_ranges(every) == ["L0-57 E0-255"]
    assert sid_ranges(["not-a-slice", slice_id(1, 2, 0, 4)]) == ["L1 E0-3"]
    assert span_keys("m", [slice_id(5, 6, 0, 4), slice_id(5, 6, 4, 8), slice_id(2, 3, 0, 4)]) == [
        "m:2",
        "m:5",
    ]


def test_spans_aggregate_and_only_open_spans_carry_cells() -> None:
    table = specs(58, 64)
    assert len(table) == 3712 > SMALL
    demand = {sid: SliceDemand(1, 1) for sid in table}
    lost = [sid for sid in table if table[sid].layer_start == 7][:5]
    views = [WorkerView("w1", sid, alive=sid not in lost) for sid in table]
    t0 = time.perf_counter()
    v = model_view(table, demand, views, barred=set(), coordinators=1, open_spans={7})
    took = time.perf_counter() - t0
    assert took < 2.0, f"{took:.2f}s for 3,712 slices"
    assert v["slices"] == 3712 and len(v["spans"]) == 58
    assert v["totals"] == {"none": 5, "under": 0, "ok": 3707, "idle": 0}
    seven = next(s for s in v["spans"] if s["layers"] == [7, 8])
    assert seven["state"] == "none" and seven["none"] == 5 and seven["open"]
    assert len(seven["cells"]) == 64 and len(v["cells"]) == 64, "cells of the open span only"
    assert all(s["cells"] == [] for s in v["spans"] if s["layers"] != [7, 8])


def test_no_live_coordinator_turns_coverage_grey() -> None:
    table = specs(2, 2)
    demand = {sid: SliceDemand(1, 1) for sid in table}
    views = [WorkerView("w1", sid) for sid in table]
    served = model_view(table, demand, views, set(), coordinators=1)
    idle = model_view(table, demand, views, set(), coordinators=0)
    assert {c["state"] for c in served["cells"]} == {"ok"} and served["serving"]
    assert {c["state"] for c in idle["cells"]} == {"idle"} and not idle["serving"]
    assert {s["state"] for s in idle["spans"]} == {"idle"}
    gone = model_view(table, demand, [], set(), coordinators=0)
    assert {c["state"] for c in gone["cells"]} == {"none"}, "an uncovered slice stays red"


def test_stream_charts_read_each_sample_once_and_merge_many_inboxes() -> None:
    """Ten minutes of samples (120) of a model with 3,712 slices (7,424 slice series) and 32
    worker inboxes: the charts in well under a second, the inboxes one row."""
    slices = {
        ("kvq_slice_live_workers", (("model", "m"), ("slice", f"s{i}"))): 1.0 for i in range(3712)
    }
    slices |= {("kvq_slice_target", (("model", "m"), ("slice", f"s{i}"))): 1.0 for i in range(3712)}

    def stream(name: str, stream: str, worker: str, v: float) -> tuple[tuple[str, Labels], float]:
        lb = (("coordinator", ""), ("model", "m"), ("stream", stream), ("worker", worker))
        return (name, lb), v

    samples = []
    for t in range(120):
        series = dict(slices)
        for w in range(32):
            for name in ("kvq_stream_length", "kvq_group_lag"):
                k, v = stream(name, "inbox", f"w{w}", 1.0)
                series[k] = v
            k, v = stream("kvq_group_oldest_pending_age_seconds", "inbox", f"w{w}", float(w))
            series[k] = v
        k, v = stream("kvq_stream_length", "requests", "", 3.0)
        series[k] = v
        samples.append(Sample(float(t * 5), series))
    t0 = time.perf_counter()
    rows = stream_charts(samples)
    took = time.perf_counter() - t0
    assert took < 1.5, f"{took:.2f}s"
    by = {r["stream"]: r for r in rows}
    assert set(by) == {"inbox m (32 workers)", "requests m"}
    inbox = by["inbox m (32 workers)"]["series"]
    assert inbox["stream_length"][-1] == [595.0, 32.0], "depths summed"
    assert inbox["group_oldest_pending_age_seconds"][-1] == [595.0, 31.0], "the oldest age"
    assert len(inbox["group_lag"]) == 120


def test_stream_charts_with_a_cache_read_each_sample_once_across_polls() -> None:
    """The dashboard's hour of samples at every poll: with its cache, a sample already read is
    not read again, the charts are the same, and the cache stays bounded."""

    def sample(t: float) -> Sample:
        lb = (("model", "m"), ("stream", "requests"))
        return Sample(t, {("kvq_stream_length", lb): t, ("kvq_group_lag", lb): 1.0})

    samples = [sample(float(t * 5)) for t in range(400)]
    cache: dict[tuple[float, bool], Any] = {}
    assert stream_charts(samples, cache) == stream_charts(samples)
    assert len(cache) == 400
    cache_before = dict(cache)
    more = [*samples[1:], sample(2000.0)]
    got = stream_charts(more, cache)
    read = [k for k in cache if k not in cache_before]
    assert read == [(2000.0, False)], "only the new sample is read"
    assert got == stream_charts(more)
    for t in range(2005, 2005 + 5 * 2 * MAX_SAMPLES, 5):
        stream_charts([sample(float(t))], cache)
    assert len(cache) <= 2 * MAX_SAMPLES + 1
