"""One MoE layer's dispatch for one (micro-)batch: its rows, jobs in flight and partial sums.

A call is `start`ed (route, send the remote jobs, compute the local slices while they are in
flight) and later `finish`ed (wait for its results, fall back locally on a miss, add the
partial sums). Between the two the engine may run another micro-batch's attention
(`kvq.model.microbatch`), so several calls can be in flight at once: results are read from
the workers' results streams by the dispatcher and handed to the call that sent the job.

Partial sums are added in slice order whatever the arrival order, so remote and local
generation agree bit for bit when the worker computes with the same dtype.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvq import wire
from kvq.bus.board import Fields
from kvq.coordinator.pending import Answer, Pending, latency_ms
from kvq.coordinator.verify import Verdict
from kvq.slices import SliceSpec

if TYPE_CHECKING:
    from kvq.coordinator.dispatch import Dispatcher

log = logging.getLogger("kvq.coordinator")


class LayerCall:
    """One MoE layer over one batch's rows: `start`, then `finish` -> `[T, H]`."""

    give_up_at = 0.0  # monotonic: when a job this coordinator cannot compute fails (set once)

    def __init__(
        self, d: Dispatcher, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> None:
        self.d, self.layer, self.x, self.ids, self.w = d, layer, x, ids, w  # [T,H] [T,k] [T,k]
        self.partials: dict[str, torch.Tensor] = {}
        self.pending: dict[str, Pending] = {}
        self.order: list[tuple[SliceSpec, torch.Tensor]] = []
        self.deadline_ms = int(time.time() * 1000) + d.s.job_deadline_ms

    def start(self, busy: int, total: int) -> None:
        """Route the layer, send its remote jobs, compute its local slices."""
        d, stats = self.d, self.d.stats
        for spec in d.slices_of(self.layer):
            hit = ((self.ids >= spec.expert_start) & (self.ids < spec.expert_end)).any(dim=1)
            rows = hit.nonzero().squeeze(1)  # [R]
            if rows.numel():
                self.order.append((spec, rows))
        work = {spec.sid: int(rows.numel()) for spec, rows in self.order}
        d.count_routed(work)  # the monitor weights replica targets by it (K7)
        route = d.route(work, busy, total)
        t_send = time.perf_counter()
        local: list[tuple[SliceSpec, torch.Tensor]] = []
        jobs: list[tuple[str, Fields]] = []
        trials: list[Pending] = []
        trial = route.trial if route is not None else None
        for spec, rows in self.order:
            worker = route.worker(spec.sid) if route is not None else None
            if worker is None and not d.has_experts:  # a split kept it here: it cannot be
                worker = d.replica_for(spec.sid, None, self._give_up_at())
            if worker is None:
                local.append((spec, rows))
                continue
            job_id = d.next_job_id()
            jobs.append((worker, wire.encode(self._job(job_id, spec, rows, worker))))
            p = Pending(spec, rows, worker, time.monotonic(), time.time() * 1000)
            if worker == trial and d.routing.router.holds_locally(spec.sid):
                # a K4 trial or re-probe only measures the worker: computed here as well and
                # not waited for, so a slow worker costs no layer call its round trip
                d.shadows[job_id] = p
                trials.append(p)
                local.append((spec, rows))
            else:
                self.pending[job_id] = p
                d.inflight[job_id] = self
        d.send(jobs)
        stats.remote_send_s += time.perf_counter() - t_send
        stats.remote_sent += len(self.pending)
        stats.trials_sent += len(jobs) - len(self.pending)
        d.sent_remote = d.sent_remote or bool(self.pending)
        for spec, rows in local:  # while the remote jobs are in flight
            self.partials[spec.sid] = self.local(spec, rows)
            stats.local_jobs += 1
        for shadow in trials:  # this call's trials: the local answer checks theirs
            shadow.ref = self.partials[shadow.spec.sid]

    def finish(self) -> torch.Tensor:
        """Wait for this call's results (others' are handed to their calls), fall back
        locally on a miss; the layer's output `[T, H]`."""
        d = self.d
        if self.pending:
            self._gather()
        elif d.shadows:  # nothing to wait for: pick up answered trials without blocking
            for sender, stream, eid, fields in d.results.read(count=256, block_ms=None):
                d.accept(sender, stream, eid, fields)
        d.expire_shadows()
        out = torch.zeros_like(self.x)
        for spec, rows in self.order:
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
            want_dtype=d.verifier.asked(worker),
        )  # fmt: skip

    def local(self, spec: SliceSpec, rows: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.d.server.compute(
            self.layer, self.x[rows], self.ids[rows], self.w[rows],
            spec.expert_start, spec.expert_end,
        )  # fmt: skip
        took = time.perf_counter() - t0
        self.d.routing.observe_local(int(rows.numel()), took * 1000)
        self.d.stats.local_expert_s += took
        self.d.stats.local_rows += int(rows.numel())
        return y

    def fallback(self, p: Pending, latency_ms: float, failed_by: str | None = None) -> None:
        """A remote job failed or timed out: compute it here and count it, never lose it
        (without the experts here: send it again, `resend`). The failure counts against
        `failed_by`, the worker whose answer failed (a peer the job was moved to, perhaps),
        else against `p.worker`, which did not answer in time."""
        self.d.routing.observe_failure(failed_by or p.worker, latency_ms)
        if not self.d.has_experts:
            self.resend(p)
            return
        self.d.stats.fallback_jobs += 1
        self.partials[p.spec.sid] = self.local(p.spec, p.rows)

    def _give_up_at(self) -> float:
        if not self.give_up_at:
            self.give_up_at = time.monotonic() + self.d.s.replica_wait_s
        return self.give_up_at

    def resend(self, p: Pending) -> None:
        """A backbone-only coordinator's job failed: the same rows go to a live replica of the
        slice (another worker if there is one), waited for up to `KVQ_REPLICA_WAIT_S` from
        this call's first failure; then NoReplica ends the step's requests with an error."""
        d = self.d
        worker = d.replica_for(p.spec.sid, p.worker, self._give_up_at())
        job_id = d.next_job_id()
        log.info("job for slice %s failed on %s; sent again to %s as %s", p.spec.sid,
                 p.worker, worker, job_id)  # fmt: skip
        self.deadline_ms = max(self.deadline_ms, int(time.time() * 1000) + d.s.job_deadline_ms)
        d.send([(worker, wire.encode(self._job(job_id, p.spec, p.rows, worker)))])
        self.pending[job_id] = Pending(p.spec, p.rows, worker, time.monotonic(), time.time() * 1000)
        d.inflight[job_id] = self
        d.stats.remote_sent += 1

    def _gather(self) -> None:
        d = self.d
        # a result checked on arrival is recomputed here (`Verifier.judge`): that is expert
        # compute (`local_expert_s`), not waiting
        t0, computed = time.perf_counter(), d.stats.local_expert_s
        while self.pending:  # a resent job (backbone-only) is waited for in turn
            while self.pending:
                left_ms = self.deadline_ms - int(time.time() * 1000)
                if left_ms <= 0:
                    break
                for sender, stream, eid, fields in d.results.read(count=256, block_ms=left_ms):
                    d.accept(sender, stream, eid, fields)
            missed, self.pending = self.pending, {}
            for job_id, p in missed.items():
                log.info("job %s on %s missed its deadline; %s", job_id, p.worker,
                         "computing locally" if d.has_experts else "sending it again")  # fmt: skip
                d.inflight.pop(job_id, None)
                self.fallback(p, float(d.s.job_deadline_ms))
        d.stats.remote_wait_s += time.perf_counter() - t0 - (d.stats.local_expert_s - computed)

    def deliver(self, sender: str, eid: bytes, res: wire.Result) -> None:
        """The result of one of this call's jobs, read from `sender`'s stream (the dispatcher
        found its owner and checked that `sender` may answer it)."""
        d, stats = self.d, self.d.stats
        p = self.pending.pop(res.job_id)
        ms = latency_ms(p, eid)
        d.job_rtt.observe(ms / 1000)
        y = None
        if res.error is None and res.y is not None:
            y = torch.from_numpy(res.y.array().copy()).to(self.x.device, self.x.dtype)
        want = (p.rows.numel(), self.x.shape[1])
        if y is not None and y.shape != want:  # no honest worker answers another shape
            stats.remote_errors += 1
            d.verifier.caught(sender, f"a result of shape {list(y.shape)} for {list(want)}")
            self.fallback(p, ms, sender)
            return
        if y is None:
            if res.error is not None:
                d.verifier.refused(sender, res.error)
            log.warning("worker %s failed job %s: %s", sender, res.job_id, res.error)
            stats.remote_errors += 1
            self.fallback(p, ms, sender)
            return
        if d.verifier.barred(sender):  # caught earlier: nothing it sends is used
            stats.barred_results += 1
            if not d.has_experts:
                self.resend(p)
                return
            stats.fallback_jobs += 1
            self.partials[p.spec.sid] = self.local(p.spec, p.rows)
            return
        if not d.has_experts:  # nothing here can recompute it: replicas check each other
            self._quorum(p, Answer(sender, y, res.dtype), ms, res.compute_ms)
            return
        recompute = lambda: self.local(p.spec, p.rows)  # noqa: E731
        y, verdict = d.verifier.judge(sender, y, res.dtype, recompute)
        self.partials[p.spec.sid] = y
        if verdict is Verdict.REJECTED:
            stats.fallback_jobs += 1
            return
        self._used(sender, p, ms, res.compute_ms, verdict is Verdict.VERIFIED)

    def _used(self, worker: str, p: Pending, ms: float, compute_ms: float, verified: bool) -> None:
        d = self.d
        d.stats.remote_jobs += 1
        d.routing.observe_result(worker, ms, int(p.rows.numel()), compute_ms, verified=verified)
        d.per_worker[worker] = d.per_worker.get(worker, 0) + 1

    def _quorum(self, p: Pending, got: Answer, ms: float, compute_ms: float) -> None:
        """A coordinator without experts checks a result by the same job's result from another
        holder of the slice (BOINC's quorum), drawn as often as a recomputation would be. Two
        that agree are used; on disagreement a third holder decides, and the one outvoted is
        caught; with no holder left to ask, none is used and the job is sent again (it waits,
        up to `KVQ_REPLICA_WAIT_S`, then NoReplica: never a wrong token)."""
        d = self.d
        if d.verifier.unchecked(got.worker, got.y, got.dtype) is Verdict.REJECTED:
            if p.answers:  # a witness that failed: ask another, the earlier answers wait
                self._witness(p, p.answers, None)
            else:
                self.resend(p)
            return
        if not p.answers and not d.verifier.wants_witness(got.worker):
            self.partials[p.spec.sid] = got.y
            self._used(got.worker, p, ms, compute_ms, False)
            return
        agreeing = next((a for a in p.answers if d.verifier.agree(a, got)), None)
        if agreeing is not None:
            d.verifier.confirmed([agreeing, got])
            for a in p.answers:
                if a is not agreeing:
                    d.verifier.outvoted(a, [agreeing, got])
            self.partials[p.spec.sid] = got.y
            self._used(got.worker, p, ms, compute_ms, True)
            return
        self._witness(p, [*p.answers, got], got.worker)

    def _witness(self, p: Pending, answers: list[Answer], last: str | None) -> None:
        """Send `p`'s rows to a live holder of the slice that has not answered them yet, to
        confirm one of `answers`; with none left, the answers are dropped and the job sent
        again."""
        d = self.d
        asked = {a.worker for a in answers} | {p.worker}
        free = [w for w in d.routing.live_holders(p.spec.sid)
                if w not in asked and not d.verifier.barred(w)]  # fmt: skip
        if not free:
            if len(answers) > 1:
                log.warning("slice %s: %d answers to one job disagree and no other live worker "
                            "holds it; none is used, the job is sent again", p.spec.sid,
                            len(answers))  # fmt: skip
                d.stats.unresolved += 1
                self.resend(p)
            else:  # no second holder: used unconfirmed, as without quorum
                d.stats.unwitnessed += 1
                self.partials[p.spec.sid] = answers[0].y
                self._used(answers[0].worker, p, 0.0, 0.0, False)
            return
        worker, job_id = free[0], d.next_job_id()
        self.deadline_ms = max(self.deadline_ms, int(time.time() * 1000) + d.s.job_deadline_ms)
        d.send([(worker, wire.encode(self._job(job_id, p.spec, p.rows, worker)))])
        witness = Pending(p.spec, p.rows, worker, time.monotonic(), time.time() * 1000)
        witness.answers = answers
        self.pending[job_id] = witness
        d.inflight[job_id] = self
        d.stats.witness_jobs += 1
        log.debug("slice %s: job %s asks %s to confirm %s", p.spec.sid, job_id, worker,
                  ", ".join(a.worker for a in answers) or "-")  # fmt: skip
