"""`/metrics` on a real Redis: lag, pending, ages, consumers, coverage, coordinators, counters
and histograms published by coordinators (X5, issue 12 item 12)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from shapes import deepseek_v3_record

from kvq.bus import dead_letter
from kvq.bus.histogram import Histogram
from kvq.bus.records import CoordStats, SlotState, WorkerInfo
from kvq.config import Settings
from kvq.keys import COORDINATOR_GROUP, WORKER_GROUP, request_streams
from kvq.monitor import Monitor
from kvq.monitor.alerts import holding
from kvq.monitor.history import Sample
from kvq.monitor.metrics import make_registry
from kvq.tools.synth import make_tiny

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
SLICES = 4  # 2 layers x 2 groups of 4 experts


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("metrics") / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    return path


@pytest.fixture
def mon(settings: Settings, model: Path) -> Monitor:
    m = Monitor.from_settings(settings.model_copy(update={"slice_experts": 4}))
    m.register("m", model)
    return m


def scrape(mon: Monitor) -> Samples:
    text = generate_latest(make_registry(mon.board)).decode()  # type: ignore[arg-type]
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if v))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


REQ = (("model", "m"), ("stream", "requests"))


def test_request_lag_counts_what_no_coordinator_has_read(mon: Monitor, r: redis.Redis) -> None:
    req = mon.board.keys.model_requests("m")
    for i in range(5):
        r.xadd(req, {"i": i})
    before = scrape(mon)
    assert before["kvq_group_lag", REQ] == 5, "no group yet: every request is unread"
    assert ("kvq_group_pending", REQ) not in before
    r.xgroup_create(req, COORDINATOR_GROUP, id="0")
    r.xreadgroup(COORDINATOR_GROUP, "c1", {req: ">"}, count=2)
    time.sleep(0.05)  # the entries age (their ages are asserted)
    got = scrape(mon)
    assert got["kvq_group_lag", REQ] == 3
    assert got["kvq_group_pending", REQ] == 2
    assert got["kvq_group_oldest_pending_age_seconds", REQ] >= 0.04
    assert got["kvq_group_oldest_unread_age_seconds", REQ] >= 0.04
    c1 = (("consumer", "c1"), ("model", "m"), ("stream", "requests"))
    assert got["kvq_consumer_pending", c1] == 2
    assert got["kvq_consumer_idle_seconds", c1] >= 0.04
    # c1 publishes no slot state: its two requests have nobody to finish them
    assert got["kvq_requests_orphaned", (("model", "m"),)] == 2
    assert got["kvq_coordinators_alive", (("model", "m"),)] == 0


def test_request_metrics_add_up_every_shard(
    settings: Settings, model: Path, r: redis.Redis
) -> None:
    """Issue 14: a model with 3 request shards shows one `requests` series per metric, the sum
    (and the oldest age) over its shards; a consumer's pending entries add up too."""
    mon = Monitor.from_settings(settings.model_copy(update={"request_shards": 3}))
    mon.register("m", model)
    shards = request_streams(mon.board.keys, "m", 3)
    for n, stream in zip((2, 0, 4), shards, strict=True):
        for i in range(n):
            r.xadd(stream, {"i": i})
    for stream in shards:
        r.xgroup_create(stream, COORDINATOR_GROUP, id="0", mkstream=True)
    r.xreadgroup(COORDINATOR_GROUP, "c1", {shards[0]: ">"}, count=1)
    r.xreadgroup(COORDINATOR_GROUP, "c1", {shards[2]: ">"}, count=2)
    time.sleep(0.05)  # the entries age (their ages are asserted)
    got = scrape(mon)
    assert got["kvq_stream_length", REQ] == 6
    assert got["kvq_group_lag", REQ] == 3
    assert got["kvq_group_pending", REQ] == 3
    c1 = (("consumer", "c1"), ("model", "m"), ("stream", "requests"))
    assert got["kvq_consumer_pending", c1] == 3
    assert got["kvq_requests_orphaned", (("model", "m"),)] == 3
    assert got["kvq_group_oldest_unread_age_seconds", REQ] >= 0.04


def test_answered_requests_leave_no_lag_or_age(mon: Monitor, r: redis.Redis) -> None:
    req = mon.board.keys.model_requests("m")
    r.xgroup_create(req, COORDINATOR_GROUP, id="0", mkstream=True)
    ids = [r.xadd(req, {"i": i}) for i in range(3)]
    r.xreadgroup(COORDINATOR_GROUP, "c1", {req: ">"}, count=3)
    for eid in ids:  # what a coordinator does with each answered request
        r.xack(req, COORDINATOR_GROUP, eid)
        r.xdel(req, eid)
    ts = int(time.time() * 1000)
    mon.board.publish_slots("c1", SlotState(model="m", busy=0, total=4, ts_ms=ts), CoordStats())
    got = scrape(mon)
    assert got["kvq_group_lag", REQ] == 0
    assert got["kvq_group_pending", REQ] == 0
    assert got["kvq_group_oldest_pending_age_seconds", REQ] == 0
    assert got["kvq_group_oldest_unread_age_seconds", REQ] == 0
    assert got["kvq_coordinators_alive", (("model", "m"),)] == 1
    assert got["kvq_requests_orphaned", (("model", "m"),)] == 0


