"""A coordinator's remote jobs: out to the workers' inboxes, results back, each to its owner.

The mailbox names jobs (ids that are tokens), posts them, and reads the workers' results
streams. It decides whom a result counts for and hands it over as a value: a `Delivery` for the
layer call that waits for the job (kept until that call collects, when another call's read
brought it), or for the dispatcher when the job was a trial nobody waits for. It never calls
into a layer call: calls pull their deliveries (`collect`), so values only go down, from the
dispatcher to its calls and from the calls to the mailbox.

Attribution: who answered is the stream the result arrived in, never the result's `worker`
field: the worker the job went to, or a peer of its slice the monitor moved it to when that
worker died. The job id is the token that proves it (`next_job_id`), so a peer cannot answer
a job that was not moved to it; a result from any other stream is counted foreign and dropped,
and the job is still waited for.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import redis

from kvq import wire
from kvq.bus import dead_letter
from kvq.bus.board import Board, Fields
from kvq.bus.peers import blame
from kvq.bus.records import DispatchCounters
from kvq.coordinator.pending import Pending
from kvq.coordinator.results import WorkerResults
from kvq.errors import WireError
from kvq.keys import Keys

log = logging.getLogger("kvq.coordinator")

READ_COUNT = 256  # results read per XREAD
JUNK_PER_MINUTE = 16  # undecodable results dead-lettered per worker and minute; others dropped


@dataclass(frozen=True)
class Delivery:
    """A result for one of this coordinator's jobs, from `sender` (the stream it arrived in)."""

    job_id: str
    sender: str
    eid: bytes  # its entry id: Redis's clock when it was stored (`latency_ms`)
    result: wire.Result
    pending: Pending  # the job as it was sent


class Mailbox:
    """Jobs out and results in for one coordinator. `holders()`: the slices each worker
    serves (the routing view), to accept a moved job's answer from a peer of its slice."""

    def __init__(
        self,
        board: Board,
        r: redis.Redis,
        keys: Keys,
        coord: str,
        holders: Callable[[], Mapping[str, Collection[str]]],
        stats: DispatchCounters,
        maxlen: int = 10_000,
        results: WorkerResults | None = None,
    ) -> None:
        self.board, self.r, self.keys, self.coord = board, r, keys, coord
        self.holders, self.stats, self.maxlen = holders, stats, maxlen
        self.results = results or WorkerResults(r, keys, coord)
        self._seq = itertools.count()
        self._waiting: dict[str, tuple[object, Pending]] = {}  # job id -> (its call, the job)
        self._trials: dict[str, Pending] = {}  # trial or probe jobs nobody waits for (K4)
        self._parked: dict[object, list[Delivery]] = {}  # call -> deliveries read for it
        self._answered: list[Delivery] = []  # trial answers, for the dispatcher
        self._junk_minute = 0
        self._junk_seen: dict[str, int] = {}  # undecodable results per sender, this minute

    def next_job_id(self) -> str:
        """`C:N:TOKEN`: the sequence number for people, and 64 random bits that make the id
        the job's token: only the worker whose inbox it went to (its ACL user alone reads it),
        or the peer the monitor moved it to, knows it; no other worker can answer the job.
        A sequence alone let a peer of the slice answer its neighbours' jobs."""
        return f"{self.coord}:{next(self._seq)}:{secrets.token_hex(8)}"

    def results_key(self, worker: str) -> str:
        return self.results.key(worker)

    def post(self, jobs: list[tuple[str, Fields]], watch: Iterable[str] = ()) -> None:
        """Post `(worker, job)` pairs; the results of those workers and of `watch` (every
        worker serving this model: the monitor may move a dead worker's jobs to a peer of its
        slice) are read from then on."""
        self.results.watch([*(w for w, _ in jobs), *watch])
        self.board.send_jobs(jobs)

    def expect(self, job_id: str, p: Pending, call: object) -> None:
        """`call` waits for job `job_id`'s result."""
        self._waiting[job_id] = (call, p)

    def expect_trial(self, job_id: str, p: Pending) -> None:
        """A trial or re-probe: its answer goes to `answered_trials`, nobody waits for it."""
        self._trials[job_id] = p

    def forget(self, job_id: str) -> None:
        """A job its call stopped waiting for (missed its deadline): an answer is late now."""
        self._waiting.pop(job_id, None)

    @property
    def has_trials(self) -> bool:
        return bool(self._trials)

    def collect(self, call: object, block_ms: int | None) -> list[Delivery]:
        """`call`'s deliveries: those an earlier read brought for it, else what one read of
        the results streams (blocking up to `block_ms`; None: not at all) brings for it.
        Whatever else that read brings is kept for its owner."""
        mine = self._parked.pop(call, [])
        if mine:
            return mine
        for sender, stream, eid, fields in self.results.read(READ_COUNT, block_ms):
            self.take(sender, stream, eid, fields)
        return self._parked.pop(call, [])

    def take(self, sender: str, stream: str, eid: bytes, fields: dict[bytes, bytes]) -> None:
        """Sort one entry of `sender`'s results stream: kept for the call that waits for it or
        for the dispatcher (a trial's), or counted foreign, late or dead-lettered."""
        try:
            res = wire.decode(fields, wire.Result)
        except WireError as exc:
            self._junk(sender, stream, eid, fields, str(exc))
            return
        waiting = self._waiting.get(res.job_id)
        p = self._trials.get(res.job_id) or (waiting[1] if waiting is not None else None)
        if (
            p is not None
            and sender != p.worker
            and p.spec.sid not in self.holders().get(sender, ())
        ):
            self.stats.foreign_results += 1
            log.warning(
                "result for job %s sent to %s arrived from %s; ignored",
                res.job_id,
                p.worker,
                sender,
            )
            return
        trial = self._trials.pop(res.job_id, None)
        if trial is not None:
            self._answered.append(Delivery(res.job_id, sender, eid, res, trial))
            return
        waiting = self._waiting.pop(res.job_id, None)
        if waiting is None:  # duplicate or late: the job was already answered once
            self.stats.late_results += 1
            return
        call, p = waiting
        self._parked.setdefault(call, []).append(Delivery(res.job_id, sender, eid, res, p))

    def _junk(
        self, sender: str, stream: str, eid: bytes, fields: dict[bytes, bytes], why: str
    ) -> None:
        """Dead-letter an entry that is no result, up to JUNK_PER_MINUTE per sender: a worker
        that floods its results stream costs one round trip per read, not one per entry."""
        minute = int(time.monotonic() // 60)
        if self._junk_minute != minute:
            self._junk_minute, self._junk_seen = minute, {}
        n = self._junk_seen[sender] = self._junk_seen.get(sender, 0) + 1
        if n <= JUNK_PER_MINUTE:
            dead_letter(self.r, self.keys, stream, eid, fields, why, self.maxlen)
        else:
            blame(stream, f"over {JUNK_PER_MINUTE} entries a minute that are no result", sender)

    def answered_trials(self) -> list[Delivery]:
        """The trial answers read since the last call."""
        out, self._answered = self._answered, []
        return out

    def expired_trials(self, deadline_ms: float) -> list[Pending]:
        """Trials unanswered for `deadline_ms`, no longer waited for."""
        now = time.monotonic()
        gone = [j for j, p in self._trials.items() if (now - p.sent_at) * 1000 > deadline_ms]
        return [self._trials.pop(j) for j in gone]
