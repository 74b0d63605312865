"""Per-MoE-layer dispatch: each slice computed locally or sent to the worker the router picks.

The swarm router (`routing.SliceRouter`) decides by cost: at rest the all-local copy wins (K1),
under load copies of proven workers win (K3), an unproven worker gets one first try inside its
grace window (K4). Remote jobs go out pipelined, local slices are computed while they are in
flight, and a result that misses its deadline is computed locally (counted as a fallback, never
lost). Partial sums are added in slice order whatever the arrival order, so remote and local
generation agree bit for bit when the worker computes with the same dtype.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import numpy as np
import redis
import torch

from kvq import wire
from kvq.bus import dead_letter
from kvq.bus.board import Board, Fields
from kvq.bus.histogram import Histogram
from kvq.bus.records import DispatchCounters
from kvq.config import DispatchSettings
from kvq.coordinator.pending import Pending as _Pending
from kvq.coordinator.pending import latency_ms as _latency_ms
from kvq.coordinator.results import WorkerResults
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.verify import Verdict, Verifier
from kvq.device import dtype_name
from kvq.errors import UncoveredSlice, WireError
from kvq.keys import Keys
from kvq.model.registry import ModelInfo
from kvq.slices import SliceSpec
from kvq.swarm import LiveRoute
from kvq.worker.server import ExpertServer

log = logging.getLogger("kvq.coordinator")


class Dispatcher:
    """Per MoE layer: which slices go where, the remote round trip, the local fallback."""

    def __init__(
        self, board: Board, r: redis.Redis, keys: Keys, settings: DispatchSettings,
        coord_id: str, info: ModelInfo, server: ExpertServer, routing: SliceRouter,
        maxlen: int = 10_000,
    ) -> None:  # fmt: skip
        self.board, self.r, self.keys, self.s, self.maxlen = board, r, keys, settings, maxlen
        self.coord, self.info, self.server, self.routing = coord_id, info, server, routing
        self.stats = DispatchCounters()
        self.verifier = Verifier(
            board, info.model, routing.trust, settings.verify_remote, dtype_name(server.dtype),
            self.stats, routing.bar,
        )  # fmt: skip
        self.job_rtt = Histogram()  # remote jobs: sent -> result read, answered or failed
        self.per_worker: dict[str, int] = {}  # results accepted per worker
        self.shadows: dict[str, _Pending] = {}  # trial/probe jobs nobody waits for (K4)
        self._routed: dict[str, int] = {}  # token rows per slice since the last `take_routed`
        self._routed_lock = threading.Lock()
        self.results = WorkerResults(r, keys, coord_id)
        self._seq = itertools.count()
        self._layer_slices = {
            layer: info.layer_slices(layer) for layer in range(info.meta.block_count)
        }

    def send(self, jobs: list[tuple[str, Fields]]) -> None:
        """Post jobs; the results of every worker serving this model are read from then on
        (the monitor may move a dead worker's jobs to a peer of its slice)."""
        self.results.watch([*(w for w, _ in jobs), *self.routing.holders])
        self.board.send_jobs(jobs)

    def for_step(self, busy: int, total: int) -> _StepMoe:
        """The backbone's MoeFn for one engine step, under this load (K2)."""
        return _StepMoe(self, busy, total)

    def count_routed(self, rows: dict[str, int]) -> None:
        with self._routed_lock:
            for sid, n in rows.items():
                self._routed[sid] = self._routed.get(sid, 0) + n

    def take_routed(self) -> dict[str, int]:
        """Rows routed per slice since the last call (read by the slot-poll thread)."""
        with self._routed_lock:
            out, self._routed = self._routed, {}
        return out

    def next_job_id(self) -> str:
        return f"{self.coord}:{next(self._seq)}"

    def slices_of(self, layer: int) -> list[SliceSpec]:
        return self._layer_slices[layer]

    def route(self, rows: dict[str, int], busy: int, total: int) -> LiveRoute | None:
        try:
            return self.routing.route(rows, busy, total)
        except UncoveredSlice as exc:
            # admitted before coverage was lost: the weights are here, so finish locally
            self.stats.uncovered_local += 1
            log.warning("%s; computing locally", exc)
            return None


class _StepMoe:
    """`(layer, x, ids, w) -> [T, H]` for the backbone, with the step's load bound."""

    def __init__(self, d: Dispatcher, busy: int, total: int) -> None:
        self.d, self.busy, self.total = d, busy, total

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        return _LayerCall(self.d, layer, x, ids, w).run(self.busy, self.total)


class _LayerCall:
    """One MoE layer's dispatch: owns its rows, jobs in flight and partial sums.

    Partial sums are added in slice order whatever the arrival order, so remote and local
    generation agree bit for bit when the worker computes with the same dtype.
    """

    def __init__(
        self, d: Dispatcher, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> None:
        self.d, self.layer, self.x, self.ids, self.w = d, layer, x, ids, w  # [T,H] [T,k] [T,k]
        self.partials: dict[str, torch.Tensor] = {}
        self.pending: dict[str, _Pending] = {}
        self.deadline_ms = int(time.time() * 1000) + d.s.job_deadline_ms

    def run(self, busy: int, total: int) -> torch.Tensor:
        d, stats = self.d, self.d.stats
        order: list[tuple[SliceSpec, torch.Tensor]] = []
        for spec in d.slices_of(self.layer):
            hit = ((self.ids >= spec.expert_start) & (self.ids < spec.expert_end)).any(dim=1)
            rows = hit.nonzero().squeeze(1)  # [R]
            if rows.numel():
                order.append((spec, rows))
        work = {spec.sid: int(rows.numel()) for spec, rows in order}
        d.count_routed(work)  # the monitor weights replica targets by it (K7)
        route = d.route(work, busy, total)
        local: list[tuple[SliceSpec, torch.Tensor]] = []
        jobs: list[tuple[str, Fields]] = []
        trial = route.trial if route is not None else None
        for spec, rows in order:
            worker = route.worker(spec.sid) if route is not None else None
            if worker is None:
                local.append((spec, rows))
                continue
            job_id = d.next_job_id()
            jobs.append((worker, wire.encode(self._job(job_id, spec, rows, worker))))
            p = _Pending(spec, rows, worker, time.monotonic(), time.time() * 1000)
            if worker == trial and d.routing.router.holds_locally(spec.sid):
                # a K4 trial or re-probe only measures the worker: computed here as well and
                # not waited for, so a slow worker costs no layer call its round trip
                d.shadows[job_id] = p
                local.append((spec, rows))
            else:
                self.pending[job_id] = p
        d.send(jobs)
        stats.remote_sent += len(self.pending)
        stats.trials_sent += len(jobs) - len(self.pending)
        for spec, rows in local:  # while the remote jobs are in flight
            self.partials[spec.sid] = self.local(spec, rows)
            stats.local_jobs += 1
        for shadow in d.shadows.values():  # this call's trials: the local answer checks theirs
            if shadow.ref is None and shadow.spec.sid in self.partials:
                shadow.ref = self.partials[shadow.spec.sid]
        if self.pending:
            self._gather()
        elif d.shadows:  # nothing to wait for: pick up answered trials without blocking
            for sender, stream, eid, fields in d.results.read(count=256, block_ms=None):
                self._accept(sender, stream, eid, fields)
        self._expire_shadows()
        out = torch.zeros_like(self.x)
        for spec, rows in order:
            out.index_add_(0, rows, self.partials[spec.sid])
        return out

    def _job(self, job_id: str, spec: SliceSpec, rows: torch.Tensor, worker: str) -> wire.Job:
        d = self.d
        return wire.Job(
            job_id=job_id, model=d.info.model, layer=self.layer, slice=spec.sid,
            expert_start=spec.expert_start, expert_end=spec.expert_end,
            coord=d.coord, reply_to=d.results.key(worker), deadline_ms=self.deadline_ms,
            x=wire.Tensor.of(self.x[rows].float().cpu().numpy()),
            ids=wire.Tensor.of(self.ids[rows].cpu().numpy().astype(np.int32)),
            weights=wire.Tensor.of(self.w[rows].float().cpu().numpy()),
        )  # fmt: skip

    def local(self, spec: SliceSpec, rows: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.d.server.compute(
            self.layer, self.x[rows], self.ids[rows], self.w[rows],
            spec.expert_start, spec.expert_end,
        )  # fmt: skip
        self.d.routing.observe_local(int(rows.numel()), (time.perf_counter() - t0) * 1000)
        return y

    def fallback(self, p: _Pending, latency_ms: float) -> None:
        """A remote job failed or timed out: compute it here and count it, never lose it."""
        self.d.routing.observe_failure(p.worker, latency_ms)
        self.d.stats.fallback_jobs += 1
        self.partials[p.spec.sid] = self.local(p.spec, p.rows)

    def _gather(self) -> None:
        d = self.d
        while self.pending:
            left_ms = self.deadline_ms - int(time.time() * 1000)
            if left_ms <= 0:
                break
            for sender, stream, eid, fields in d.results.read(count=256, block_ms=left_ms):
                self._accept(sender, stream, eid, fields)
        for job_id, p in list(self.pending.items()):
            log.info("job %s on %s missed its deadline; computing locally", job_id, p.worker)
            self.fallback(p, float(d.s.job_deadline_ms))
        self.pending.clear()

    def _accept(self, sender: str, stream: str, eid: bytes, fields: dict[bytes, bytes]) -> None:
        d, stats = self.d, self.d.stats
        try:
            res = wire.decode(fields, wire.Result)
        except WireError as exc:
            dead_letter(d.r, d.keys, stream, eid, fields, str(exc), d.maxlen)
            return
        # who answered is where it arrived, never the result's `worker` field: the worker the
        # job went to, or a peer of its slice the monitor moved it to when that worker died
        p = d.shadows.get(res.job_id) or self.pending.get(res.job_id)
        if p is not None and sender != p.worker and d.routing.holders.get(sender) != p.spec.sid:
            stats.foreign_results += 1
            log.warning("result for job %s sent to %s arrived from %s; ignored",
                        res.job_id, p.worker, sender)  # fmt: skip
            return
        shadow = d.shadows.pop(res.job_id, None)
        if shadow is not None:
            self._measure(shadow, res, eid, sender)
            return
        p = self.pending.pop(res.job_id, None)
        if p is None:  # duplicate or late: the job was already answered once
            stats.late_results += 1
            return
        latency_ms = _latency_ms(p, eid)
        d.job_rtt.observe(latency_ms / 1000)
        y = None
        if res.error is None and res.y is not None:
            y = torch.from_numpy(res.y.array().copy()).to(self.x.device, self.x.dtype)
        if y is None or y.shape != (p.rows.numel(), self.x.shape[1]):
            log.warning("worker %s failed job %s: %s", p.worker, res.job_id, res.error)
            stats.remote_errors += 1
            self.fallback(p, latency_ms)
            return
        if d.verifier.barred(sender):  # caught earlier: nothing it sends is used
            stats.barred_results += 1
            stats.fallback_jobs += 1
            self.partials[p.spec.sid] = self.local(p.spec, p.rows)
            return
        y, verdict = d.verifier.judge(sender, y, res.dtype, lambda: self.local(p.spec, p.rows))
        self.partials[p.spec.sid] = y
        if verdict is Verdict.REJECTED:
            stats.fallback_jobs += 1
            return
        stats.remote_jobs += 1
        d.routing.observe_result(
            sender, latency_ms, int(p.rows.numel()), res.compute_ms,
            verified=verdict is Verdict.VERIFIED,
        )  # fmt: skip
        d.per_worker[sender] = d.per_worker.get(sender, 0) + 1

    def _measure(self, p: _Pending, res: wire.Result, eid: bytes, sender: str) -> None:
        """A trial's or re-probe's answer (from `sender`, the job's worker or a peer of its
        slice): it moves the worker's estimates and, checked against the local result computed
        anyway, may prove the worker or catch it."""
        latency_ms = _latency_ms(p, eid)
        y = res.y.array() if res.error is None and res.y is not None else None
        if y is None or y.shape != (p.rows.numel(), self.x.shape[1]):
            self.d.routing.observe_failure(p.worker, latency_ms)
            return
        self.d.stats.trials_answered += 1
        verdict = Verdict.USED
        if p.ref is not None and not self.d.verifier.barred(sender):
            self.d.stats.remote_rows += int(y.shape[0])
            verdict = self.d.verifier.check(sender, torch.from_numpy(y.copy()), res.dtype, p.ref)
        if verdict is not Verdict.REJECTED:
            self.d.routing.observe_result(
                sender, latency_ms, int(p.rows.numel()), res.compute_ms,
                verified=verdict is Verdict.VERIFIED,
            )  # fmt: skip

    def _expire_shadows(self) -> None:
        d = self.d
        now = time.monotonic()
        for job_id, p in list(d.shadows.items()):
            if (now - p.sent_at) * 1000 > d.s.job_deadline_ms:
                del d.shadows[job_id]
                d.routing.observe_failure(p.worker, float(d.s.job_deadline_ms))
