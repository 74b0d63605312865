"""Prometheus metrics of a kvq deployment, read from Redis on every scrape (D7, K13, X5).

Nothing is counted in the monitor: each scrape reads the keys of `kvq.keys`, so any monitor
replica (or a restarted one) reports the same numbers.
- queues: stream lengths, and per consumer group lag, pending, the oldest pending and unread
  entries' ages, per consumer pending and idle (`kvq.bus.groups`);
- the market: slices, target, coverage and live workers per layer span (series grow with a
  model's layers, not its slices), live coordinators per model;
- trust: workers quarantined or banned by a coordinator's spot-check, and their mismatches;
- counters and histograms that each coordinator counts in process and publishes in its stats
  record at every slot poll (`kvq.monitor.coord_metrics`).
`docs/api.md` lists every metric; `docs/alerts.yml` alerts on them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvq.bus.groups import GroupStats, group_stats, merged, server_ms
from kvq.bus.peers import is_peer_fault
from kvq.bus.records import ModelState, Quarantine, SliceDemand, WorkerView
from kvq.bus.redis_board import RedisBoard
from kvq.keys import COORDINATOR_GROUP, WORKER_GROUP, request_streams
from kvq.monitor.coord_metrics import CoordMetrics

_STREAM_LABELS = ["stream", "model", "worker", "coordinator"]
_CONSUMER_LABELS = ["stream", "model", "worker", "consumer"]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class _Queues:
    """The stream and consumer-group families of one scrape."""

    def __init__(self) -> None:
        self.length = _gauge("kvq_stream_length", "entries in a kvq stream (XLEN)", _STREAM_LABELS)
        self.pending = _gauge(
            "kvq_group_pending",
            "entries delivered to the consumer group but not acknowledged",
            _STREAM_LABELS,
        )
        self.lag = _gauge(
            "kvq_group_lag",
            "entries no consumer of the group has read yet (XINFO GROUPS lag)",
            _STREAM_LABELS,
        )
        self.oldest_pending = _gauge(
            "kvq_group_oldest_pending_age_seconds",
            "age of the oldest delivered, unacknowledged entry (0 when none)",
            _STREAM_LABELS,
        )
        self.oldest_unread = _gauge(
            "kvq_group_oldest_unread_age_seconds",
            "age of the oldest entry no consumer has read (0 when none)",
            _STREAM_LABELS,
        )
        self.c_pending = _gauge(
            "kvq_consumer_pending", "entries pending under one consumer", _CONSUMER_LABELS
        )
        self.c_idle = _gauge(
            "kvq_consumer_idle_seconds",
            "since the consumer's last read or claim",
            _CONSUMER_LABELS,
        )

    def add(self, labels: list[str], g: GroupStats) -> None:
        self.length.add_metric(labels, g.length)
        self.lag.add_metric(labels, g.lag)
        self.oldest_unread.add_metric(labels, g.oldest_unread_age_s or 0.0)
        if not g.exists:
            return
        self.pending.add_metric(labels, g.pending)
        self.oldest_pending.add_metric(labels, g.oldest_pending_age_s or 0.0)
        for c in g.consumers:
            self.c_pending.add_metric([*labels[:3], c.name], c.pending)
            self.c_idle.add_metric([*labels[:3], c.name], c.idle_s)

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            self.length,
            self.pending,
            self.lag,
            self.oldest_pending,
            self.oldest_unread,
            self.c_pending,
            self.c_idle,
        )


class _Trust:
    """Per worker a coordinator caught: quarantined now, banned, mismatches so far."""

    def __init__(self) -> None:
        labels = ["model", "worker"]
        self.quarantined = _gauge(
            "kvq_worker_quarantined",
            "1 while the worker is quarantined or banned for a wrong result (P:{m:M}:quarantine)",
            labels,
        )
        self.banned = _gauge("kvq_worker_banned", "1 when the worker id is banned", labels)
        self.mismatches = _gauge(
            "kvq_worker_mismatches", "wrong results caught from the worker so far", labels
        )
        self.count = _gauge(
            "kvq_workers_quarantined", "workers quarantined or banned now", ["model"]
        )

    def add(self, model: str, verdicts: Mapping[str, Quarantine], now_ms: float) -> None:
        for w, q in verdicts.items():
            self.quarantined.add_metric([model, w], int(q.active(now_ms)))
            self.banned.add_metric([model, w], int(q.banned))
            self.mismatches.add_metric([model, w], q.mismatches)
        self.count.add_metric([model], sum(q.active(now_ms) for q in verdicts.values()))

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        return (self.quarantined, self.banned, self.mismatches, self.count)


class _Market:
    """Per model and slice: saturation, demand and coverage, live workers and coordinators."""

    def __init__(self) -> None:
        span = ["model", "layers"]  # per layer span (`L003-004`): series grow with layers only
        self.saturated = _gauge("kvq_model_saturated", "1 while the model is saturated", ["model"])
        self.span_slices = _gauge("kvq_span_slices", "slices of the layer span", span)
        self.demand = _gauge("kvq_span_demand", "replicas wanted beyond coverage, summed", span)
        self.target = _gauge("kvq_span_target", "replicas wanted, summed over its slices", span)
        self.coverage = _gauge(
            "kvq_span_coverage", "workers holding each slice, summed over its slices", span
        )
        self.live = _gauge(
            "kvq_span_live_replicas",
            "serving workers with a live heartbeat of each slice, summed over its slices",
            span,
        )
        self.uncovered = _gauge(
            "kvq_span_uncovered_slices",
            "wanted slices (target > 0) of the span that no live serving worker holds",
            span,
        )
        self.no_live = _gauge(
            "kvq_slices_without_live_worker", "slices no live serving worker holds", ["model"]
        )
        self.alive = _gauge(
            "kvq_workers_alive", "workers holding a slice with a live heartbeat", ["model"]
        )
        self.kernels = _gauge(
            "kvq_workers_by_kernels",
            "live workers of the model by what computes their products (e.g. `int8 avx512 "
            "(installed)`, `float32 (no int8 kernel: ...)`): a slow path shows here",
            ["model", "kernels"],
        )
        per_worker = ["model", "worker"]
        self.ms_per_row = _gauge(
            "kvq_worker_ms_per_row",
            "a live worker's own compute time per token row over its last beat (0: no job)",
            per_worker,
        )
        self.load = _gauge(
            "kvq_worker_load", "share of a live worker's last beat spent computing", per_worker
        )
        self.queued = _gauge(
            "kvq_worker_queued_rows", "token rows a live worker computes or has waiting", per_worker
        )
        self.coords = _gauge(
            "kvq_coordinators_alive", "coordinators with fresh slot state", ["model"]
        )
        self.orphaned = _gauge(
            "kvq_requests_orphaned",
            "requests pending under a consumer that is no live coordinator",
            ["model"],
        )

    def add_coordinators(self, model: str, up: set[str], requests: GroupStats) -> None:
        self.coords.add_metric([model], len(up))
        orphaned = sum(c.pending for c in requests.consumers if c.name not in up)
        self.orphaned.add_metric([model], orphaned)

    def add_slices(
        self,
        model: str,
        state: ModelState | None,
        views: list[WorkerView],
        slices: Mapping[str, SliceDemand],
    ) -> None:
        self.saturated.add_metric([model], int(state is not None and state.saturated))
        serving: dict[str, int] = {}
        for v in views:
            if v.alive and v.ready:
                serving[v.slice_id] = serving.get(v.slice_id, 0) + 1
        self._add_spans(model, slices, serving)
        self.no_live.add_metric([model], sum(1 for sid in slices if not serving.get(sid)))
        self.alive.add_metric([model], len({v.worker_id for v in views if v.alive}))
        by_kernels: dict[str, set[str]] = {}
        seen: set[str] = set()
        for v in views:
            if v.alive:
                by_kernels.setdefault(v.kernels or "unknown", set()).add(v.worker_id)
            if v.alive and v.worker_id not in seen:  # one view per slice: one sample a worker
                seen.add(v.worker_id)
                self.ms_per_row.add_metric([model, v.worker_id], v.ms_per_row)
                self.load.add_metric([model, v.worker_id], v.load or 0.0)
                self.queued.add_metric([model, v.worker_id], v.queued_rows)
        for path, workers in sorted(by_kernels.items()):
            self.kernels.add_metric([model, path], len(workers))

    def _add_spans(
        self, model: str, slices: Mapping[str, SliceDemand], serving: Mapping[str, int]
    ) -> None:
        """The per-slice numbers summed per layer span (the slice id's `L...-...` part)."""
        spans: dict[str, list[int]] = {}  # layers -> [slices, demand, target, coverage, ...]
        for sid, d in slices.items():
            live = serving.get(sid, 0)
            row = spans.setdefault(sid.split(":", 1)[0], [0] * 6)
            for i, n in enumerate((1, d.demand, d.target, d.coverage, live)):
                row[i] += n
            row[5] += int(live == 0 and d.target > 0)
        families = (self.span_slices, self.demand, self.target, self.coverage, self.live)
        for layers, row in sorted(spans.items()):
            for fam, n in zip((*families, self.uncovered), row, strict=True):
                fam.add_metric([model, layers], n)

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            self.saturated,
            self.span_slices,
            self.demand,
            self.target,
            self.coverage,
            self.live,
            self.uncovered,
            self.no_live,
            self.alive,
            self.kernels,
            self.ms_per_row,
            self.load,
            self.queued,
            self.coords,
            self.orphaned,
        )


