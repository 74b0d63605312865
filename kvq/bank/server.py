"""`ExpertServer`: a decoded expert job in, a result out. No Redis, no threads.

The worker's loop is read → `server.handle(job)` → write the result → ack. The coordinator
computes its local slices through the same `terms`, so local and remote agree bit for bit
when they compute in the same dtype: a job's result is one row per (row, expert) pair inside
its slice, which the coordinator adds in its fixed order (`kvq.model.moe_sum`). `handle` never raises: a job it cannot serve comes back as
a result whose `error` says why (`BadJob` for the job itself, `DeadlineExpired`, `NonFinite`
output, or the exception of a failed compute).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from kvq import wire
from kvq.bank import Bank
from kvq.device import dtype_name
from kvq.errors import BadJob, ModelError
from kvq.model.moe_sum import expert_terms

log = logging.getLogger("kvq.worker")

BAD_JOB = "BadJob"
DEADLINE_EXPIRED = "DeadlineExpired"
NON_FINITE = "NonFinite"
WRONG_DTYPE = "WrongDType"  # the job asks for a compute path this worker does not run; the
# message is the one it runs (the coordinator may ask for it next: `Verifier.refused`)
_FLOATS = ("float32", "float16")


class ExpertServer:
    """Serves the experts of `bank` (some layers, each an expert range) of `model`."""

    def __init__(
        self,
        name: str,
        model: str,
        bank: Bank | None,
        hidden: int,
        dtype: torch.dtype,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
    ) -> None:
        self.name, self.model, self.bank, self.hidden = name, model, bank, hidden
        self.dtype = dtype  # what jobs' activations are cast to before compute
        device = bank.device if bank is not None else "cpu"
        self.dtype_name = cast(wire.ComputeDType, dtype_name(dtype, device))  # in each result
        self.clock_ms = clock_ms
        self.served = 0
        self.last_serve_ms = 0
        self.busy_s = 0.0  # seconds spent computing jobs (the heartbeat derives load from it)
        self.rows = 0  # token rows computed

    def compute(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, lo: int, hi: int
    ) -> torch.Tensor:
        """Sum over each row's experts in `[lo, hi)` of `w * expert(x)`. x: [T, H]; ids, w:
        [T, k]. Returns [T, H] in x.dtype, on x.device."""
        if self.bank is None:  # a backbone-only coordinator: its dispatch never asks this
            raise ModelError(f"{self.name} holds no routed experts (a backbone file)")
        with torch.inference_mode():
            return self.bank.forward(layer, x, ids, w, lo, hi)

    def terms(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, lo: int, hi: int
    ) -> torch.Tensor:
        """Each (row, expert) pair's term `w * expert(x)` for the experts in `[lo, hi)`, in
        row-major (row, choice) order (`kvq.model.moe_sum.expert_terms`): what a coordinator
        adds in its fixed order. x: [T, H]; ids, w: [T, k]. Returns [P, H]."""

        def forward(xp: torch.Tensor, ip: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
            return self.compute(layer, xp, ip, wp, lo, hi)  # [P, H]

        return expert_terms(x, ids, w, lo, hi, forward)

    def handle(self, job: wire.Job) -> wire.Result:
        """The job's result, or a result carrying the error; never raises."""
        t0 = time.perf_counter()
        try:
            self.check(job)
            if job.want_dtype is not None and job.want_dtype != self.dtype_name:
                # an honest worker never sends a result the coordinator did not ask for
                error = wire.Failure(type=WRONG_DTYPE, message=self.dtype_name)
                return self._failed(job, error, t0)
            if job.deadline_ms and self.clock_ms() > job.deadline_ms:
                # the coordinator has computed it locally already; say so instead of working
                error = wire.Failure(
                    type=DEADLINE_EXPIRED, message=f"job {job.job_id} past its deadline"
                )
                return self._failed(job, error, t0)
            out = self._run(job)
            if not np.isfinite(out).all():  # overflow: a wrong answer must not look right
                bad = int((~np.isfinite(out)).sum())
                error = wire.Failure(
                    type=NON_FINITE,
                    message=f"job {job.job_id}: output overflowed ({bad} of {out.size} values "
                    f"NaN or infinite, computing in {self.dtype_name}); not sent",
                )
                return self._failed(job, error, t0)
            y = wire.Tensor.of(out)
            result = wire.Result(
                job_id=job.job_id,
                worker=self.name,
                y=y,
                compute_ms=(time.perf_counter() - t0) * 1000,
                dtype=self.dtype_name,
            )
        except BadJob as exc:
            return self._failed(job, wire.Failure(type=BAD_JOB, message=str(exc)), t0)
        except Exception as exc:  # one job must never stop a server
            log.exception("job %s failed", job.job_id)
            return self._failed(job, wire.failure(exc), t0)
        self.served += 1
        self.last_serve_ms = int(self.clock_ms())
        self.busy_s += time.perf_counter() - t0
        self.rows += int(job.x.shape[0])
        return result

    def check(self, job: wire.Job) -> None:
        """BadJob unless this server holds the job's experts and its shapes fit."""
        if self.bank is None:
            raise BadJob(f"job {job.job_id}: {self.name} holds no routed experts")
        if job.model != self.model or job.layer not in self.bank.layers:
            raise BadJob(
                f"job {job.job_id} for {job.model} layer {job.layer}: this server holds "
                f"{self.model} layers {self.bank.layers}"
            )
        lo, hi = self.bank.expert_range(job.layer)
        if not lo <= job.expert_start < job.expert_end <= hi:
            raise BadJob(
                f"job {job.job_id} experts [{job.expert_start},{job.expert_end}) are not inside "
                f"[{lo},{hi}) of layer {job.layer}"
            )
        if job.x.shape[1] != self.hidden:
            raise BadJob(f"job {job.job_id}: hidden size {job.x.shape[1]} != {self.hidden}")
        if job.x.dtype not in _FLOATS or job.weights.dtype not in _FLOATS:
            raise BadJob(f"job {job.job_id}: x and weights must be floating point")
        ids = job.ids.array()
        if ids.dtype.kind not in "iu":
            raise BadJob(f"job {job.job_id}: expert ids must be integers, got {ids.dtype}")
        for name, t in (("x", job.x), ("weights", job.weights)):
            if not np.isfinite(t.array()).all():
                raise BadJob(f"job {job.job_id}: {name} holds NaN or infinity")

    def _run(self, job: wire.Job) -> np.ndarray:
        assert self.bank is not None  # `check` refused the job otherwise
        dev, dtype = self.bank.device, self.dtype
        x = torch.from_numpy(np.array(job.x.array(), dtype=np.float32)).to(dev, dtype)
        ids = torch.from_numpy(np.array(job.ids.array(), dtype=np.int64)).to(dev)
        w = torch.from_numpy(np.array(job.weights.array(), dtype=np.float32)).to(dev, dtype)
        # a v1 job (a coordinator that predates per-pair terms) wants each row's sum
        run = self.terms if job.v >= 2 else self.compute
        y = run(job.layer, x, ids, w, job.expert_start, job.expert_end)
        return y.float().cpu().numpy()  # [P, H] (v1: [T, H])

    def _failed(self, job: wire.Job, error: wire.Failure, t0: float) -> wire.Result:
        ms = (time.perf_counter() - t0) * 1000
        return wire.Result(job_id=job.job_id, worker=self.name, compute_ms=ms, error=error)
