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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import redis
import torch

from kvq import wire
from kvq.bank import Bank
from kvq.bus import dead_letter, xadd
from kvq.config import Settings
from kvq.coordinator.routing import SliceRouter
from kvq.errors import UncoveredSlice, WireError
from kvq.keys import Keys
from kvq.registry import ModelInfo, SliceSpec
from kvq.swarm import LiveRoute

log = logging.getLogger("kvq.coordinator")


@dataclass
class DispatchStats:
    local_jobs: int = 0
    remote_sent: int = 0
    remote_jobs: int = 0
    fallback_jobs: int = 0
    remote_errors: int = 0
    late_results: int = 0
    uncovered_local: int = 0
    verified: int = 0
    mismatches: int = 0
    max_abs_err: float = 0.0
    per_worker: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float | int]:
        d = {k: v for k, v in vars(self).items() if k != "per_worker"}
        return d


@dataclass
class _Pending:
    spec: SliceSpec
    rows: torch.Tensor
    worker: str
    sent_at: float


class Dispatcher:
    """A `MoeFn` for the backbone: `(layer, x, ids, weights) -> [T, H]`."""

    def __init__(
        self, r: redis.Redis, keys: Keys, settings: Settings, coord_id: str,
        info: ModelInfo, bank: Bank,
        slot_state: Callable[[], tuple[int, int]],
    ) -> None:  # fmt: skip
        self.r, self.keys, self.s, self.coord = r, keys, settings, coord_id
        self.info = info
        self.bank = bank
        self.routing = SliceRouter(r, keys, settings, coord_id, info, slot_state)
        self.stats = DispatchStats()
        self.results_key = keys.coord_results(coord_id)
        self._last_id = b"0-0"
        self._seq = itertools.count()
        self._layer_slices = {
            layer: info.layer_slices(layer) for layer in range(info.meta.block_count)
        }
        r.delete(self.results_key)

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        partials: dict[str, torch.Tensor] = {}
        pending: dict[str, _Pending] = {}
        local: list[tuple[SliceSpec, torch.Tensor]] = []
        order: list[tuple[SliceSpec, torch.Tensor]] = []
        pipe = self.r.pipeline(transaction=False)
        deadline_ms = int(time.time() * 1000) + self.s.job_deadline_ms
        for spec in self._layer_slices[layer]:
            hit = ((ids >= spec.expert_start) & (ids < spec.expert_end)).any(dim=1)
            rows = hit.nonzero().squeeze(1)  # [R]
            if rows.numel():
                order.append((spec, rows))
        route = self._route({spec.sid for spec, _ in order})
        for spec, rows in order:
            worker = route.worker(spec.sid) if route is not None else None
            if worker is None:
                local.append((spec, rows))
                continue
            job_id = f"{self.coord}:{next(self._seq)}"
            job = wire.Job(
                job_id=job_id, model=self.info.model, layer=layer, slice=spec.sid,
                expert_start=spec.expert_start, expert_end=spec.expert_end,
                coord=self.coord, reply_to=self.results_key, deadline_ms=deadline_ms,
                x=wire.Tensor.of(x[rows].float().cpu().numpy()),
                ids=wire.Tensor.of(ids[rows].cpu().numpy().astype(np.int32)),
                weights=wire.Tensor.of(w[rows].float().cpu().numpy()),
            )  # fmt: skip
            xadd(pipe, self.keys.worker_inbox(worker), wire.encode(job), self.s.stream_maxlen)
            pending[job_id] = _Pending(spec, rows, worker, time.monotonic())
            self.stats.remote_sent += 1
        if pending:
            pipe.execute()
        for spec, rows in local:
            partials[spec.sid] = self._local(layer, spec, x, ids, w, rows)
            self.stats.local_jobs += 1
        if pending:
            self._gather(layer, x, ids, w, pending, partials, deadline_ms)
        out = torch.zeros_like(x)
        for spec, rows in order:
            out.index_add_(0, rows, partials[spec.sid])
        return out

    def _route(self, active: set[str]) -> LiveRoute | None:
        try:
            return self.routing.route(active)
        except UncoveredSlice as exc:
            # admitted before coverage was lost: the weights are here, so finish locally
            self.stats.uncovered_local += 1
            log.warning("%s; computing locally", exc)
            return None

    def _local(
        self, layer: int, spec: SliceSpec, x: torch.Tensor, ids: torch.Tensor,
        w: torch.Tensor, rows: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        return self.bank.forward(
            layer, x[rows], ids[rows], w[rows], spec.expert_start, spec.expert_end
        )

    def _gather(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
        pending: dict[str, _Pending], partials: dict[str, torch.Tensor], deadline_ms: int,
    ) -> None:  # fmt: skip
        while pending:
            left_ms = deadline_ms - int(time.time() * 1000)
            if left_ms <= 0:
                break
            resp = self.r.xread({self.results_key: self._last_id}, count=256, block=left_ms)
            for _, entries in resp or []:
                for eid, fields in entries:
                    self._last_id = eid
                    self._accept(eid, fields, x, ids, w, pending, partials, layer)
        for job_id, p in pending.items():  # missed the deadline: compute here, count it
            log.info("job %s on %s missed its deadline; computing locally", job_id, p.worker)
            self.routing.observe_failure(p.worker, float(self.s.job_deadline_ms))
            partials[p.spec.sid] = self._local(layer, p.spec, x, ids, w, p.rows)
            self.stats.fallback_jobs += 1

    def _accept(
        self, eid: bytes, fields: dict[bytes, bytes], x: torch.Tensor, ids: torch.Tensor,
        w: torch.Tensor, pending: dict[str, _Pending], partials: dict[str, torch.Tensor],
        layer: int,
    ) -> None:  # fmt: skip
        try:
            res = wire.decode(fields, wire.Result)
        except WireError as exc:
            dead_letter(
                self.r, self.keys, self.results_key, eid, fields, str(exc), self.s.stream_maxlen
            )
            return
        p = pending.pop(res.job_id, None)
        if p is None:  # duplicate or late: the job was already answered once
            self.stats.late_results += 1
            return
        latency_ms = (time.monotonic() - p.sent_at) * 1000
        if res.error is not None or res.y is None:
            log.warning("worker %s failed job %s: %s", res.worker, res.job_id, res.error)
            self.routing.observe_failure(p.worker, latency_ms)
            self.stats.remote_errors += 1
            self.stats.fallback_jobs += 1
            partials[p.spec.sid] = self._local(layer, p.spec, x, ids, w, p.rows)
            return
        y = torch.from_numpy(res.y.array().copy()).to(x.device, x.dtype)
        if y.shape != (p.rows.numel(), x.shape[1]):
            self.routing.observe_failure(p.worker, latency_ms)
            self.stats.remote_errors += 1
            self.stats.fallback_jobs += 1
            partials[p.spec.sid] = self._local(layer, p.spec, x, ids, w, p.rows)
            return
        self.stats.remote_jobs += 1
        self.routing.observe_result(p.worker, latency_ms)
        self.stats.per_worker[res.worker] = self.stats.per_worker.get(res.worker, 0) + 1
        if self.s.verify_remote:
            ref = self._local(layer, p.spec, x, ids, w, p.rows)
            err = float((ref - y).abs().max()) if y.numel() else 0.0
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            self.stats.verified += 1
            self.stats.max_abs_err = max(self.stats.max_abs_err, err)
            if err > 1e-4 * max(1.0, scale):
                self.stats.mismatches += 1
        partials[p.spec.sid] = y