def test_inbox_lag_and_per_span_coverage(mon: Monitor, r: redis.Redis) -> None:
    board = mon.board
    sid = board.volunteer("m", "w0")
    assert sid is not None
    board.beat("w0", WorkerInfo(model="m", slice=sid, device="cpu"))
    board.volunteer("m", "w1")  # holds a slice but never beats: not live
    inbox = board.keys.worker_inbox("w0")
    r.xgroup_create(inbox, WORKER_GROUP, id="0", mkstream=True)
    board.send_jobs([("w0", {"i": str(i)}) for i in range(4)])
    got = scrape(mon)
    w0 = (("model", "m"), ("stream", "inbox"), ("worker", "w0"))
    assert got["kvq_group_lag", w0] == 4
    assert got["kvq_group_pending", w0] == 0
    live = {k[1]: v for k, v in got.items() if k[0] == "kvq_span_live_replicas"}
    assert len(live) == 2 and sum(live.values()) == 1, "2 layer spans of 2 slices"
    assert live[(("layers", sid.split(":")[0]), ("model", "m"))] == 1
    cover = {k[1]: v for k, v in got.items() if k[0] == "kvq_span_coverage"}
    assert sum(cover.values()) == 2
    assert got["kvq_slices_without_live_worker", (("model", "m"),)] == SLICES - 1
    uncovered = {k[1]: v for k, v in got.items() if k[0] == "kvq_span_uncovered_slices"}
    assert sum(uncovered.values()) == SLICES - 1
    assert got["kvq_span_target", (("layers", sid.split(":")[0]), ("model", "m"))] == 2


def test_coordinator_counters_and_histograms(mon: Monitor) -> None:
    rtt = Histogram()
    for s in (0.002, 0.003, 0.2):
        rtt.observe(s)
    stats = CoordStats(
        local_jobs=7,
        remote_jobs=3,
        fallback_jobs=2,
        remote_errors=1,
        tokens=40,
        finishes='{"eos": 2, "length": 3, "error": 1}',
        job_rtt_s=rtt.to_text(),
        verified=5,
        mismatches=1,
        nonfinite_results=2,
        barred_results=4,
        quarantines=2,
        remote_rows=100,
        verified_rows=20,
        local_expert_s=1.5,
        remote_wait_s=0.25,
        remote_send_s=0.125,
        local_rows=300,
    )
    ts = int(time.time() * 1000)
    mon.board.publish_slots("c1", SlotState(model="m", busy=1, total=4, ts_ms=ts), stats)
    got = scrape(mon)
    c = (("coordinator", "c1"), ("model", "m"))
    jobs = {dict(k[1])["kind"]: v for k, v in got.items() if k[0] == "kvq_jobs_total"}
    assert jobs == {"local": 7, "remote": 3, "fallback": 2, "error": 1}
    assert got["kvq_tokens_total", c] == 40
    fin = {dict(k[1])["finish"]: v for k, v in got.items() if k[0] == "kvq_requests_total"}
    assert fin == {"eos": 2, "length": 3, "context": 0, "error": 1}
    assert got["kvq_job_round_trip_seconds_count", c] == 3
    assert got["kvq_job_round_trip_seconds_bucket", (*c[:1], ("le", "0.005"), c[1])] == 2
    assert got["kvq_job_round_trip_seconds_bucket", (*c[:1], ("le", "+Inf"), c[1])] == 3
    assert got["kvq_job_round_trip_seconds_sum", c] == pytest.approx(0.205)
    assert got["kvq_time_to_first_token_seconds_count", c] == 0
    trust = {
        name: got[f"kvq_{name}_total", c]
        for name in (
            "results_verified",
            "result_mismatches",
            "results_nonfinite",
            "results_barred",
            "quarantines",
            "remote_rows",
            "verified_rows",
        )
    }
    assert trust == {
        "results_verified": 5,
        "result_mismatches": 1,
        "results_nonfinite": 2,
        "results_barred": 4,
        "quarantines": 2,
        "remote_rows": 100,
        "verified_rows": 20,
    }
    assert got["kvq_local_expert_seconds_total", c] == 1.5
    assert got["kvq_remote_wait_seconds_total", c] == 0.25
    assert got["kvq_remote_send_seconds_total", c] == 0.125
    assert got["kvq_local_rows_total", c] == 300


def test_dead_letters_are_counted_past_the_trim(mon: Monitor, r: redis.Redis) -> None:
    k = mon.board.keys
    assert scrape(mon)["kvq_deadletter_added_total", ()] == 0
    for i in range(3):
        eid = r.xadd(k.model_requests("m"), {"junk": i})
        dead_letter(r, k, k.model_requests("m"), eid, {b"junk": b"x"}, "bad", 100)
    r.xtrim(
        k.deadletter(), maxlen=1, approximate=False
    )  # a full dead-letter stream stays at its cap
    got = scrape(mon)
    assert got["kvq_deadletter_length", ()] == 1
    assert got["kvq_deadletter_added_total", ()] == 3


