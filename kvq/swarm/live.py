"""Live dispatch through the swarm (K1-K4 with H1-H6): one `LiveRouter` per served model.

The nodes are the coordinator and the workers covering the model's slices. Copies (re-planned
only when coverage changes, never per request):
- copy 0: every slice on the coordinator (where it holds the slice; elsewhere the first worker);
- copy k >= 1: slice `i` on its k-th proven worker (cycling when it has fewer), else local.
Proven (K3) = a result of it that this coordinator recomputed and found equal (verified,
`observe_result(..., verified=True)`). A worker's own `last_serve_ms` decides nothing: it only
makes an untried worker worth a re-probe (whose answer is checked). A slice the coordinator does
not hold may also use unproven workers, since nothing else can serve it.

Cost decides (H3). A node's latency is what reaching it adds: 0 for the coordinator, the
measured send-to-result time for a worker. The coordinator's score is 1 and a worker's is the EWMA
of its successes (<= 1). The coordinator's load is 0 at rest and 1 under load
(`busy >= saturation_threshold`, K2). So at rest a remote slice never costs less than a local one
and the all-local copy (pipeline 0, which wins ties) always wins (K1); under load a local slice
costs 120 more, and copies of proven workers win unless they are slow (K3). Unproven workers
are in no copy (K4); under load each one still gets one first try while
`now - first_seen < grace_ms`: `route` returns a trial route that sends it its slice once.

Re-probes: a worker's latency only moves when it gets work, so one slow sample (a cold cache,
a busy moment) would price it out for good. Under load, a live worker that the chosen copy does
not use and that has had no job for `reprobe_ms` gets one: `route` returns a probe route
sending it its slice once, and the sample it brings back replaces its latency estimate. A worker
that got faster wins work back within about `reprobe_ms` plus one refresh; a slow one costs one
slow layer call per `reprobe_ms` per worker. An unproven worker whose grace window passed
without load (it joined, then the machine idled) is probed too, from `reprobe_ms` after it was
first seen: a probe, like a trial, is computed here as well and never waited for, and only its
checked answer proves the worker (K4: it is not recruited before that).

Threading: `set_slots` may be called from the slot-poll thread (it only stores two ints, applied
by the next `route`); every other method belongs to the dispatch thread.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvq.bus.records import WorkerView
from kvq.errors import RoutingError, UncoveredSlice, Unrecoverable
from kvq.swarm.plan import SwarmPlan
from kvq.swarm.probes import ProbeBackoff
from kvq.swarm.route import failover_in_swarm
from kvq.swarm.state import SwarmState
from kvq.swarm.swarm import Rescue
from kvq.swarm.telemetry import NodeTelemetry
from kvq.swarm.types import CostWeights, FailoverOptions, ModelSpec, NodeProfile, Pipeline, Slice

_NO_DEGRADE = FailoverOptions(allow_degraded=False)
ELIGIBLE_SCORE = 0.5  # success EWMA below which a worker gets no share of a capacity split


@dataclass(frozen=True, slots=True)
class LivePolicy:
    """K2 threshold, K4 grace window, EWMA weight, H3 weights, re-probe interval."""

    saturation_threshold: int = 2
    grace_ms: float = 10_000.0
    alpha: float = 0.3
    weights: CostWeights = field(default_factory=CostWeights)
    reprobe_ms: float = 5_000.0  # under load, an unused live worker gets one job this often
    half_life_ms: float = 60_000.0  # a worker's latency estimate halves its gap to the prior


@dataclass(frozen=True, slots=True)
class LiveRoute:
    """Where each slice goes: `remote[sid]` is a worker id; a slice not in it is local."""

    pipeline_id: int  # -1 for a K4 trial route or a re-probe
    remote: dict[str, str]
    trial: str | None = None  # the worker this route tries (K4) or re-probes

    def worker(self, sid: str) -> str | None:
        return self.remote.get(sid)


class LiveRouter:
    """Swarm routing for one model served by one coordinator (pure; fed by the caller)."""

    def __init__(
        self,
        model_id: str,
        slices: Sequence[str],
        coordinator: str,
        policy: LivePolicy | None = None,
        local_slices: Collection[str] | None = None,
    ) -> None:
        self.model_id, self.coordinator = model_id, coordinator
        self.policy = policy or LivePolicy()
        self.spec = ModelSpec(model_id, tuple(Slice(s) for s in slices))
        self._sids = tuple(slices)
        self._sid_set = frozenset(self._sids)
        self._local = frozenset(self._sids if local_slices is None else local_slices)
        self._tele: dict[str, NodeTelemetry] = {coordinator: NodeTelemetry(0.0, 1.0, 0.0, 0.0)}
        self._workers: dict[str, WorkerView] = {}  # worker -> its first view (per-worker data)
        self._slices: dict[str, tuple[str, ...]] = {}  # worker -> the slices it serves here
        self._first_seen: dict[str, float] = {}
        self._served: set[str] = set()
        self._tried: set[str] = set()
        self._candidates: list[str] = []  # unproven, untried: K4 trials, oldest first
        self._last_job: dict[str, float] = {}  # worker -> when a route last sent it work
        self._probing: set[str] = set()  # re-probed workers whose sample has not come back
        self.backoff = ProbeBackoff()  # a worker fast only when probed is probed less often
        self._sampled: dict[str, float] = {}  # worker -> when its estimate was last refreshed
        self._now = 0.0  # the latest now_ms given to update_workers or route
        self.probes = 0
        self._slots = (0, 1)
        self._applied = (-1, -1)
        self._key: tuple[tuple[str, ...], ...] | None = None
        self.uncovered: tuple[str, ...] = ()
        self.replans = 0
        self.last_cost = 0.0
        self.state = SwarmState(SwarmPlan({}, {}, ()))
        self._routes: dict[int, LiveRoute] = {}
        self._replan()

    # -- feeding ----------------------------------------------------------------------------
    def set_slots(self, busy: int, total: int) -> None:
        """The coordinator's slot state (K2); safe to call from the slot-poll thread."""
        self._slots = (busy, total)

    @property
    def loaded(self) -> bool:
        """Under load (K2): busy slots >= saturation_threshold."""
        return self._slots[0] >= self.policy.saturation_threshold

    def update_workers(self, workers: Iterable[WorkerView], now_ms: float) -> bool:
        """The model's workers as of now (others' slices ignored), one view per (worker,
        slice): a worker serving several slices is one node holding each; True if it
        re-planned."""
        views: dict[str, WorkerView] = {}
        slices: dict[str, list[str]] = {}
        for w in workers:
            if w.slice_id in self._sid_set:
                views.setdefault(w.worker_id, w)
                slices.setdefault(w.worker_id, []).append(w.slice_id)
        self._now = max(self._now, now_ms)
        self._relax(now_ms)
        for wid, w in views.items():
            seen = self._first_seen.setdefault(wid, now_ms)
            if w.first_seen_ms is not None and w.first_seen_ms != seen:
                self._first_seen[wid] = w.first_seen_ms
            t = self._tele.setdefault(wid, NodeTelemetry())
            if w.load is not None:
                self._observe(wid, None, load=w.load)
            if t.alive != w.alive:
                self._set_alive(wid, w.alive)
        for wid in set(self._workers) - set(views):
            self._tele.pop(wid, None)
            self._first_seen.pop(wid, None)
            self._last_job.pop(wid, None)
            self._sampled.pop(wid, None)
            self._served.discard(wid)
            self._tried.discard(wid)
        self._workers = views
        self._slices = {w: tuple(dict.fromkeys(sids)) for w, sids in slices.items()}
        self._candidates = sorted(
            (
                w
                for w, v in views.items()
                if v.alive and not self._proven(v) and w not in self._tried
            ),
            key=lambda w: (self._first_seen[w], w),
        )
        return self._replan()

    def observe_result(self, worker: str, latency_ms: float, verified: bool = False) -> None:
        """A worker's result arrived `latency_ms` after its job was sent; `verified`: it was
        recomputed here and agreed, which proves the worker (K3)."""
        if worker not in self._tele:
            return
        # a re-probe's sample replaces the stale estimate it was sent to refresh, and the
        # worker's next jobs are held to it (`ProbeBackoff`)
        alpha = 1.0 if worker in self._probing else None
        if worker in self._probing:
            self.backoff.probed(worker, latency_ms)
        else:
            self.backoff.observed(worker, latency_ms)
        self._probing.discard(worker)
        self._sampled[worker] = self._now  # fresh: its fading restarts from here
        self._observe(worker, alpha, latency_ms=latency_ms, score=1.0)
        if verified and worker not in self._served:
            self._served.add(worker)
            self._replan()

    def observe_failure(self, worker: str, latency_ms: float | None = None) -> None:
        """A job failed or missed its deadline (pass the deadline as `latency_ms`)."""
        if worker in self._tele:
            self._probing.discard(worker)
            self.backoff.observed(worker, float("inf"))
            self._observe(worker, None, latency_ms=latency_ms, score=0.0)

    def mark_down(self, worker: str) -> Rescue | None:
        """Heartbeat expired: computes the rescue of the route that used it (None if the current
        route did not), marks it down, and re-plans without it."""
        t = self._tele.get(worker)
        if t is None or not t.alive:
            return None
        rescue = None
        try:
            lost = self.state.route(self.model_id)
        except RoutingError:
            lost = None
        if lost is not None and worker in lost.pipeline.nodes:
            try:
                res = failover_in_swarm(lost, worker, self.state, _NO_DEGRADE)
                rescue = Rescue(self.model_id, lost, res)
            except Unrecoverable as exc:
                rescue = Rescue(self.model_id, lost, None, exc)
        self._set_alive(worker, False)
        if worker in self._workers:
            self._workers[worker] = replace(self._workers[worker], alive=False)
        self._replan()
        return rescue

    # -- answering --------------------------------------------------------------------------
    def check(self) -> None:
        """Raises `UncoveredSlice` when some slice has no live node: refuse the model's requests."""
        if self.uncovered:
            raise UncoveredSlice(
                f"model {self.model_id!r}: no live node holds slice(s) {list(self.uncovered)}; "
                "requests are refused until a worker covers them"
            )

    def route(self, now_ms: float, active: Collection[str] | None = None) -> LiveRoute:
        """Where each slice of the next MoE layer goes. `active`: the slice ids that have work
        in this call (a K4 trial is only spent on one of them). Raises `UncoveredSlice`."""
        self.check()
        self._now = max(self._now, now_ms)
        slots = self._slots  # one read: the poll thread may replace it meanwhile
        loaded = slots[0] >= self.policy.saturation_threshold
        if slots != self._applied:
            self._applied = slots
            self.state.set_load(self.coordinator, 1.0 if loaded else 0.0)
        r = self.state.route(self.model_id)
        self.last_cost = r.cost
        if loaded and self._candidates:
            trial = self._trial(now_ms, r.pipeline, active)
            if trial is not None:
                return trial
        if loaded:
            probe = self._probe(now_ms, r.pipeline, active)
            if probe is not None:
                return probe
            for n in r.pipeline.nodes:
                self._last_job[n] = now_ms
        return self._routes[r.pipeline_id]

    def _probe(
        self, now_ms: float, base: Pipeline, active: Collection[str] | None
    ) -> LiveRoute | None:
        """A live worker outside `base`, idle here for `reprobe_ms`, gets one job."""
        used = set(base.nodes)
        for wid in sorted(self._workers, key=lambda w: (self._last_job.get(w, -1.0), w)):
            w = self._workers[wid]
            if wid in used or not w.alive:
                continue
            sid = self._slice_for(wid, active)
            if sid is None:
                continue
            last = self._last_job.get(wid, self._first_seen.get(wid, now_ms))
            if now_ms - last < self.backoff.wait(wid, self.policy.reprobe_ms):
                continue
            self._last_job[wid] = now_ms
            self._probing.add(wid)
            self.probes += 1
            return self._with(base, wid, sid)
        return None

    def _slice_for(self, wid: str, active: Collection[str] | None) -> str | None:
        """The first slice `wid` serves that has work in this call (any, for None)."""
        return next((s for s in self._slices.get(wid, ()) if active is None or s in active), None)

    def _with(self, base: Pipeline, wid: str, sid: str) -> LiveRoute:
        """`base`'s route with worker `wid` serving slice `sid`: a one-off route (-1)."""
        c = self.coordinator
        remote = {s: n for s, n in zip(self._sids, base.assignment, strict=True) if n != c}
        remote[sid] = wid
        return LiveRoute(-1, remote, wid)

    def _trial(
        self, now_ms: float, base: Pipeline, active: Collection[str] | None
    ) -> LiveRoute | None:
        """K4: an unproven live worker in its grace window gets one job, once."""
        keep: list[str] = []
        chosen: tuple[str, str] | None = None  # (worker, slice)
        for wid in self._candidates:
            w = self._workers.get(wid)
            if w is None or not w.alive or self._proven(w) or wid in self._tried:
                continue
            if now_ms - self._first_seen[wid] >= self.policy.grace_ms:
                continue  # its window has passed: not recruited under load
            sid = self._slice_for(wid, active) if chosen is None else None
            if sid is not None:
                chosen = (wid, sid)
            else:
                keep.append(wid)
        self._candidates = keep
        if chosen is None:
            return None
        self._tried.add(chosen[0])
        self._last_job[chosen[0]] = now_ms
        return self._with(base, *chosen)

    def eligible(self, sid: str) -> tuple[str, ...]:
        """The workers that may take slice `sid` in a capacity split: those the copies may use
        for it (proven, or any live one where nothing else holds it), alive, and not failing
        (score >= `ELIGIBLE_SCORE`: a worker that failed its last two jobs waits for a
        re-probe to succeed)."""
        if self._key is None or sid not in self._sid_set:
            return ()
        ws = self._key[self._sids.index(sid)]
        out = []
        for wid in ws:
            t = self.state.telemetry.get(wid) or self._tele.get(wid)
            if t is not None and t.alive and t.score >= ELIGIBLE_SCORE:
                out.append(wid)
        return tuple(out)

    def holds_locally(self, sid: str) -> bool:
        return sid in self._local

    def describe(self) -> dict[str, object]:
        """For stats and logs: load, copies, uncovered slices, proven and pending workers."""
        busy, total = self._slots
        return {
            "model": self.model_id,
            "busy": busy,
            "total": total,
            "loaded": self.loaded,
            "copies": len(self._routes),
            "replans": self.replans,
            "uncovered": list(self.uncovered),
            "proven": sorted(w for w, v in self._workers.items() if v.alive and self._proven(v)),
            "trials_pending": list(self._candidates),
            "last_cost": round(self.last_cost, 3),
            "probes": self.probes,
        }

    # -- internals --------------------------------------------------------------------------
    def _relax(self, now_ms: float) -> None:
        """Latency estimates fade toward the prior (H4's 50 ms) with `half_life_ms` while a
        worker sends no samples (a sample resets its clock)."""
        for wid in self._workers:
            last = self._sampled.get(wid)
            if last is None or now_ms <= last:
                self._sampled.setdefault(wid, now_ms)
                continue
            fraction = 1.0 - 0.5 ** ((now_ms - last) / self.policy.half_life_ms)
            self._sampled[wid] = now_ms
            if wid in self.state.telemetry:
                self.state.relax(wid, fraction)
            elif wid in self._tele:
                self._tele[wid].relax(fraction)

    def _proven(self, w: WorkerView) -> bool:
        return w.worker_id in self._served

    def _observe(self, node: str, alpha: float | None, **samples: float | None) -> None:
        if node in self.state.telemetry:
            self.state.observe(node, **samples, alpha=alpha)
        else:
            self._tele[node].observe(self.policy.alpha if alpha is None else alpha, **samples)

    def _set_alive(self, node: str, alive: bool) -> None:
        if node in self.state.telemetry:
            self.state.set_alive(node, alive)
        else:
            self._tele[node].alive = alive

    def _coverage(self) -> tuple[tuple[str, ...], ...]:
        """Per slice, the workers copies may use: proven ones, or any live one where the
        coordinator does not hold the slice and no proven worker does."""
        by_slice: dict[str, list[WorkerView]] = {s: [] for s in self._sids}
        for wid, w in self._workers.items():
            if w.alive:
                for sid in self._slices.get(wid, ()):
                    by_slice[sid].append(w)
        out = []
        for s in self._sids:
            ws = sorted(by_slice[s], key=lambda w: w.worker_id)
            proven = tuple(w.worker_id for w in ws if self._proven(w))
            out.append(proven or (() if s in self._local else tuple(w.worker_id for w in ws)))
        return tuple(out)

    def _assignments(self, key: tuple[tuple[str, ...], ...]) -> list[tuple[str, ...]]:
        """Copy 0 as local as possible, then copy k on each slice's k-th worker."""
        c = self.coordinator
        out = [
            tuple(c if s in self._local else ws[0] for s, ws in zip(self._sids, key, strict=True))
        ]
        for k in range(max((len(ws) for ws in key), default=0)):
            a = tuple(ws[k % len(ws)] if ws else c for ws in key)
            if a not in out:
                out.append(a)
        return out

    def _replan(self) -> bool:
        key = self._coverage()
        if key == self._key:
            return False
        self._key = key
        self.replans += 1
        c, sids = self.coordinator, self._sids
        self.uncovered = tuple(
            s for s, ws in zip(sids, key, strict=True) if not ws and s not in self._local
        )
        assignments = [] if self.uncovered else self._assignments(key)
        pipes = tuple(Pipeline(i, self.model_id, a) for i, a in enumerate(assignments))
        nodes = {c} | {n for a in assignments for n in a}
        profiles = {n: NodeProfile(n) for n in sorted(nodes)}
        plan = SwarmPlan(profiles, {self.model_id: self.spec}, pipes, len(pipes))
        tele = {n: self._tele[n] for n in nodes}
        self.state = SwarmState(plan, tele, self.policy.weights, self.policy.alpha)
        self._routes = {
            p.pipeline_id: LiveRoute(
                p.pipeline_id, {s: n for s, n in zip(sids, p.assignment, strict=True) if n != c}
            )
            for p in pipes
        }
        self._applied = (-1, -1)
        return True
