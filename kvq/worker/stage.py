"""`StageServer`: a worker's stage slice (X12), a layer span served whole, with the state of
every sequence that passes through it; `serve_stage_job` runs a stage job over the spans it
names (one, or several consecutive ones held by this worker: `StageJob.then`).

A stage job (`wire.StageJob`) carries the rows of some sequences entering a span; the server
runs the span's blocks over them (attention against each sequence's own cache, the span's
routed experts from its own bytes) and answers the rows leaving it. Each sequence's state
(KV cache, MLA latents, DeltaNet recurrent state, sliding rings) stays here between jobs, keyed
by (coordinator, sequence key), up to `max_seqs` sequences per span (the least recently used
one goes first; its coordinator replays it if it comes back).

A sequence's rows must start where its state ends. One that does not (its state was evicted,
or this worker never saw it: a holder that took over from a dead one) makes the whole job
answer `StateLost` with those keys in `Result.lost`, retryable, before anything is computed or
changed; the coordinator replays them from position 0 (`start` 0 drops any state held). States
advance only after every span of the job has run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch

from kvq import wire
from kvq.bank.server import BAD_JOB, DEADLINE_EXPIRED, NON_FINITE, WRONG_DTYPE
from kvq.device import dtype_name, numerics
from kvq.model import Backbone, KVCache

log = logging.getLogger("kvq.worker")
# a new sequence's cache holds this many positions at first, doubling as it grows: an OLMoE
# span of 6 blocks keeps 16 KB per position and block (K and V), so the engine's usual 256
# would cost 24 MB a sequence before it had written anything
_FIRST_POSITIONS = 32


class StageServer:
    """Serves stage `sid` of `model` (its blocks in `backbone`) for worker `name`."""

    bank = None  # no expert bank to step: the span's experts are in `backbone`

    def __init__(
        self,
        name: str,
        model: str,
        sid: str,
        backbone: Backbone,
        max_seqs: int = 256,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        self.name, self.model, self.sid, self.backbone = name, model, sid, backbone
        self.hidden = backbone.meta.embedding_length
        self.dtype_name = cast(wire.ComputeDType, dtype_name(backbone.dtype, backbone.device))
        self.numerics = numerics(self.dtype_name)  # what fixes its answers' bits
        self.max_seqs, self.clock_ms = max_seqs, clock_ms
        self.states: OrderedDict[tuple[str, str], KVCache] = OrderedDict()
        self.served = 0
        self.last_serve_ms = 0
        self.busy_s = 0.0
        self.rows = 0
        self.evicted = 0  # states dropped for room (their coordinators replay them)

    def handle(self, job: wire.Job | wire.StageJob) -> wire.Result:
        """The answer to a job for this span alone (see `serve_stage_job`); never raises."""
        if not isinstance(job, wire.StageJob):
            error = wire.Failure(BAD_JOB, f"{self.sid} is a stage: no expert jobs")
            return wire.Result(job_id=job.job_id, worker=self.name, error=error)
        return serve_stage_job([self], job)

    def lost(self, coord: str, seqs: Sequence[wire.StageSeq]) -> list[str]:
        """The keys of `seqs` whose rows do not start where their state here ends."""
        out = []
        for s in seqs:
            c = self.states.get((coord, s.key))
            if s.start and (c is None or c.length != s.start):
                out.append(s.key)
        return out

    def caches(self, coord: str, seqs: Sequence[wire.StageSeq]) -> list[KVCache]:
        """Each sequence's state (a new one where `start` is 0), not yet stored."""
        bb = self.backbone
        return [
            bb.new_cache(_FIRST_POSITIONS) if s.start == 0 else self.states[(coord, s.key)]
            for s in seqs
        ]

    def run(self, x: torch.Tensor, caches: list[KVCache], lens: list[int]) -> torch.Tensor:
        """The span over `x` [N, H] (`lens` rows per sequence). Returns [N, H]."""
        t0 = time.perf_counter()
        bb = self.backbone
        with torch.inference_mode():
            y = bb.run_span(x.to(bb.device, bb.dtype), caches, lens)
        self.busy_s += time.perf_counter() - t0
        self.rows += int(x.shape[0])
        return y

    def commit(
        self,
        coord: str,
        seqs: Sequence[wire.StageSeq],
        caches: list[KVCache],
        advanced: bool = False,
    ) -> None:
        """The job ran whole: keep each sequence's advanced state (evicting past `max_seqs`;
        `advanced`: the caches were advanced chunk by chunk already)."""
        if not advanced:
            Backbone.advance_caches(caches, [s.rows for s in seqs])
        for s, c in zip(seqs, caches, strict=True):
            key = (coord, s.key)
            self.states[key] = c
            self.states.move_to_end(key)
        while len(self.states) > self.max_seqs:
            self.states.popitem(last=False)
            self.evicted += 1
        self.served += 1
        self.last_serve_ms = int(self.clock_ms())


