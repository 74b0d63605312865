"""One MoE layer's dispatch for one (micro-)batch: its rows, jobs in flight and partial sums.

A call is `start`ed (route, send the remote jobs, compute the local slices while they are in
flight) and later `finish`ed (collect its results, fall back locally on a miss, add the
partial sums). Between the two the engine may run another micro-batch's attention
(`kvq.model.microbatch`), so several calls can be in flight at once: each collects its own
results from the mailbox, which keeps those another call's read brought.

A call works with the parts its dispatcher hands it (`CallParts`) and never reaches back into
the dispatcher: what it learns goes into the step's tally, the routing's estimates and the
verifier, and what the dispatcher needs after it (whether it sent remote jobs) it reads off
the call.

Each slice, local or remote, gives its pairs' terms (one row per (row, expert) pair inside
it) and `finish` adds each token's terms from 0 in ascending expert id whatever the arrival
order (`kvq.model.moe_sum`): the bits of one call over the whole layer, so remote, local,
`kvq generate` and stage grain agree bit for bit when the workers compute with the same
dtype, whatever the slice grid.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvq import wire
from kvq.bank.server import ExpertServer
from kvq.bus.board import Fields
from kvq.bus.histogram import Histogram
from kvq.bus.records import DispatchCounters
from kvq.config import DispatchSettings
from kvq.coordinator.mailbox import Delivery, Mailbox
from kvq.coordinator.pending import Answer, Pending, latency_ms
from kvq.coordinator.placement import Placement
from kvq.coordinator.recovery import recovery_for
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.verify import Verifier
from kvq.model.moe_sum import combine, inside
from kvq.slices import SliceSpec

log = logging.getLogger("kvq.coordinator")


@dataclass
class Tally:
    """What the layer calls count, read by the coordinator's stats."""

    stats: DispatchCounters = field(default_factory=DispatchCounters)
    per_worker: dict[str, int] = field(default_factory=dict)  # results used per worker
    job_rtt: Histogram = field(default_factory=Histogram)  # remote jobs: sent -> result read


@dataclass(frozen=True)
class CallParts:
    """What a layer call works with, all owned by its dispatcher."""

    model: str
    settings: DispatchSettings
    placement: Placement
    routing: SliceRouter
    mailbox: Mailbox
    verifier: Verifier
    server: ExpertServer
    tally: Tally
    # Redis's clock (`Board.now_ms`): a job's deadline is read by a worker on another host
    clock_ms: Callable[[], float] = lambda: time.time() * 1000