class RedisCollector(Collector):
    """Every kvq metric, computed from Redis at scrape time."""

    def __init__(self, board: RedisBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        r, k = self.board.r, self.board.keys
        now_ms = server_ms(r)
        q, market, per_coord, trust = _Queues(), _Market(), CoordMetrics(), _Trust()
        for m in self.board.models():
            trust.add(m, self.board.quarantined(m), now_ms)
            self._collect_model(m, now_ms, q, market, per_coord)
        dead = r.xlen(k.deadletter())
        q.length.add_metric(["deadletter", "", "", ""], dead)
        yield from q.families()
        yield from market.families()
        yield GaugeMetricFamily("kvq_deadletter_length", "entries in the dead-letter stream", dead)
        yield CounterMetricFamily(
            "kvq_deadletter_added",
            "entries ever added to the dead-letter stream (survives trimming)",
            _entries_added(r, k.deadletter()),
        )
        yield from per_coord.families()
        yield from trust.families()
        yield refusing_writes(r)

    def _collect_model(
        self, m: str, now_ms: int, q: _Queues, market: _Market, per_coord: CoordMetrics
    ) -> None:
        """One model's queues, coordinators and slices, added to the scrape's families."""
        board, r, k = self.board, self.board.r, self.board.keys
        shards = request_streams(k, m, board.shard_count(m))
        g = merged([group_stats(r, s, COORDINATOR_GROUP, now_ms) for s in shards])
        q.add(["requests", m, "", ""], g)
        views = board.workers(m)  # one per (worker, slice)
        ids = sorted({v.worker_id for v in views})
        for w in ids:
            inbox = group_stats(r, k.worker_inbox(w), WORKER_GROUP, now_ms)
            q.add(["inbox", m, w, ""], inbox)
        cviews = board.coordinators(m)
        up = {c.coord for c in cviews if c.alive}
        for c in cviews:
            # results wait in one stream per (worker, coordinator)
            waiting = _lengths(r, [k.worker_results(w, c.coord) for w in ids])
            q.length.add_metric(["results", m, "", c.coord], waiting)
            stats = board.coord_stats(c.coord)
            if stats is not None:
                per_coord.add(m, c.coord, stats)
        market.add_coordinators(m, up, g)
        market.add_slices(m, board.model_state(m), views, board.slice_demand(m))


REFUSAL_REASONS = ("misconf", "oom", "readonly", "loading")
OOM_SHARE = 0.95  # used memory over this share of `maxmemory` under `noeviction` counts as full


def refusal_reasons(info: Mapping[str, object]) -> set[str]:
    """Why a Redis with this `INFO` (persistence, memory, replication sections) refuses writes
    now: `misconf` (its last RDB save or AOF write failed: a full or broken disk), `oom` (at
    `maxmemory` under `noeviction`, within OOM_SHARE), `readonly` (a replica), `loading`."""
    out = set()
    if "err" in (info.get("rdb_last_bgsave_status"), info.get("aof_last_write_status")):
        out.add("misconf")
    limit = _int(info.get("maxmemory"))
    if limit and info.get("maxmemory_policy") == "noeviction":
        if _int(info.get("used_memory")) >= OOM_SHARE * limit:
            out.add("oom")
    if info.get("role") == "slave":
        out.add("readonly")
    if _int(info.get("loading")):
        out.add("loading")
    return out


def _int(v: object) -> int:
    return int(v) if isinstance(v, int | str) and str(v).isdigit() else 0


def refusing_writes(r: redis.Redis) -> GaugeMetricFamily:
    """`kvq_redis_refusing_writes{reason}`: 1 while Redis refuses writes for that reason (the
    roles wait it out, clients' requests fail at once: docs/faults.md), from its `INFO`."""
    g = _gauge(
        "kvq_redis_refusing_writes",
        "1 while Redis refuses writes for this reason "
        "(misconf: disk, oom: maxmemory under noeviction, readonly, loading)",
        ["reason"],
    )
    nodes: dict[str, dict[str, object]] = {}
    for section in ("persistence", "memory", "replication"):
        got = r.info(section)
        # a cluster client answers per node: {node: {field: value}}
        per_node = got if got and all(isinstance(v, dict) for v in got.values()) else {"": got}
        for node, fields in per_node.items():
            nodes.setdefault(node, {}).update(fields)
    why = set().union(*(refusal_reasons(i) for i in nodes.values()))
    for reason in REFUSAL_REASONS:
        g.add_metric([reason], int(reason in why))
    return g


def _lengths(r: redis.Redis, streams: list[str]) -> int:
    """Entries in `streams`, in one round trip; a key a worker made another type counts 0."""
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
    got = pipe.execute(raise_on_error=False)
    for reply in got:
        if isinstance(reply, Exception) and not is_peer_fault(reply):
            raise reply
    return sum(int(n) for n in got if not isinstance(n, Exception))


def _entries_added(r: redis.Redis, stream: str) -> int:
    try:
        return int(r.xinfo_stream(stream)["entries-added"])
    except redis.ResponseError:  # no such key: nothing was ever dead-lettered
        return 0


def make_registry(board: RedisBoard) -> CollectorRegistry:
    """A private registry (no process metrics of this Python) holding only kvq's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(board))
    return registry
