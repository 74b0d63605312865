"""Where each slice runs: the swarm's `LiveRouter` fed with Redis state (K1-K4, H1-H7).

Every `dispatch_refresh_ms` the model's workers are reread (slice, heartbeat, `last_serve_ms`).
A worker whose heartbeat vanished is marked down first, so the router computes the rescue of
the route it was on (H8) before it re-plans without it. The coordinator's own load comes from
its slot poll (K2, K5). Routing itself is pure and fast; nothing here re-plans per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

import redis

from kvq.config import Settings
from kvq.keys import Keys
from kvq.registry import ModelInfo
from kvq.swarm import CostWeights, LivePolicy, LiveRoute, LiveRouter, WorkerView

log = logging.getLogger("kvq.coordinator")


def policy_from(settings: Settings) -> LivePolicy:
    s = settings
    weights = CostWeights(
        w_l=s.cost_w_latency, w_c=s.cost_w_load, w_k=s.cost_w_score,
        w_h=s.cost_w_hops, w_p=s.cost_w_tokens,
    )  # fmt: skip
    return LivePolicy(s.saturation_threshold, s.worker_grace_ms, s.swarm_ewma_alpha, weights)


class WorkerWatch:
    """Reads the model's workers from Redis: slice, heartbeat alive, last_serve_ms."""

    def __init__(self, r: redis.Redis, keys: Keys, model: str) -> None:
        self.r, self.keys, self.model = r, keys, model

    def read(self) -> list[WorkerView]:
        assigned = self.r.hgetall(self.keys.model_workers(self.model))
        workers = sorted((w.decode(), s.decode()) for w, s in assigned.items())
        if not workers:
            return []
        pipe = self.r.pipeline(transaction=False)
        for w, _ in workers:
            pipe.exists(self.keys.worker_heartbeat(w))
            pipe.hget(self.keys.worker_info(w), "last_serve_ms")
        got = pipe.execute()
        return [
            WorkerView(w, sid, alive=bool(got[2 * i]), last_serve_ms=int(got[2 * i + 1] or 0))
            for i, (w, sid) in enumerate(workers)
        ]


class SliceRouter:
    """The coordinator's routing state for one model."""

    def __init__(
        self, r: redis.Redis, keys: Keys, settings: Settings, coord_id: str,
        info: ModelInfo, slot_state: Callable[[], tuple[int, int]],
    ) -> None:  # fmt: skip
        sids = [
            s.sid
            for s in sorted(info.slices.values(), key=lambda s: (s.layer_start, s.expert_start))
        ]
        local = sids if settings.coordinator_experts == "all" else []
        self.router = LiveRouter(info.model, sids, coord_id, policy_from(settings), local)
        self.watch = WorkerWatch(r, keys, info.model)
        self.slot_state = slot_state
        self.refresh_s = settings.dispatch_refresh_ms / 1000
        self._at = float("-inf")
        self._alive: set[str] = set()
        self.rescues = 0

    def refresh(self, force: bool = False) -> None:
        """Reread workers if `dispatch_refresh_ms` has passed (or `force`)."""
        now = time.monotonic()
        if not force and now - self._at < self.refresh_s:
            return
        self._at = now
        views = self.watch.read()
        for v in views:
            if not v.alive and v.worker_id in self._alive:
                rescue = self.router.mark_down(v.worker_id)
                if rescue is not None:
                    self.rescues += 1
                    log.info("worker %s is down; rescue: %s", v.worker_id, rescue)
        self.router.update_workers(views, time.time() * 1000)
        self._alive = {v.worker_id for v in views if v.alive}

    def check(self) -> None:
        """Raises UncoveredSlice while some slice has no live node (requests are refused)."""
        self.refresh()
        self.router.check()

    def route(self, active: Collection[str]) -> LiveRoute:
        """Where each active slice of this MoE layer goes (raises UncoveredSlice)."""
        self.router.set_slots(*self.slot_state())
        self.refresh()
        return self.router.route(time.time() * 1000, active)

    def observe_result(self, worker: str, latency_ms: float) -> None:
        self.router.observe_result(worker, latency_ms)

    def observe_failure(self, worker: str, latency_ms: float | None) -> None:
        self.router.observe_failure(worker, latency_ms)