def serve_stage_job(servers: list[StageServer], job: wire.StageJob) -> wire.Result:
    """Run `job` through `servers` (its `slice`, then each of `then`, in order) and answer the
    rows leaving the last; a result carrying the error otherwise. Never raises."""
    t0 = time.perf_counter()
    name = servers[0].name

    def failed(kind: str, message: str, retryable: bool = False) -> wire.Result:
        return wire.Result(
            job_id=job.job_id,
            worker=name,
            compute_ms=(time.perf_counter() - t0) * 1000,
            error=wire.Failure(kind, message, retryable),
        )

    try:
        problem = _check(servers, job)
        if problem:
            return failed(BAD_JOB, problem)
        for sv in servers:
            for key in job.drop:
                sv.states.pop((job.coord, key), None)
        dt = servers[0].dtype_name
        if job.want_dtype is not None and job.want_dtype != dt:
            return failed(WRONG_DTYPE, dt)
        if job.deadline_ms and servers[0].clock_ms() > job.deadline_ms:
            return failed(DEADLINE_EXPIRED, f"stage job {job.job_id} past its deadline")
        lost = sorted({k for sv in servers for k in sv.lost(job.coord, job.seqs)})
        if lost:
            return wire.Result(
                job_id=job.job_id,
                worker=name,
                lost=lost,
                error=wire.Failure(wire.STATE_LOST, f"{len(lost)} sequence(s) to replay", True),
            )
        x = torch.from_numpy(np.array(job.x.array(), dtype=np.float32))
        states = [sv.caches(job.coord, job.seqs) for sv in servers]
        out = np.asarray(_run(servers, states, x, job).float().cpu().numpy())  # [N, H]
        if not np.isfinite(out).all():
            return failed(NON_FINITE, f"stage job {job.job_id}: the output overflowed")
        for sv, caches in zip(servers, states, strict=True):
            sv.commit(job.coord, job.seqs, caches, advanced=bool(job.chunks))
    except Exception as exc:  # one job must never stop a server
        log.exception("stage job %s failed", job.job_id)
        return failed(type(exc).__name__, str(exc))
    return wire.Result(
        job_id=job.job_id,
        worker=name,
        y=wire.Tensor.of(out),
        compute_ms=(time.perf_counter() - t0) * 1000,
        dtype=servers[0].dtype_name,
        numerics=servers[0].numerics,
    )


def _run(
    servers: list[StageServer], states: list[list[KVCache]], x: torch.Tensor, job: wire.StageJob
) -> torch.Tensor:
    """The job's rows through every server; a referee's replay (`chunks`) chunk by chunk,
    each chunk's state advanced before the next runs."""
    if not job.chunks:
        lens = [s.rows for s in job.seqs]
        for sv, caches in zip(servers, states, strict=True):
            x = sv.run(x, caches, lens)
        return x
    out, at = [], 0
    for n in job.chunks:
        y = x[at : at + n]
        for sv, caches in zip(servers, states, strict=True):
            y = sv.run(y, caches, [n])
            Backbone.advance_caches(caches, [n])
        out.append(y)
        at += n
    return torch.cat(out)


def _check(servers: list[StageServer], job: wire.StageJob) -> str:
    """Why these servers cannot run `job` ("" if they can)."""
    sids = [job.slice, *job.then]
    if [sv.sid for sv in servers] != sids or any(sv.model != job.model for sv in servers):
        return f"stage job {job.job_id} for {job.model} {sids}: not the spans these servers hold"
    ends = [(sv.backbone.span.start, sv.backbone.span.stop) for sv in servers]
    if any(a[1] != b[0] for a, b in zip(ends, ends[1:], strict=False)):
        return f"stage job {job.job_id}: spans {sids} do not follow one another"
    hidden = servers[0].hidden
    if job.x.shape[1] != hidden or job.x.dtype not in ("float32", "float16"):
        return (
            f"stage job {job.job_id}: rows {job.x.dtype}{job.x.shape}, want float32 [N, {hidden}]"
        )
    if not np.isfinite(job.x.array()).all():
        return f"stage job {job.job_id}: x holds NaN or infinity"
    return ""


def warm_up_stage(server: StageServer) -> float:
    """One row through the span on a throwaway cache (page faults and allocator growth here,
    not in the first job, K4). Returns the seconds."""
    t0 = time.monotonic()
    bb = server.backbone
    x = torch.zeros(1, server.hidden, dtype=bb.dtype, device=bb.device)
    with torch.inference_mode():
        bb.run_span(x, [bb.new_cache()], [1])
    return time.monotonic() - t0
