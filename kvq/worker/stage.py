"""`StageServer`: a worker's stage slice (X12), a layer span served whole, with the state of
every sequence that passes through it.

A stage job (`wire.StageJob`) carries the rows of some sequences entering the span; the server
runs the span's blocks over them (attention against each sequence's own cache, the span's
routed experts from its own bytes) and answers the rows leaving it. Each sequence's state
(KV cache, MLA latents, DeltaNet recurrent state, sliding rings) stays here between jobs, keyed
by (coordinator, sequence key), up to `max_seqs` sequences (the least recently used one goes
first; its coordinator replays it if it comes back).

A sequence's rows must start where its state ends. One that does not (its state was evicted,
or this server never saw it: a holder that took over from a dead one) makes the whole job
answer `StateLost` with those keys in `Result.lost`, retryable, before anything is computed or
changed; the coordinator replays them from position 0 (`start` 0 drops any state held).
A whole job runs or none of it does: caches advance only after the span has run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from kvq import wire
from kvq.bank.server import BAD_JOB, DEADLINE_EXPIRED, NON_FINITE, WRONG_DTYPE
from kvq.device import dtype_name
from kvq.errors import KvqError
from kvq.model import Backbone, KVCache

log = logging.getLogger("kvq.worker")
STATE_LOST = "StateLost"


class BadStageJob(KvqError):
    """A stage job this server cannot run (another span, a wrong shape)."""


class StageServer:
    """Serves stage `sid` of `model` (its blocks in `backbone`) for worker `name`."""

    bank = None  # no expert bank to step: the span's experts are in `backbone`

    def __init__(
        self, name: str, model: str, sid: str, backbone: Backbone, max_seqs: int = 256,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:  # fmt: skip
        self.name, self.model, self.sid, self.backbone = name, model, sid, backbone
        self.hidden = backbone.meta.embedding_length
        self.dtype_name = cast(wire.ComputeDType, dtype_name(backbone.dtype))
        self.max_seqs, self.clock_ms = max_seqs, clock_ms
        self.states: OrderedDict[tuple[str, str], KVCache] = OrderedDict()
        self.served = 0
        self.last_serve_ms = 0
        self.busy_s = 0.0
        self.rows = 0
        self.evicted = 0  # states dropped for room (their coordinators replay them)

    def handle(self, job: wire.Job | wire.StageJob) -> wire.Result:
        """The job's result, or a result carrying the error; never raises."""
        t0 = time.perf_counter()
        if not isinstance(job, wire.StageJob):
            return self._failed(job.job_id, BAD_JOB, f"{self.sid} is a stage: no expert jobs", t0)
        try:
            self._check(job)
            for key in job.drop:
                self.states.pop((job.coord, key), None)
            if job.want_dtype is not None and job.want_dtype != self.dtype_name:
                return self._failed(job.job_id, WRONG_DTYPE, self.dtype_name, t0)
            if job.deadline_ms and self.clock_ms() > job.deadline_ms:
                return self._failed(job.job_id, DEADLINE_EXPIRED, "past its deadline", t0)
            lost = [
                s.key for s in job.seqs
                if s.start and self._length(job.coord, s.key) != s.start
            ]  # fmt: skip
            if lost:
                return wire.Result(
                    job_id=job.job_id, worker=self.name, lost=lost,
                    error=wire.Failure(STATE_LOST, f"{len(lost)} sequence(s) to replay", True),
                )  # fmt: skip
            out = self._run(job)
        except BadStageJob as exc:
            return self._failed(job.job_id, BAD_JOB, str(exc), t0)
        except Exception as exc:  # one job must never stop a server
            log.exception("stage job %s failed", job.job_id)
            return wire.Result(job_id=job.job_id, worker=self.name, error=wire.failure(exc))
        if not np.isfinite(out).all():
            return self._failed(job.job_id, NON_FINITE, "the span's output overflowed", t0)
        self.served += 1
        self.last_serve_ms = int(self.clock_ms())
        self.busy_s += time.perf_counter() - t0
        self.rows += int(out.shape[0])
        return wire.Result(
            job_id=job.job_id, worker=self.name, y=wire.Tensor.of(out),
            compute_ms=(time.perf_counter() - t0) * 1000, dtype=self.dtype_name,
        )  # fmt: skip

    def _length(self, coord: str, key: str) -> int:
        c = self.states.get((coord, key))
        return -1 if c is None else c.length

    def _check(self, job: wire.StageJob) -> None:
        if job.model != self.model or job.slice != self.sid:
            raise BadStageJob(f"stage job {job.job_id} for {job.model} {job.slice}: this "
                              f"server holds {self.model} {self.sid}")  # fmt: skip
        if job.x.shape[1] != self.hidden or job.x.dtype not in ("float32", "float16"):
            raise BadStageJob(f"stage job {job.job_id}: rows {job.x.dtype}{job.x.shape}, want "
                              f"float32 [N, {self.hidden}]")  # fmt: skip
        if not np.isfinite(job.x.array()).all():
            raise BadStageJob(f"stage job {job.job_id}: x holds NaN or infinity")

    def _run(self, job: wire.StageJob) -> np.ndarray:
        bb = self.backbone
        caches = [
            bb.new_cache() if s.start == 0 else self.states[(job.coord, s.key)] for s in job.seqs
        ]
        lens = [s.rows for s in job.seqs]
        x = torch.from_numpy(np.array(job.x.array(), dtype=np.float32)).to(bb.device, bb.dtype)
        with torch.inference_mode():
            y = bb.run_span(x, caches, lens)  # [N, H]
        Backbone.advance_caches(caches, lens)
        for s, c in zip(job.seqs, caches, strict=True):
            key = (job.coord, s.key)
            self.states[key] = c
            self.states.move_to_end(key)
        while len(self.states) > self.max_seqs:
            self.states.popitem(last=False)
            self.evicted += 1
        return np.asarray(y.float().cpu().numpy())  # [N, H]

    def _failed(self, job_id: str, kind: str, message: str, t0: float) -> wire.Result:
        return wire.Result(
            job_id=job_id, worker=self.name, compute_ms=(time.perf_counter() - t0) * 1000,
            error=wire.Failure(kind, message),
        )  # fmt: skip


def warm_up_stage(server: StageServer) -> float:
    """One row through the span on a throwaway cache (page faults and allocator growth here,
    not in the first job, K4). Returns the seconds."""
    t0 = time.monotonic()
    bb = server.backbone
    x = torch.zeros(1, server.hidden, dtype=bb.dtype, device=bb.device)
    with torch.inference_mode():
        bb.run_span(x, [bb.new_cache()], [1])
    return time.monotonic() - t0
