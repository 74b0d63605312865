"""What a worker has on its plate, for its heartbeat.

A coordinator's capacity split prices each worker by what it measured itself; it cannot see
rows that other coordinators queued on the same worker. The worker can: it reads its inbox in
batches, decodes a batch before serving it, and so knows the rows of the job it computes
(`busy`) and of the jobs read but not started (`queued`), per coordinator. Entries still
unread in its inbox are known only by count: each heartbeat reads the inbox's length in its
own round trip (answered entries are deleted, so the length less the batch's unanswered jobs
is what waits unread), used by the next beat and priced at the worker's mean rows per job.
The heartbeat carries the total and the per-coordinator part it knows, so a coordinator can
leave its own rows out (`kvq.coordinator.routing`).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BacklogView:
    busy_rows: int  # rows of the job being computed
    queued_rows: int  # rows read and not started (the unread inbox is added by the beat)
    by_coord: dict[str, int]  # busy + queued rows per coordinator
    jobs: int = 0  # jobs of the batch not answered yet (busy included)

    def by_coord_text(self) -> str:
        """`by_coord` as the heartbeat's JSON field (sorted, compact)."""
        return json.dumps(self.by_coord, sort_keys=True, separators=(",", ":"))


class Backlog:
    """Rows the worker holds, updated by the serving loop, read by the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: Counter[str] = Counter()
        self._busy: tuple[str, int] | None = None
        self._jobs = 0

    def read(self, jobs: list[tuple[str, int]]) -> None:
        """A batch `(coordinator, rows)` was read; whatever was left of the last one is not
        there any more (a failed batch is read again from the pending entries)."""
        with self._lock:
            self._jobs = len(jobs)
            self._queued = Counter()
            for coord, rows in jobs:
                self._queued[coord] += rows
            self._busy = None

    def start(self, coord: str, rows: int) -> None:
        with self._lock:
            self._queued[coord] -= rows
            if self._queued[coord] <= 0:
                del self._queued[coord]
            self._busy = (coord, rows)

    def done(self) -> None:
        with self._lock:
            self._busy = None
            self._jobs = max(0, self._jobs - 1)

    def view(self) -> BacklogView:
        with self._lock:
            by = Counter(self._queued)
            busy = 0
            if self._busy is not None:
                by[self._busy[0]] += self._busy[1]
                busy = self._busy[1]
            return BacklogView(busy, sum(self._queued.values()), dict(by), self._jobs)
