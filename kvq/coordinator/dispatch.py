"""Per-MoE-layer dispatch: each slice computed locally or sent to the worker the router picks.

The swarm router (`routing.SliceRouter`) decides by cost: at rest the all-local copy wins (K1),
under load copies of proven workers win (K3), an unproven worker gets one first try inside its
grace window (K4). Remote jobs go out pipelined, local slices are computed while they are in
flight, and a result that misses its deadline is computed locally (counted as a fallback, never
lost).

The dispatcher owns the parts and hands them down: one layer's work is a `LayerCall`
(`layer_call.py`), which routes through the `Placement` (`placement.py`), sends and collects
through the `Mailbox` (`mailbox.py`) and counts into the `Tally`; with micro-batches several
calls are in flight at once and each collects its own results. After each call, the
dispatcher measures the trials the mailbox set aside for it (K4). Values go one way: dispatcher
-> call -> mailbox; nothing below calls back up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
import torch

from kvq.bank.server import ExpertServer
from kvq.bus.board import Board
from kvq.catalog import ModelInfo
from kvq.config import DispatchSettings
from kvq.coordinator.layer_call import CallParts, LayerCall, Tally
from kvq.coordinator.mailbox import Delivery, Mailbox
from kvq.coordinator.pending import latency_ms
from kvq.coordinator.placement import Placement
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.verify import Verdict, Verifier, admitted
from kvq.keys import Keys

log = logging.getLogger("kvq.coordinator")


class Dispatcher:
    """Per MoE layer: which slices go where, the remote round trip, the local fallback."""

    has_experts = True  # set per instance in __init__

    def __init__(
        self,
        board: Board,
        r: redis.Redis,
        keys: Keys,
        settings: DispatchSettings,
        coord_id: str,
        info: ModelInfo,
        server: ExpertServer,
        routing: SliceRouter,
        maxlen: int = 10_000,
    ) -> None:
        self.s, self.coord, self.info, self.server, self.routing = (
            settings,
            coord_id,
            info,
            server,
            routing,
        )
        # False on a backbone file: no slice can be computed or recomputed here, so a job
        # without a live worker waits for one, then fails (NoReplica)
        self.has_experts = server.bank is not None
        self.tally = Tally()
        self.stats, self.per_worker, self.job_rtt = (
            self.tally.stats,
            self.tally.per_worker,
            self.tally.job_rtt,
        )
        self.verifier = Verifier(
            board,
            info.model,
            routing.trust,
            settings.verify_remote,
            server.dtype_name,
            self.stats,
            routing.bar,
            admitted(settings.gpu_workers),
        )
        self.placement = Placement(routing, info, settings, self.has_experts, self.stats)
        self.mailbox = Mailbox(
            board, r, keys, coord_id, lambda: routing.holders, self.stats, maxlen
        )
        self.parts = CallParts(
            info.model,
            settings,
            self.placement,
            routing,
            self.mailbox,
            self.verifier,
            server,
            self.tally,
            board.now_ms,
        )
        self.sent_remote = False  # a layer call of the current step sent remote jobs

    def for_step(self, busy: int, total: int, microbatches: int | None = None) -> _StepMoe:
        """The backbone's MoeFn for one engine step, under this load (K2). It asks for
        `KVQ_MICROBATCHES` micro-batches only when the previous step sent remote jobs: with
        every slice local there is no round trip to hide, and a second micro-batch would
        only unpack each weight twice. `microbatches` overrides that rule (benches)."""
        mb = self.s.microbatches if self.sent_remote else 1
        mb = mb if microbatches is None else microbatches
        self.sent_remote = False
        self.stats.microbatched_steps += mb > 1
        self.verifier.trust.new_step()  # the step floor of checks counts jobs per step
        return _StepMoe(self, busy, total, mb)

    def take_routed(self) -> dict[str, int]:
        """Rows routed per slice since the last call (read by the slot-poll thread)."""
        return self.placement.take_routed()

    def settle_trials(self) -> None:
        """The trials answered or expired since the last call: they move the workers'
        estimates, and an answer checked against the local result may prove or catch one."""
        for dv in self.mailbox.answered_trials():
            self._measure(dv)
        for p in self.mailbox.expired_trials(self.s.job_deadline_ms):
            self.routing.observe_failure(p.worker, float(self.s.job_deadline_ms))

    def _measure(self, dv: Delivery) -> None:
        """A trial's or re-probe's answer (from `dv.sender`, the job's worker or a peer of its
        slice): it moves the worker's estimates and, checked against the local result computed
        anyway, may prove the worker or catch it."""
        p, res, sender = dv.pending, dv.result, dv.sender
        ms = latency_ms(p, dv.eid)
        y = res.y.array() if res.error is None and res.y is not None else None
        want = (p.pairs, self.server.hidden)
        if y is not None and y.shape != want:  # no honest worker answers another shape
            self.verifier.caught(sender, f"a result of shape {list(y.shape)} for {list(want)}")
        if y is None and res.error is not None:
            self.verifier.refused(sender, res.error)
        if y is None or y.shape != want:
            self.routing.observe_failure(p.worker, ms)
            return
        self.stats.trials_answered += 1
        verdict = Verdict.USED
        # a trial's reference was computed on this coordinator's path: it checks only a
        # worker asked for that same path (a GPU worker's are checked on the hot path, exactly)
        if (
            p.ref is not None
            and not self.verifier.barred(sender)
            and not (self.verifier.exact_for(sender) and res.dtype == self.verifier.asked(sender))
        ):
            self.stats.remote_rows += int(y.shape[0])
            verdict = self.verifier.check(
                sender, torch.from_numpy(y.copy()), res.dtype, p.ref, sid=p.spec.sid
            )
        if verdict is not Verdict.REJECTED:
            self.routing.observe_result(
                sender,
                ms,
                int(p.rows.numel()),
                res.compute_ms,
                verified=verdict is Verdict.VERIFIED,
            )


class _StepMoe:
    """`(layer, x, ids, w) -> [T, H]` for the backbone, with the step's load bound; `start`
    splits a call in two so that micro-batches can interleave (`kvq.model.microbatch`)."""

    def __init__(self, d: Dispatcher, busy: int, total: int, microbatches: int) -> None:
        self.d, self.busy, self.total, self.microbatches = d, busy, total, microbatches

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        return self.start(layer, x, ids, w)()

    def start(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        d = self.d
        call = LayerCall(d.parts, layer, x, ids, w)
        call.start(self.busy, self.total)
        d.sent_remote = d.sent_remote or call.sent_remote

        def finish() -> torch.Tensor:
            y = call.finish()
            d.settle_trials()
            return y

        return finish
