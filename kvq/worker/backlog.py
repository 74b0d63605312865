"""What a worker has on its plate, for its heartbeat (issue 10 item 3).

A coordinator's capacity split prices each worker by what it measured itself; it cannot see
rows that other coordinators queued on the same worker. The worker can: it reads its inbox in
batches, decodes a batch before serving it, and so knows the rows of the job it computes
(`busy`) and of the jobs read but not started (`queued`), per coordinator. Entries still
unread in its inbox are known only by count (its consumer group's lag, asked only when a read
came back full: otherwise the inbox was empty when it read) and are priced at its mean rows
per job. The heartbeat carries the total and the per-coordinator part
it knows, so a coordinator can leave its own rows out (`kvq.coordinator.routing`).
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
    unread_jobs: int = 0  # entries left in the inbox after the last read

    def by_coord_text(self) -> str:
        """`by_coord` as the heartbeat's JSON field (sorted, compact)."""
        return json.dumps(self.by_coord, sort_keys=True, separators=(",", ":"))


class Backlog:
    """Rows the worker holds, updated by the serving loop, read by the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: Counter[str] = Counter()
        self._busy: tuple[str, int] | None = None
        self._unread = 0

    def read(self, jobs: list[tuple[str, int]], unread: int = 0) -> None:
        """A batch `(coordinator, rows)` was read, `unread` entries left behind; whatever
        was left of the last batch is not there any more (a failed batch is read again from
        the pending entries)."""
        with self._lock:
            self._unread = unread
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

    def view(self) -> BacklogView:
        with self._lock:
            by = Counter(self._queued)
            busy = 0
            if self._busy is not None:
                by[self._busy[0]] += self._busy[1]
                busy = self._busy[1]
            return BacklogView(busy, sum(self._queued.values()), dict(by), self._unread)
