"""Where each slice runs: the swarm's `LiveRouter` fed with Redis state (K1-K4, H1-H7).

Every `dispatch_refresh_ms` the model's workers are reread (slice, heartbeat, `last_serve_ms`).
A worker whose heartbeat vanished is marked down first, so the router computes the rescue of
the route it was on (H8) before it re-plans without it. The coordinator's own load comes from
its slot poll (K2, K5). Routing itself is pure and fast; nothing here re-plans per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from kvq.bus.board import Board
from kvq.config import RoutingSettings
from kvq.model.registry import ModelInfo
from kvq.swarm import CostWeights, LivePolicy, LiveRoute, LiveRouter

log = logging.getLogger("kvq.coordinator")


def policy_from(s: RoutingSettings) -> LivePolicy:
    weights = CostWeights(
        w_l=s.w_latency, w_c=s.w_load, w_k=s.w_score, w_h=s.w_hops, w_p=s.w_tokens
    )
    return LivePolicy(
        s.saturation_threshold, s.worker_grace_ms, s.ewma_alpha, weights, s.reprobe_ms,
        s.half_life_ms,
    )  # fmt: skip


class SliceRouter:
    """The coordinator's routing state for one model, fed from the board's worker views."""

    def __init__(
        self, board: Board, settings: RoutingSettings, coord_id: str, info: ModelInfo
    ) -> None:
        sids = [
            s.sid
            for s in sorted(info.slices.values(), key=lambda s: (s.layer_start, s.expert_start))
        ]
        local = sids if settings.local_experts else []
        self.router = LiveRouter(info.model, sids, coord_id, policy_from(settings), local)
        self.board, self.model = board, info.model
        self.refresh_s = settings.refresh_ms / 1000
        self._at = float("-inf")
        self._alive: set[str] = set()
        self._failing: set[str] = set()  # a job failed or missed since its last good result
        self.rescues = 0  # workers lost while in use (docs/streams.md, `stats`)

    def refresh(self, force: bool = False) -> None:
        """Reread workers if `dispatch_refresh_ms` has passed (or `force`)."""
        now = time.monotonic()
        if not force and now - self._at < self.refresh_s:
            return
        self._at = now
        # a worker still downloading its slice is alive but not routable yet
        views = [v for v in self.board.workers(self.model) if v.ready]
        listed = {v.worker_id for v in views}
        # dead since the last read, or already reaped by the monitor (no longer listed)
        down = {v.worker_id for v in views if not v.alive} | (self._alive - listed)
        for worker in sorted(down & self._alive):
            # on the route now, or priced off it by the misses its death caused (the jobs were
            # recomputed here): either way it was lost while in use
            rescue = self.router.mark_down(worker)
            if rescue is not None or worker in self._failing:
                self.rescues += 1
                log.info("worker %s is down; rescue: %s", worker, rescue or "local fallback")
        self._failing -= down
        self.router.update_workers(views, time.time() * 1000)
        self._alive = {v.worker_id for v in views if v.alive}

    def check(self) -> None:
        """Raises UncoveredSlice while some slice has no live node (requests are refused)."""
        self.refresh()
        self.router.check()

    def route(self, active: Collection[str], busy: int, total: int) -> LiveRoute:
        """Where each active slice of this MoE layer goes, under the coordinator's load
        (`busy` of `total` slots); raises UncoveredSlice."""
        self.router.set_slots(busy, total)
        self.refresh()
        return self.router.route(time.time() * 1000, active)

    @property
    def replans(self) -> int:
        return self.router.replans

    def observe_result(self, worker: str, latency_ms: float) -> None:
        self._failing.discard(worker)
        self.router.observe_result(worker, latency_ms)

    def observe_failure(self, worker: str, latency_ms: float | None) -> None:
        self._failing.add(worker)
        self.router.observe_failure(worker, latency_ms)
