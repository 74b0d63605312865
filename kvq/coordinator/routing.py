"""Where each slice runs: the swarm's `LiveRouter` fed with Redis state (K1-K4, H1-H7).

Every `dispatch_refresh_ms` the model's workers are reread (slice, heartbeat, `last_serve_ms`),
with the model's quarantine verdicts: a quarantined or banned worker is left out of routing
altogether (no copy, no trial, no probe) until its quarantine ends, and so is one an operator
drains (its results still count). A worker whose heartbeat
vanished is marked down first, so the router computes the rescue of the route it was on (H8)
before it re-plans without it. The coordinator's own load comes from
its slot poll (K2, K5). Routing itself is pure and fast; nothing here re-plans per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from kvq.bus.board import Board
from kvq.catalog import ModelInfo
from kvq.config import RoutingSettings
from kvq.coordinator.capacity import Capacity
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.machine import cpus, cpus_text, machine_id
from kvq.swarm import CostWeights, LivePolicy, LiveRoute, LiveRouter, WorkerView

CAPACITY_ROUTE = -2  # LiveRoute.pipeline_id of a capacity split
_LOG_EVERY_S = 10.0  # how often a split and its estimates are logged

log = logging.getLogger("kvq.coordinator")


def policy_from(s: RoutingSettings) -> LivePolicy:
    weights = CostWeights(
        w_l=s.w_latency, w_c=s.w_load, w_k=s.w_score, w_h=s.w_hops, w_p=s.w_tokens
    )
    return LivePolicy(
        s.saturation_threshold,
        s.worker_grace_ms,
        s.ewma_alpha,
        weights,
        s.reprobe_ms,
        s.half_life_ms,
    )


class SliceRouter:
    """The coordinator's routing state for one model, fed from the board's worker views."""

    def __init__(
        self,
        board: Board,
        settings: RoutingSettings,
        coord_id: str,
        info: ModelInfo,
        trust: Trust | None = None,
        compute_threads: int = 0,
    ) -> None:
        sids = [
            s.sid
            for s in sorted(info.slices.values(), key=lambda s: (s.layer_start, s.expert_start))
        ]
        local = sids if settings.local_experts else []
        self.router = LiveRouter(info.model, sids, coord_id, policy_from(settings), local)
        self.capacity = Capacity(coord_id, settings.ewma_alpha)
        self.split = settings.policy == "capacity"
        self.reprobe_s = settings.reprobe_ms / 1000
        self._split_at: dict[str, float] = {}  # worker -> when a split last gave it a slice
        self._split_probing: set[str] = set()  # probed by a split; its next sample replaces
        self.split_probes = 0
        # a CPU worker on this machine adds no cores while this coordinator computes on all of
        # its CPUs: its share of a layer would run in turn with ours, not beside it
        self.machine, self.cpus = machine_id(), cpus()
        self.compute_threads = compute_threads
        self.uses_all_cores = compute_threads >= len(self.cpus)
        self.sharing: set[str] = set()  # such workers: no share of a split (they still serve
        # copies, trials and the slices this coordinator does not hold)
        self._logged_at = float("-inf")
        self._logged_nodes: frozenset[str] = frozenset()
        self.coord = coord_id
        self.board, self.model = board, info.model
        self.refresh_s = settings.refresh_ms / 1000
        self._at = float("-inf")
        self._alive: set[str] = set()
        self.holders: dict[str, frozenset[str]] = {}  # worker -> the slices it serves (ready)
        self._failing: set[str] = set()  # a job failed or missed since its last good result
        self.rescues = 0  # workers lost while in use (docs/streams.md, `stats`)
        self.trust = trust if trust is not None else Trust(TrustPolicy(), coord_id)

    def refresh(self, force: bool = False) -> None:
        """Reread workers if `dispatch_refresh_ms` has passed (or `force`)."""
        now = time.monotonic()
        if not force and now - self._at < self.refresh_s:
            return
        self._at = now
        # a worker still downloading its slice is alive but not routable yet; a quarantined
        # one is left out altogether (it comes back as a new, unproven worker)
        records = self.board.quarantined(self.model)
        for worker, verdict in self.trust.lost(records).items():
            log.warning("redis lost the quarantine of worker %s; recorded it again", worker)
            self.board.quarantine(self.model, worker, verdict)
        self.trust.merge(records)
        ready = [v for v in self.board.workers(self.model) if v.ready]
        barred = {v.worker_id for v in ready if self.trust.idle(v.worker_id)}
        views = [v for v in ready if v.worker_id not in barred]
        listed = {v.worker_id for v in views}
        # dead since the last read, or already reaped by the monitor (no longer listed); a
        # barred worker is not lost, it is dropped
        down = {v.worker_id for v in views if not v.alive} | (self._alive - listed - barred)
        for worker in self._alive - listed:
            self.capacity.forget(worker)
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
        for v in views:
            self.capacity.set_backlog(v.worker_id, self._backlog_ms(v))
        holders: dict[str, set[str]] = {}
        for v in views:  # one view per (worker, slice): a worker may serve several
            holders.setdefault(v.worker_id, set()).add(v.slice_id)
        self.holders = {w: frozenset(sids) for w, sids in holders.items()}
        sharing = {v.worker_id for v in views if self.shares_cores(v)}
        for worker in sorted(sharing - self.sharing):
            log.info(
                "worker %s computes on this machine's CPUs, all of which this coordinator "
                "uses (%d compute threads, CPUs %s): it gets no share of a capacity split "
                "(docs/routing.md)",
                worker,
                self.compute_threads,
                cpus_text(self.cpus),
            )
        self.sharing = sharing

    def shares_cores(self, v: WorkerView) -> bool:
        """Whether `v` computes on CPUs this coordinator keeps busy: a CPU worker on this
        machine (same boot id) whose CPUs overlap ours (or are unknown) while this
        coordinator's compute threads cover all of its CPUs."""
        if not self.uses_all_cores or not self.machine or v.machine != self.machine:
            return False
        return v.device in ("", "cpu") and (not v.cpus or bool(v.cpus & self.cpus))

    def _backlog_ms(self, v: WorkerView) -> float:
        """How long the rows other coordinators have queued on `v` delay work sent to it now
        : its last beat's rows less this coordinator's own, at the worker's
        reported ms per row (or this coordinator's estimate of it). Its measured overhead
        already holds the queueing it saw; this adds what its last results could not show."""
        own = dict(v.queued_by).get(self.coord, 0)
        rows = max(0, v.queued_rows - own)
        if not rows:
            return 0.0
        per_row = v.ms_per_row or self.capacity.compute_ms(v.worker_id, rows) / rows
        return rows * per_row

    def live_holders(self, sid: str) -> list[str]:
        """The live, unbarred workers that serve slice `sid` (as of the last refresh)."""
        return sorted(
            w
            for w, sids in self.holders.items()
            if sid in sids and w in self._alive and not self.trust.idle(w)
        )

    def bar(self, worker: str) -> None:
        """`worker` was just caught: reread coverage before the next route (it is left out)."""
        self._at = float("-inf")
        self._failing.discard(worker)

    def check(self) -> None:
        """Raises UncoveredSlice while some slice has no live node (requests are refused)."""
        self.refresh()
        self.router.check()

    def route(self, rows: Mapping[str, int], busy: int, total: int) -> LiveRoute:
        """Where each active slice of this MoE layer goes (`rows`: token rows per active
        slice), under the coordinator's load (`busy` of `total` slots); raises UncoveredSlice.

        At rest, and for K4 trials and re-probes, the router's copy decides. Under load with
        `KVQ_DISPATCH_POLICY=capacity`, the active slices are split over the coordinator and
        the eligible workers so that the layer finishes soonest (`capacity.assign`)."""
        self.router.set_slots(busy, total)
        self.refresh()
        route = self.router.route(time.time() * 1000, rows.keys())
        if route.trial is not None:  # a K4 trial or the router's re-probe: it measures
            self._split_probing.add(route.trial)
            self._split_at[route.trial] = time.monotonic()
        if not self.split or not self.router.loaded or route.trial is not None:
            return route
        candidates = {}
        for sid in rows:
            local = (self.coord,) if self.router.holds_locally(sid) else ()
            others = tuple(w for w in self.router.eligible(sid) if w not in self.sharing)
            candidates[sid] = local + others
            if not candidates[sid]:  # nothing eligible: keep what the copy chose
                candidates[sid] = (route.worker(sid) or self.coord,)
        split = self.capacity.assign(rows, candidates)
        now = time.monotonic()
        probed = self._probe_idle(split, rows, candidates, now)
        # at most every _LOG_EVERY_S: at info when the nodes that get a share changed since the
        # last line (local only <-> with workers), else at debug; a steady split is not news (it
        # was 12 of a coordinator's 13 lines). Each layer's slices differ: nodes are compared
        nodes = frozenset(split.values())
        changed = nodes != self._logged_nodes
        if now - self._logged_at >= _LOG_EVERY_S and (changed or log.isEnabledFor(logging.DEBUG)):
            self._logged_at, self._logged_nodes = now, nodes
            log.log(
                logging.INFO if changed else logging.DEBUG,
                "capacity split %s of rows %s; estimates %s",
                split,
                dict(rows),
                self.capacity.describe(),
            )
        return LiveRoute(
            CAPACITY_ROUTE,
            {sid: node for sid, node in split.items() if node != self.coord},
            trial=probed,
        )

    def _probe_idle(
        self,
        split: dict[str, str],
        rows: Mapping[str, int],
        candidates: Mapping[str, tuple[str, ...]],
        now: float,
    ) -> str | None:
        """K4 under the split: an eligible worker that no split has given a slice for
        `reprobe_ms` gets one (its least-loaded active slice); at most one such worker per
        layer call, which it returns. Its estimates only move when it gets work, so without
        this one slow sample (a busy moment on a shared machine) would price it out for as
        long as the load lasts; the probe's sample replaces them. The route names it as its
        `trial`: where this coordinator holds the slice too, the layer computes it here as
        well and does not wait for the probe, so a worker not worth its round trip costs no
        layer that round trip."""
        given = set(split.values())
        for node in given:
            self._split_at[node] = now
        for sid in sorted(rows, key=lambda s: (rows[s], s)):
            for node in candidates[sid]:
                if node == self.coord or node in given:
                    continue
                wait = self.router.backoff.wait(node, self.reprobe_s)
                if now - self._split_at.setdefault(node, now) < wait:
                    continue
                split[sid] = node
                self._split_at[node] = now
                self._split_probing.add(node)
                self.split_probes += 1  # beside the router's own (`router.probes`)
                return node
        return None

    def observe_local(self, rows: int, ms: float) -> None:
        self.capacity.observe_local(rows, ms)

    @property
    def replans(self) -> int:
        return self.router.replans

    def observe_result(
        self,
        worker: str,
        latency_ms: float,
        rows: int = 0,
        compute_ms: float = 0.0,
        verified: bool = False,
    ) -> None:
        """A result arrived; `verified`: recomputed here and equal (it proves the worker)."""
        self._failing.discard(worker)
        self.router.observe_result(worker, latency_ms, verified)
        if worker in self._split_probing and rows > 0:
            self._split_probing.discard(worker)
            self.capacity.reset(worker)  # a probe refreshes a stale estimate, not nudges it
            self.router.backoff.probed(worker, latency_ms)  # and its next jobs are held to it
        self.capacity.observe_remote(worker, rows, latency_ms, compute_ms)

    def observe_failure(self, worker: str, latency_ms: float | None) -> None:
        self._failing.add(worker)
        self.router.observe_failure(worker, latency_ms)
