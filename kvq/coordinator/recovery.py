"""What a layer call does when a remote job fails, misses its deadline or answers: one policy
per coordinator mode, chosen once by whether the coordinator holds the experts.

- `ComputeHere` (a coordinator on the full file): a failed, missed or barred job is computed
  here, never lost; an answer is checked by a sampled recomputation (`Verifier.judge`).
- `AskAnother` (a backbone-only coordinator, nothing here can compute a slice): the same rows
  go to another live holder of the slice, waited for up to `KVQ_REPLICA_WAIT_S` and then
  `NoReplica`; an answer is checked by the same job's answer from a second holder, drawn as
  often as a recomputation would be, and a third decides a disagreement (BOINC's quorum).

`LayerCall` routes, sends, collects and sums; it asks its policy only at those three points.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from kvq.bus.records import DispatchCounters
from kvq.coordinator.pending import Answer, Pending
from kvq.coordinator.verify import Verdict
from kvq.slices import SliceSpec

if TYPE_CHECKING:
    from kvq.coordinator.placement import Placement
    from kvq.coordinator.routing import SliceRouter
    from kvq.coordinator.verify import Verifier

log = logging.getLogger("kvq.coordinator")


class Parts(Protocol):
    """What a policy reads of the call's parts (`layer_call.CallParts`)."""

    @property
    def placement(self) -> Placement: ...
    @property
    def routing(self) -> SliceRouter: ...
    @property
    def verifier(self) -> Verifier: ...


class LayerCall(Protocol):
    """What a policy may do with the layer call it serves (`layer_call.LayerCall`)."""

    @property
    def parts(self) -> Parts: ...

    stats: DispatchCounters
    partials: dict[str, torch.Tensor]  # sid -> its pairs' terms [P, H]

    def local(self, spec: SliceSpec, rows: torch.Tensor) -> torch.Tensor:
        """The slice's terms for `rows`, computed here."""

    def send(self, worker: str, spec: SliceSpec, rows: torch.Tensor) -> Pending:
        """One more job of rows the call already routed, to `worker`."""

    def use(self, worker: str, p: Pending, ms: float, compute_ms: float, verified: bool) -> None:
        """Count `worker`'s answer to `p` as used."""

    def give_up_time(self) -> float:
        """Monotonic time after which a job no one here can compute fails."""


class Recovery(Protocol):
    after_miss: str  # what a missed job leads to, for the log

    def unrouted(self, call: LayerCall, spec: SliceSpec) -> str | None:
        """The worker for a slice the route kept here (None: compute it here)."""

    def missed(self, call: LayerCall, p: Pending) -> None:
        """`p` failed, missed its deadline or came from a barred worker: get its terms
        another way."""

    def answered(
        self, call: LayerCall, p: Pending, got: Answer, ms: float, compute_ms: float
    ) -> None:
        """A well-formed answer to `p`: check it, then use it (`call.use`) or recover."""


class ComputeHere:
    """A coordinator holding the experts: a worker is an accelerator, never a dependency."""

    after_miss = "computing locally"

    def unrouted(self, call: LayerCall, spec: SliceSpec) -> str | None:
        return None

    def missed(self, call: LayerCall, p: Pending) -> None:
        call.stats.fallback_jobs += 1
        call.partials[p.spec.sid] = call.local(p.spec, p.rows)

    def answered(
        self, call: LayerCall, p: Pending, got: Answer, ms: float, compute_ms: float
    ) -> None:
        def recompute() -> torch.Tensor:
            return call.local(p.spec, p.rows)

        y, verdict = call.parts.verifier.judge(got.worker, got.y, got.dtype, recompute, p.spec.sid)
        call.partials[p.spec.sid] = y
        if verdict is Verdict.REJECTED:
            call.stats.fallback_jobs += 1
            return
        call.use(got.worker, p, ms, compute_ms, verdict is Verdict.VERIFIED)


class AskAnother:
    """A backbone-only coordinator: every slice is a worker's, replicas stand in and check."""

    after_miss = "sending it again"

    def unrouted(self, call: LayerCall, spec: SliceSpec) -> str | None:
        return call.parts.placement.replica_for(spec.sid, None, call.give_up_time())

    def missed(self, call: LayerCall, p: Pending) -> None:
        """The same rows to a live replica of the slice (another worker if there is one)."""
        worker = call.parts.placement.replica_for(p.spec.sid, p.worker, call.give_up_time())
        log.info("job for slice %s failed on %s; sent again to %s", p.spec.sid, p.worker, worker)
        call.send(worker, p.spec, p.rows)
        call.stats.remote_sent += 1

    def answered(
        self, call: LayerCall, p: Pending, got: Answer, ms: float, compute_ms: float
    ) -> None:
        """Two that agree are used; on disagreement a third holder decides, and the one
        outvoted is caught; with no holder left to ask, none is used and the job is sent
        again (never a wrong token)."""
        verifier = call.parts.verifier
        if verifier.unchecked(got.worker, got.y, got.dtype) is Verdict.REJECTED:
            if p.answers:  # a witness that failed: ask another, the earlier answers wait
                self._witness(call, p, p.answers)
            else:
                self.missed(call, p)
            return
        if not p.answers and not verifier.wants_witness(got.worker):
            call.partials[p.spec.sid] = got.y
            call.use(got.worker, p, ms, compute_ms, False)
            return
        agreeing = next((a for a in p.answers if verifier.agree(a, got)), None)
        if agreeing is not None:
            verifier.confirmed([agreeing, got])
            for a in p.answers:
                if a is not agreeing:
                    verifier.outvoted(a, [agreeing, got])
            call.partials[p.spec.sid] = got.y
            call.use(got.worker, p, ms, compute_ms, True)
            return
        self._witness(call, p, [*p.answers, got])

    def _witness(self, call: LayerCall, p: Pending, answers: list[Answer]) -> None:
        """Send `p`'s rows to a live holder of the slice that has not answered them yet, to
        confirm one of `answers`; with none left, the answers are dropped and the job sent
        again (or, with one answer and no second holder, used unconfirmed)."""
        parts = call.parts
        asked = {a.worker for a in answers} | {p.worker}
        free = [
            w
            for w in parts.routing.live_holders(p.spec.sid)
            if w not in asked and not parts.verifier.barred(w)
        ]
        if not free:
            if len(answers) > 1:
                log.warning(
                    "slice %s: %d answers to one job disagree and no other live worker "
                    "holds it; none is used, the job is sent again",
                    p.spec.sid,
                    len(answers),
                )
                call.stats.unresolved += 1
                self.missed(call, p)
            else:  # no second holder: used unconfirmed, as without quorum
                call.stats.unwitnessed += 1
                call.partials[p.spec.sid] = answers[0].y
                call.use(answers[0].worker, p, 0.0, 0.0, False)
            return
        witness = call.send(free[0], p.spec, p.rows)
        witness.answers = answers
        call.stats.witness_jobs += 1
        log.debug(
            "slice %s: a job asks %s to confirm %s",
            p.spec.sid,
            free[0],
            ", ".join(a.worker for a in answers) or "-",
        )


def recovery_for(has_experts: bool) -> Recovery:
    """The policy of a coordinator that holds the experts (or not)."""
    return ComputeHere() if has_experts else AskAnother()