class LayerCall:
    """One MoE layer over one batch's rows: `start`, then `finish` -> `[T, H]`."""

    give_up_at = 0.0  # monotonic: when a job this coordinator cannot compute fails (set once)

    def __init__(
        self, parts: CallParts, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> None:
        self.parts, self.layer, self.x, self.ids, self.w = (
            parts,
            layer,
            x,
            ids,
            w,
        )  # [T,H] [T,k] [T,k]
        self.stats = parts.tally.stats
        self.partials: dict[str, torch.Tensor] = {}  # sid -> its pairs' terms [P, H]
        self.masks: dict[str, torch.Tensor] = {}  # sid -> its pairs among the call's [T, k]
        self.pending: dict[str, Pending] = {}
        self.order: list[tuple[SliceSpec, torch.Tensor]] = []
        self.deadline_ms = int(parts.clock_ms()) + parts.settings.job_deadline_ms
        self.sent_remote = False  # it sent jobs it waits for (the dispatcher reads it)
        self.whole: torch.Tensor | None = None  # [T, H] when every slice ran here at once
        self.recovery = recovery_for(parts.placement.has_experts)  # on a miss, and to check

    def start(self, busy: int, total: int) -> None:
        """Route the layer, send its remote jobs, compute its local slices."""
        parts, stats, place = self.parts, self.stats, self.parts.placement
        for spec in place.slices_of(self.layer):
            mask = inside(self.ids, spec.expert_start, spec.expert_end)  # [T, k]
            rows = mask.any(dim=1).nonzero().squeeze(1)  # [R]
            if rows.numel():
                self.order.append((spec, rows))
                self.masks[spec.sid] = mask
        work = {spec.sid: int(rows.numel()) for spec, rows in self.order}
        place.count_routed(work)  # the monitor weights replica targets by it (K7)
        route = place.route(work, busy, total)
        t_send = time.perf_counter()
        local: list[tuple[SliceSpec, torch.Tensor]] = []
        jobs: list[tuple[str, Fields]] = []
        trials: list[Pending] = []
        trial = route.trial if route is not None else None
        for spec, rows in self.order:
            worker = route.worker(spec.sid) if route is not None else None
            if worker is None:  # the route keeps it here: where it cannot be, a replica
                worker = self.recovery.unrouted(self, spec)
            if worker is None:
                local.append((spec, rows))
                continue
            job_id = parts.mailbox.next_job_id()
            jobs.append((worker, wire.encode(self._job(job_id, spec, rows, worker))))
            p = self._pending(spec, rows, worker)
            if worker == trial and parts.routing.router.holds_locally(spec.sid):
                # a K4 trial or re-probe only measures the worker: computed here as well and
                # not waited for, so a slow worker costs no layer call its round trip
                parts.mailbox.expect_trial(job_id, p)
                trials.append(p)
                local.append((spec, rows))
            else:
                self._expect(job_id, p)
        parts.mailbox.post(jobs, parts.routing.holders)
        stats.remote_send_s += time.perf_counter() - t_send
        stats.remote_sent += len(self.pending)
        stats.trials_sent += len(jobs) - len(self.pending)
        self.sent_remote = bool(self.pending)
        if not jobs:  # every slice here: one call over them adds in the fixed order itself
            self.whole = self._all_local(local)
            return
        for spec, rows in local:  # while the remote jobs are in flight
            self.partials[spec.sid] = self.local(spec, rows)
            stats.local_jobs += 1
        for p in trials:  # this call's trials: the local answer checks theirs
            p.ref = self.partials[p.spec.sid]

    def finish(self) -> torch.Tensor:
        """Collect this call's results (the mailbox keeps others' for them), fall back
        locally on a miss; the layer's output `[T, H]`."""
        if self.pending:
            self._gather()
        elif self.parts.mailbox.has_trials:  # nothing to wait for: read answered trials
            self.receive(self.parts.mailbox.collect(self, None))
        if self.whole is not None:
            return self.whole
        parts = ((self.masks[spec.sid], self.partials[spec.sid]) for spec, _ in self.order)
        return combine(self.ids, int(self.x.shape[1]), self.x.dtype, parts)  # [T, H]

    def _all_local(self, local: list[tuple[SliceSpec, torch.Tensor]]) -> torch.Tensor:
        """Every slice of the call computed here: one call over their experts, which adds
        each token's terms in the fixed order (the bits `combine` gives their terms, one
        kernel call instead of one a slice). Its time counts per slice, by rows. [T, H]"""
        if not local:
            return torch.zeros_like(self.x)
        t0 = time.perf_counter()
        lo, hi = min(s.expert_start for s, _ in local), max(s.expert_end for s, _ in local)
        y = self.parts.server.compute(self.layer, self.x, self.ids, self.w, lo, hi)
        took = time.perf_counter() - t0
        rows = [int(r.numel()) for _, r in local]
        for n in rows:
            self.parts.routing.observe_local(n, took * 1000 * n / sum(rows))
        self.stats.local_expert_s += took
        self.stats.local_rows += sum(rows)
        self.stats.local_jobs += len(local)
        return y

    def _pending(self, spec: SliceSpec, rows: torch.Tensor, worker: str) -> Pending:
        """A job of `rows` for `spec` sent to `worker` now; its result holds one row per
        pair of those rows inside the slice."""
        pairs = int(self.masks[spec.sid].sum())
        return Pending(spec, rows, worker, time.monotonic(), self.parts.clock_ms(), pairs=pairs)

    def _expect(self, job_id: str, p: Pending) -> None:
        self.pending[job_id] = p
        self.parts.mailbox.expect(job_id, p, self)

    def send(self, worker: str, spec: SliceSpec, rows: torch.Tensor) -> Pending:
        """One more job for rows this call already routed (sent again, or to a witness); its
        deadline is the job deadline from now."""
        parts = self.parts
        job_id = parts.mailbox.next_job_id()
        self.deadline_ms = max(
            self.deadline_ms, int(parts.clock_ms()) + parts.settings.job_deadline_ms
        )
        parts.mailbox.post(
            [(worker, wire.encode(self._job(job_id, spec, rows, worker)))], parts.routing.holders
        )
        p = self._pending(spec, rows, worker)
        self._expect(job_id, p)
        return p

    def _job(self, job_id: str, spec: SliceSpec, rows: torch.Tensor, worker: str) -> wire.Job:
        parts = self.parts
        return wire.Job(
            job_id=job_id,
            model=parts.model,
            layer=self.layer,
            slice=spec.sid,
            expert_start=spec.expert_start,
            expert_end=spec.expert_end,
            coord=parts.mailbox.coord,
            reply_to=parts.mailbox.results_key(worker),
            deadline_ms=self.deadline_ms,
            x=wire.Tensor.of(self.x[rows].float().cpu().numpy()),
            ids=wire.Tensor.of(self.ids[rows].cpu().numpy().astype(np.int32)),
            weights=wire.Tensor.of(self.w[rows].float().cpu().numpy()),
            want_dtype=parts.verifier.asked(worker),
        )

    def local(self, spec: SliceSpec, rows: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.parts.server.terms(
            self.layer,
            self.x[rows],
            self.ids[rows],
            self.w[rows],
            spec.expert_start,
            spec.expert_end,
        )
        took = time.perf_counter() - t0
        self.parts.routing.observe_local(int(rows.numel()), took * 1000)
        self.stats.local_expert_s += took
        self.stats.local_rows += int(rows.numel())
        return y

    def fallback(self, p: Pending, latency_ms: float, failed_by: str | None = None) -> None:
        """A remote job failed or timed out: its policy gets the terms another way, never
        losing them. The failure counts against `failed_by`, the worker whose answer failed
        (a peer the job was moved to, perhaps), else against `p.worker`, which did not answer
        in time."""
        self.parts.routing.observe_failure(failed_by or p.worker, latency_ms)
        self.recovery.missed(self, p)

    def give_up_time(self) -> float:
        """Monotonic time after which a job no one here can compute fails: `KVQ_REPLICA_WAIT_S`
        from this call's first need of a replica."""
        if not self.give_up_at:
            self.give_up_at = time.monotonic() + self.parts.settings.replica_wait_s
        return self.give_up_at

    def _gather(self) -> None:
        mailbox, stats = self.parts.mailbox, self.stats
        # a result checked on arrival is recomputed here (`Verifier.judge`): that is expert
        # compute (`local_expert_s`), not waiting
        t0, computed = time.perf_counter(), stats.local_expert_s
        while self.pending:  # a resent job (backbone-only) is waited for in turn
            while self.pending:
                left_ms = self.deadline_ms - int(self.parts.clock_ms())
                # past the deadline: one last look, without blocking, at what has arrived
                self.receive(mailbox.collect(self, left_ms if left_ms > 0 else None))
                if left_ms <= 0:
                    break
            missed, self.pending = self.pending, {}
            for job_id, p in missed.items():
                log.info(
                    "job %s on %s missed its deadline; %s",
                    job_id,
                    p.worker,
                    self.recovery.after_miss,
                )
                mailbox.forget(job_id)
                self.fallback(p, float(self.parts.settings.job_deadline_ms))
        stats.remote_wait_s += time.perf_counter() - t0 - (stats.local_expert_s - computed)

    def receive(self, deliveries: list[Delivery]) -> None:
        """Results of this call's jobs, as the mailbox hands them over (it has checked that
        their senders may answer them)."""
        for dv in deliveries:
            if dv.job_id in self.pending:
                self._deliver(dv)

    def _deliver(self, dv: Delivery) -> None:
        parts, stats = self.parts, self.stats
        sender, res = dv.sender, dv.result
        p = self.pending.pop(dv.job_id)
        ms = latency_ms(p, dv.eid)
        parts.tally.job_rtt.observe(ms / 1000)
        y = None
        if res.error is None and res.y is not None:
            y = torch.from_numpy(res.y.array().copy()).to(self.x.device, self.x.dtype)
        want = (p.pairs, self.x.shape[1])
        if y is not None and y.shape != want:  # no honest worker answers another shape
            stats.remote_errors += 1
            parts.verifier.caught(sender, f"a result of shape {list(y.shape)} for {list(want)}")
            self.fallback(p, ms, sender)
            return
        if y is None:
            if res.error is not None:
                parts.verifier.refused(sender, res.error)
            log.warning("worker %s failed job %s: %s", sender, res.job_id, res.error)
            stats.remote_errors += 1
            self.fallback(p, ms, sender)
            return
        if parts.verifier.barred(sender):  # caught earlier: nothing it sends is used
            stats.barred_results += 1
            self.recovery.missed(self, p)
            return
        self.recovery.answered(self, p, Answer(sender, y, res.dtype), ms, res.compute_ms)

    def use(self, worker: str, p: Pending, ms: float, compute_ms: float, verified: bool) -> None:
        tally = self.parts.tally
        tally.stats.remote_jobs += 1
        self.parts.routing.observe_result(
            worker, ms, int(p.rows.numel()), compute_ms, verified=verified
        )
        tally.per_worker[worker] = tally.per_worker.get(worker, 0) + 1
