"""Prometheus metrics of a kvq deployment, read from Redis on every scrape (D7, K13).

Nothing is counted in-process: each scrape reads stream lengths, pending counts, saturation,
demand and liveness straight from the keys of `kvq.keys`, so any monitor replica (or a restarted
one) reports the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvq.keys import COORDINATOR_GROUP, WORKER_GROUP, Keys
from kvq.registry import list_models

_STREAM_LABELS = ["stream", "model", "worker", "coordinator"]


def slice_demand(r: redis.Redis, keys: Keys, model: str) -> dict[str, tuple[int, int]]:
    """Slice id → (target, coverage) of `model`, sorted by slice id."""
    target = {k.decode(): int(v) for k, v in r.hgetall(keys.model_target(model)).items()}
    cover = {k.decode(): int(v) for k, v in r.hgetall(keys.model_coverage(model)).items()}
    return {sid: (target[sid], cover.get(sid, 0)) for sid in sorted(target)}


def _pending(r: redis.Redis, stream: str, group: str) -> int | None:
    """Entries delivered to `group` but not acknowledged; None if the group does not exist."""
    try:
        return int(r.xpending(stream, group)["pending"])
    except redis.ResponseError:  # NOGROUP: no consumer has read this stream yet
        return None


class RedisCollector(Collector):
    """Gauges computed from Redis at scrape time."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    def collect(self) -> Iterator[GaugeMetricFamily]:
        r, k = self.r, self.keys
        length = GaugeMetricFamily(
            "kvq_stream_length", "entries in a kvq stream (XLEN)", labels=_STREAM_LABELS
        )
        pending = GaugeMetricFamily(
            "kvq_group_pending",
            "entries delivered to a consumer group but not acknowledged (XPENDING)",
            labels=_STREAM_LABELS,
        )
        saturated = GaugeMetricFamily(
            "kvq_model_saturated", "1 while the monitor sees the model saturated", labels=["model"]
        )
        demand = GaugeMetricFamily(
            "kvq_slice_demand", "replicas wanted beyond coverage", labels=["model", "slice"]
        )
        alive = GaugeMetricFamily(
            "kvq_workers_alive", "workers holding a slice with a live heartbeat", labels=["model"]
        )
        for m in list_models(r, k):
            req = k.model_requests(m)
            length.add_metric(["requests", m, "", ""], r.xlen(req))
            if (n := _pending(r, req, COORDINATOR_GROUP)) is not None:
                pending.add_metric(["requests", m, "", ""], n)
            workers = sorted(w.decode() for w in r.hkeys(k.model_workers(m)))
            live = 0
            for w in workers:
                inbox = k.worker_inbox(w)
                length.add_metric(["inbox", m, w, ""], r.xlen(inbox))
                if (n := _pending(r, inbox, WORKER_GROUP)) is not None:
                    pending.add_metric(["inbox", m, w, ""], n)
                live += int(r.exists(k.worker_heartbeat(w)))
            for c in sorted(c.decode() for c in r.smembers(k.model_coordinators(m))):
                length.add_metric(["results", m, "", c], r.xlen(k.coord_results(c)))
            saturated.add_metric([m], int(r.hget(k.model_state(m), "saturated") or 0))
            for sid, (want, cov) in slice_demand(r, k, m).items():
                demand.add_metric([m, sid], max(0, want - cov))
            alive.add_metric([m], live)
        dead = r.xlen(k.deadletter())
        length.add_metric(["deadletter", "", "", ""], dead)
        yield from (length, pending, saturated, demand, alive)
        yield GaugeMetricFamily("kvq_deadletter_length", "entries in the dead-letter stream", dead)


def make_registry(r: redis.Redis, keys: Keys) -> CollectorRegistry:
    """A private registry (no process metrics of this Python) holding only the Redis gauges."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(r, keys))
    return registry
