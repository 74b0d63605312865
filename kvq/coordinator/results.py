"""A coordinator's results: one stream per worker (`P:{w:W}:results:C`), read in one `XREAD`.

A worker can write only its own keys (its `kvq acl` user), so the stream a result arrives in says
which worker computed it; `read` returns that worker with each entry.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from kvq.bus import Tail
from kvq.keys import Keys


class WorkerResults:
    """The results streams of the workers this coordinator may hear from."""

    def __init__(self, r: redis.Redis, keys: Keys, coord: str) -> None:
        self.r, self.keys, self.coord = r, keys, coord
        self.tail = Tail(r)
        self._worker_of: dict[str, str] = {}  # stream -> worker

    def key(self, worker: str) -> str:
        return self.keys.worker_results(worker, self.coord)

    def watch(self, workers: Iterable[str]) -> None:
        """Read these workers' streams from now on; each is emptied first (job ids restart with
        each run: an earlier run's results must not match)."""
        fresh = []
        for worker in dict.fromkeys(workers):
            key = self.key(worker)
            if self.tail.watch(key):
                self._worker_of[key] = worker
                fresh.append(key)
        if fresh:
            self.r.delete(*fresh)

    def read(
        self, count: int, block_ms: int | None
    ) -> list[tuple[str, str, bytes, dict[bytes, bytes]]]:
        """New `(worker, stream, id, fields)` entries of every watched stream."""
        return [
            (self._worker_of.get(stream, ""), stream, eid, f)
            for stream, eid, f in self.tail.read_from(count, block_ms)
        ]
