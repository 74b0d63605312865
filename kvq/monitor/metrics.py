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

from kvq.bus.redis_board import RedisBoard
from kvq.keys import COORDINATOR_GROUP, WORKER_GROUP

_STREAM_LABELS = ["stream", "model", "worker", "coordinator"]


def _pending(r: redis.Redis, stream: str, group: str) -> int | None:
    """Entries delivered to `group` but not acknowledged; None if the group does not exist."""
    try:
        return int(r.xpending(stream, group)["pending"])
    except redis.ResponseError:  # NOGROUP: no consumer has read this stream yet
        return None


class RedisCollector(Collector):
    """Gauges computed from Redis at scrape time."""

    def __init__(self, board: RedisBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[GaugeMetricFamily]:
        board, r, k = self.board, self.board.r, self.board.keys
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
        for m in board.models():
            req = k.model_requests(m)
            length.add_metric(["requests", m, "", ""], r.xlen(req))
            if (n := _pending(r, req, COORDINATOR_GROUP)) is not None:
                pending.add_metric(["requests", m, "", ""], n)
            views = board.workers(m)
            for v in views:
                inbox = k.worker_inbox(v.worker_id)
                length.add_metric(["inbox", m, v.worker_id, ""], r.xlen(inbox))
                if (n := _pending(r, inbox, WORKER_GROUP)) is not None:
                    pending.add_metric(["inbox", m, v.worker_id, ""], n)
            for c in board.coordinators(m):
                length.add_metric(["results", m, "", c.coord], r.xlen(k.coord_results(c.coord)))
            state = board.model_state(m)
            saturated.add_metric([m], int(state is not None and state.saturated))
            for sid, d in board.slice_demand(m).items():
                demand.add_metric([m, sid], d.demand)
            alive.add_metric([m], sum(v.alive for v in views))
        dead = r.xlen(k.deadletter())
        length.add_metric(["deadletter", "", "", ""], dead)
        yield from (length, pending, saturated, demand, alive)
        yield GaugeMetricFamily("kvq_deadletter_length", "entries in the dead-letter stream", dead)


def make_registry(board: RedisBoard) -> CollectorRegistry:
    """A private registry (no process metrics of this Python) holding only the Redis gauges."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(board))
    return registry