def test_histogram_text_round_trip() -> None:
    h = Histogram()
    for s in (0.0005, 0.001, 0.07, 100.0):
        h.observe(s)
    back = Histogram.from_text(h.to_text())
    assert back is not None and back.count == 4
    assert back.cumulative()[:2] == [("0.001", 2), ("0.0025", 2)]
    assert back.cumulative()[-1] == ("+Inf", 4)
    assert Histogram.from_text("") is None and Histogram.from_text("{") is None


def test_a_worker_holding_several_slices_is_one_worker_with_one_inbox(
    mon: Monitor, r: redis.Redis
) -> None:
    board = mon.board
    held: list[str] = []
    for _ in range(3):
        sid = board.volunteer("m", "w0", None, held)
        assert sid is not None
        held.append(sid)
    board.beat(
        "w0", WorkerInfo(model="m", slice=held[-1], device="cpu", holds=json.dumps({"m": held}))
    )
    r.xgroup_create(board.keys.worker_inbox("w0"), WORKER_GROUP, id="0", mkstream=True)
    board.send_jobs([("w0", {"i": "0"})])
    got = scrape(mon)
    assert got["kvq_workers_alive", (("model", "m"),)] == 1, "distinct workers"
    live = {k[1]: v for k, v in got.items() if k[0] == "kvq_span_live_replicas"}
    assert sum(live.values()) == len(held)
    text = generate_latest(make_registry(board)).decode()  # type: ignore[arg-type]
    lag = [ln for ln in text.splitlines() if ln.startswith("kvq_group_lag{") and "w0" in ln]
    assert len(lag) == 1 and lag[0].endswith(" 1.0"), lag


def test_live_workers_are_counted_by_what_computes_their_products(
    mon: Monitor, r: redis.Redis
) -> None:
    board = mon.board
    paths = {"w0": "int8 avx512 (installed)", "w1": "int8 avx512 (installed)", "w2": ""}
    paths["w3"] = "float32 (no int8 kernel: none installed, no compiler)"
    for w, kernels in paths.items():
        sid = board.volunteer("m", w, None, [])
        assert sid is not None
        board.beat(w, WorkerInfo(model="m", slice=sid, device="cpu", kernels=kernels))
    got = scrape(mon)
    by = {dict(k[1])["kernels"]: v for k, v in got.items() if k[0] == "kvq_workers_by_kernels"}
    assert by == {"int8 avx512 (installed)": 2, paths["w3"]: 1, "unknown": 1}


def test_series_stay_bounded_at_deepseek_v3_scale(settings: Settings, tmp_path: Path) -> None:
    """3,712 slices (DeepSeek-V3 at 4 experts a slice) held by 32 workers, one of them lost:
    the market's series are per layer span (58), not per slice, and still say how many wanted
    slices have no live worker, per span and per model."""
    tiny = tmp_path / "tiny.gguf"
    make_tiny(tiny, layers=2, experts=8)
    mon = Monitor.from_settings(settings)
    board = mon.board
    info = deepseek_v3_record(tiny)
    board.register_model(info, 1)
    held: dict[str, list[str]] = {}
    for w in range(32):  # uncovered slices first, smallest id first: w0 takes layers 3-4
        mine = held.setdefault(f"w{w}", [])
        while len(mine) < 116 and (sid := board.volunteer("dsv3", f"w{w}", None, mine)):
            mine.append(sid)
    for w, mine in list(held.items())[1:]:  # w0 is lost: it holds its slices and does not beat
        holds = json.dumps({"dsv3": mine})
        board.beat(w, WorkerInfo(model="dsv3", slice=mine[-1], device="cpu", holds=holds))
    got = scrape(mon)
    print(f"DeepSeek-V3 shape, 32 workers: {len(got)} kvq series in a scrape")
    names = {name for name, _ in got}
    assert not {n for n in names if n.startswith("kvq_slice_")}, "no series per slice"
    per = {n: sum(1 for name, _ in got if name == n) for n in names}
    assert per["kvq_span_slices"] == per["kvq_span_uncovered_slices"] == 58
    span = {(n, dict(lb)["layers"]): v for (n, lb), v in got.items() if n.startswith("kvq_span_")}
    assert span["kvq_span_uncovered_slices", "L003-004"] == 64, "w0 held all of layer 3"
    assert span["kvq_span_uncovered_slices", "L004-005"] == 116 - 64
    assert span["kvq_span_live_replicas", "L004-005"] == 64 - 52
    assert span["kvq_span_live_replicas", "L005-006"] == 64
    assert span["kvq_span_slices", "L003-004"] == span["kvq_span_target", "L003-004"] == 64
    assert span["kvq_span_coverage", "L003-004"] == 64, "w0 still holds them"
    assert got["kvq_slices_without_live_worker", (("model", "dsv3"),)] == 116
    fired = [a for a in holding([Sample(0.0, got)]) if a["alert"] == "KvqSliceWithoutLiveWorker"]
    assert [(a["labels"], a["value"]) for a in fired] == [({"model": "dsv3"}, 116)], fired
    assert len(got) < 1000, per
