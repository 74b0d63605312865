"""`Shelf`: the slices a worker serves, one `ExpertServer` per slice (a `StageServer` per
stage slice), behind one inbox.

Every job names its model and slice (`wire.Job`); the shelf hands it to the server of that
slice, which checks the layers and experts. A job for a slice the worker does not hold (one
released since it was sent, or a forged one) is answered with a `BadJob` error, as a job for
the wrong slice always was. A worker may hold several slices of one model:
the market's `P:{m:M}:workers` hash lists every slice id it holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kvq import wire
from kvq.bank.server import BAD_JOB, ExpertServer
from kvq.worker.stage import StageServer, serve_stage_job

Key = tuple[str, str]  # (model, slice id)
Server = ExpertServer | StageServer  # an expert slice's, or a stage slice's (X12)


class Shelf:
    """The servers of worker `name`, keyed by (model, slice id), with counters that the
    heartbeat reads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.servers: dict[Key, Server] = {}
        self.nbytes: dict[Key, int] = {}  # published bytes of each slice
        self.last_job: dict[Key, float] = {}  # monotonic time of each slice's last job
        self._busy_s, self._rows = 0.0, 0  # of servers dropped since: the totals only grow

    def __len__(self) -> int:
        return len(self.servers)

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self.servers))

    def models(self) -> set[str]:
        return {m for m, _ in self.servers}

    def add(self, model: str, sid: str, server: Server, nbytes: int) -> None:
        key = (model, sid)
        self.servers[key], self.nbytes[key] = server, nbytes
        self.last_job[key] = time.monotonic()  # idleness counts from getting the slice

    def drop(self, model: str, sid: str) -> Server | None:
        """Forget the slice's server (it was given back); its memory goes with it."""
        key = (model, sid)
        sv = self.servers.pop(key, None)
        self.nbytes.pop(key, None)
        self.last_job.pop(key, None)
        if sv is not None:
            self._busy_s += sv.busy_s
            self._rows += sv.rows
        return sv

    @property
    def used_bytes(self) -> int:
        return sum(self.nbytes.values())

    def handle(self, job: wire.Job | wire.StageJob) -> wire.Result:
        """The result of `job` from the server of its slice; never raises."""
        key = (job.model, job.slice)
        sv = self.servers.get(key)
        if sv is None:
            mine = sorted(s for m, s in self.servers if m == job.model)
            where = (
                f"this worker holds no slice of {job.model}"
                if not mine
                else f"this worker holds slice(s) {', '.join(mine)} of {job.model}, not that one"
            )
            held = ", ".join(
                f"{m} layers {sv.bank.layers if sv.bank else []}"
                for (m, _), sv in self.servers.items()
            )
            error = wire.Failure(
                type=BAD_JOB,
                message=f"job {job.job_id} for {job.model} slice {job.slice}: {where}; "
                f"this server holds {held or 'nothing'}",
            )
            return wire.Result(job_id=job.job_id, worker=self.name, error=error)
        self.last_job[key] = time.monotonic()
        if isinstance(job, wire.StageJob):
            return self._stage(job)
        return sv.handle(job)

    def _stage(self, job: wire.StageJob) -> wire.Result:
        """A stage job through the stage servers of every span it names, in order."""
        servers = []
        for sid in (job.slice, *job.then):
            sv = self.servers.get((job.model, sid))
            if not isinstance(sv, StageServer):
                what = "an expert slice" if sv is not None else "not held here"
                error = wire.Failure(BAD_JOB, f"stage job {job.job_id}: {sid} is {what}")
                return wire.Result(job_id=job.job_id, worker=self.name, error=error)
            self.last_job[(job.model, sid)] = time.monotonic()
            servers.append(sv)
        return serve_stage_job(servers, job)

    def step(self, slices: set[Key]) -> None:
        """B5: a batch with jobs of these slices was one engine step of their banks."""
        for key in slices:
            sv = self.servers.get(key)
            if sv is not None and sv.bank is not None:
                sv.bank.step()

    # -- what the heartbeat reports ----------------------------------------------------------
    def served(self) -> tuple[int, int]:
        """(jobs served, last_serve_ms) of the slices held now: a worker that gave back every
        slice starts unproven again with its next one, as it always did."""
        svs = self.servers.values()
        return sum(s.served for s in svs), max((s.last_serve_ms for s in svs), default=0)

    def work(self) -> tuple[float, int]:
        """(seconds computing, rows computed) since the worker started, all slices."""
        svs = self.servers.values()
        return self._busy_s + sum(s.busy_s for s in svs), self._rows + sum(s.rows for s in svs)
