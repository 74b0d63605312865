"""`Shelf`: the slices a worker serves, one `ExpertServer` per model, behind one inbox.

Every job names its model and slice (`wire.Job`); the shelf hands it to the server of that
model, which checks the layers and experts. A job for a model the worker holds no slice of
(one released since it was sent, or a forged one) is answered with a `BadJob` error, as a job
for the wrong slice always was. A worker holds at most one slice per model: the market's
`P:{m:M}:workers` hash maps a worker to one slice id.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kvq import wire
from kvq.worker.server import BAD_JOB, ExpertServer


class Shelf:
    """The servers of worker `name`, keyed by model, with counters that the heartbeat reads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.servers: dict[str, ExpertServer] = {}
        self.nbytes: dict[str, int] = {}  # published bytes of each model's slice
        self.last_job: dict[str, float] = {}  # monotonic time of each model's last job
        self._busy_s, self._rows = 0.0, 0  # of servers dropped since: the totals only grow

    def __len__(self) -> int:
        return len(self.servers)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.servers))

    def add(self, model: str, server: ExpertServer, nbytes: int) -> None:
        self.servers[model], self.nbytes[model] = server, nbytes
        self.last_job[model] = time.monotonic()  # idleness counts from getting the slice

    def drop(self, model: str) -> ExpertServer | None:
        """Forget `model`'s server (its slice was given back); its memory goes with it."""
        sv = self.servers.pop(model, None)
        self.nbytes.pop(model, None)
        self.last_job.pop(model, None)
        if sv is not None:
            self._busy_s += sv.busy_s
            self._rows += sv.rows
        return sv

    @property
    def used_bytes(self) -> int:
        return sum(self.nbytes.values())

    def handle(self, job: wire.Job) -> wire.Result:
        """The result of `job` from the server of its model; never raises."""
        sv = self.servers.get(job.model)
        if sv is None:
            held = ", ".join(f"{m} layers {s.bank.layers}" for m, s in self.servers.items())
            error = wire.Failure(
                type=BAD_JOB,
                message=f"job {job.job_id} for {job.model} slice {job.slice}: this worker "
                f"holds no slice of {job.model}; this server holds {held or 'nothing'}",
            )
            return wire.Result(job_id=job.job_id, worker=self.name, error=error)
        self.last_job[job.model] = time.monotonic()
        return sv.handle(job)

    def step(self, models: set[str]) -> None:
        """B5: a batch with jobs of these models was one engine step of their banks."""
        for m in models:
            sv = self.servers.get(m)
            if sv is not None:
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
