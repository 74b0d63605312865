"""Per-MoE-layer dispatch: each slice computed locally or sent to the worker the router picks.

The swarm router (`routing.SliceRouter`) decides by cost: at rest the all-local copy wins (K1),
under load copies of proven workers win (K3), an unproven worker gets one first try inside its
grace window (K4). Remote jobs go out pipelined, local slices are computed while they are in
flight, and a result that misses its deadline is computed locally (counted as a fallback, never
lost). One layer's work is a `LayerCall` (`layer_call.py`); with micro-batches several are in
flight at once, and the dispatcher hands each result read to the call that sent its job.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable

import redis
import torch

from kvq import wire
from kvq.bank.server import ExpertServer
from kvq.bus import dead_letter
from kvq.bus.board import Board, Fields
from kvq.bus.histogram import Histogram
from kvq.bus.records import DispatchCounters
from kvq.config import DispatchSettings
from kvq.coordinator.layer_call import LayerCall
from kvq.coordinator.pending import Pending, latency_ms
from kvq.coordinator.results import WorkerResults
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.verify import Verdict, Verifier
from kvq.device import dtype_name
from kvq.errors import NoReplica, UncoveredSlice, WireError
from kvq.keys import Keys
from kvq.model.registry import ModelInfo
from kvq.slices import SliceSpec
from kvq.swarm import LiveRoute

log = logging.getLogger("kvq.coordinator")


class Dispatcher:
    """Per MoE layer: which slices go where, the remote round trip, the local fallback."""

    has_experts = True  # set per instance in __init__

    def __init__(
        self, board: Board, r: redis.Redis, keys: Keys, settings: DispatchSettings,
        coord_id: str, info: ModelInfo, server: ExpertServer, routing: SliceRouter,
        maxlen: int = 10_000,
    ) -> None:  # fmt: skip
        self.board, self.r, self.keys, self.s, self.maxlen = board, r, keys, settings, maxlen
        self.coord, self.info, self.server, self.routing = coord_id, info, server, routing
        # False on a backbone file: no slice can be computed or recomputed here, so a job
        # without a live worker waits for one (`replica_for`), then fails (NoReplica)
        self.has_experts = server.bank is not None
        self.stats = DispatchCounters()
        self.verifier = Verifier(
            board, info.model, routing.trust, settings.verify_remote, dtype_name(server.dtype),
            self.stats, routing.bar,
        )  # fmt: skip
        self.job_rtt = Histogram()  # remote jobs: sent -> result read, answered or failed
        self.per_worker: dict[str, int] = {}  # results accepted per worker
        self.shadows: dict[str, Pending] = {}  # trial/probe jobs nobody waits for (K4)
        self.inflight: dict[str, LayerCall] = {}  # job id -> the layer call waiting for it
        self.sent_remote = False  # a layer call of the current step sent remote jobs
        self._routed: dict[str, int] = {}  # token rows per slice since the last `take_routed`
        self._routed_lock = threading.Lock()
        self.results = WorkerResults(r, keys, coord_id)
        self._seq = itertools.count()
        self._layer_slices = {layer: info.layer_slices(layer) for layer in info.meta.moe_layers}

    def send(self, jobs: list[tuple[str, Fields]]) -> None:
        """Post jobs; the results of every worker serving this model are read from then on
        (the monitor may move a dead worker's jobs to a peer of its slice)."""
        self.results.watch([*(w for w, _ in jobs), *self.routing.holders])
        self.board.send_jobs(jobs)

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
        """`C:N:TOKEN`: the sequence number for people, and 64 random bits that make the id
        the job's token: only the worker whose inbox it went to (its ACL user alone reads it),
        or the peer the monitor moved it to, knows it; no other worker can answer the job
        (`accept`). A sequence alone let a peer of the slice answer its neighbours' jobs."""
        return f"{self.coord}:{next(self._seq)}:{secrets.token_hex(8)}"

    def slices_of(self, layer: int) -> list[SliceSpec]:
        return self._layer_slices[layer]

    def route(self, rows: dict[str, int], busy: int, total: int) -> LiveRoute | None:
        """The layer's route; None: compute it all here (coverage lost, experts held here).
        Without the experts (a backbone file), waits up to `KVQ_REPLICA_WAIT_S` for
        coverage, then raises NoReplica."""
        until = time.monotonic() + self.s.replica_wait_s
        while True:
            try:
                return self.routing.route(rows, busy, total)
            except UncoveredSlice as exc:
                if self.has_experts:
                    # admitted before coverage was lost: the weights are here, finish locally
                    self.stats.uncovered_local += 1
                    log.warning("%s; computing locally", exc)
                    return None
                if time.monotonic() >= until:
                    raise self._no_replica(str(exc)) from exc
                self._wait_coverage()

    def replica_for(self, sid: str, avoid: str | None, until: float) -> str:
        """A live worker serving `sid` for a job this coordinator cannot compute, preferring
        one other than `avoid` (the worker that just failed it); waits for one until
        `until` (monotonic), then raises NoReplica.

        Holders are reread before `avoid` is tried again (a step's view can be older than the
        worker's death), and `avoid` alone is retried only until `until`: a dead worker whose
        heartbeat has not expired yet never holds a step past the wait."""
        reread = False
        while True:
            live = self.routing.live_holders(sid)
            others = [w for w in live if w != avoid]
            if others:
                return others[0]
            if not reread:
                self.routing.refresh(force=True)
                reread = True
                continue
            if time.monotonic() >= until:
                raise self._no_replica(f"no live worker serves slice {sid}")
            if live:
                return live[0]  # only the one that just failed: once more, within the wait
            self._wait_coverage()

    def _wait_coverage(self) -> None:
        time.sleep(max(0.02, min(0.5, self.routing.refresh_s)))
        self.routing.refresh(force=True)

    def _no_replica(self, why: str) -> NoReplica:
        return NoReplica(
            f"model {self.info.model!r}: {why}, and this coordinator holds no routed experts "
            f"(a backbone file) to compute it; waited {self.s.replica_wait_s:g} s "
            "(KVQ_REPLICA_WAIT_S) for a worker. Start workers (kvq worker) with room for the "
            "model's slices, then send the request again"
        )

    def accept(self, sender: str, stream: str, eid: bytes, fields: dict[bytes, bytes]) -> None:
        """One entry of `sender`'s results stream: to the layer call that waits for it, to its
        trial's estimates, or counted late (or foreign)."""
        try:
            res = wire.decode(fields, wire.Result)
        except WireError as exc:
            dead_letter(self.r, self.keys, stream, eid, fields, str(exc), self.maxlen)
            return
        # who answered is where it arrived, never the result's `worker` field: the worker the
        # job went to, or a peer of its slice the monitor moved it to when that worker died.
        # The job id is the token that proves it: 64 random bits only an inbox's reader sees
        # (`next_job_id`), so a peer cannot answer a job that was not moved to it
        owner = self.inflight.get(res.job_id)
        p = self.shadows.get(res.job_id) or (
            owner.pending.get(res.job_id) if owner is not None else None
        )
        if (
            p is not None
            and sender != p.worker
            and p.spec.sid not in self.routing.holders.get(sender, ())
        ):
            self.stats.foreign_results += 1
            log.warning("result for job %s sent to %s arrived from %s; ignored",
                        res.job_id, p.worker, sender)  # fmt: skip
            return
        shadow = self.shadows.pop(res.job_id, None)
        if shadow is not None:
            self._measure(shadow, res, eid, sender)
            return
        owner = self.inflight.pop(res.job_id, None)
        if owner is None or res.job_id not in owner.pending:
            # duplicate or late: the job was already answered once
            self.stats.late_results += 1
            return
        owner.deliver(sender, eid, res)

    def _measure(self, p: Pending, res: wire.Result, eid: bytes, sender: str) -> None:
        """A trial's or re-probe's answer (from `sender`, the job's worker or a peer of its
        slice): it moves the worker's estimates and, checked against the local result computed
        anyway, may prove the worker or catch it."""
        ms = latency_ms(p, eid)
        y = res.y.array() if res.error is None and res.y is not None else None
        want = (p.rows.numel(), self.server.hidden)
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
            verdict = self.verifier.check(sender, torch.from_numpy(y.copy()), res.dtype, p.ref)
        if verdict is not Verdict.REJECTED:
            self.routing.observe_result(
                sender, ms, int(p.rows.numel()), res.compute_ms,
                verified=verdict is Verdict.VERIFIED,
            )  # fmt: skip

    def expire_shadows(self) -> None:
        now = time.monotonic()
        for job_id, p in list(self.shadows.items()):
            if (now - p.sent_at) * 1000 > self.s.job_deadline_ms:
                del self.shadows[job_id]
                self.routing.observe_failure(p.worker, float(self.s.job_deadline_ms))


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
        call = LayerCall(self.d, layer, x, ids, w)
        call.start(self.busy, self.total)
        return call.finish
