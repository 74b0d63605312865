"""`Inbox`: the worker's own job stream, read in batches through its consumer group.

Each job goes to the server of its model and slice on the shelf (`kvq.worker.shelf`); a
batch's results are written and its entries acknowledged in one round trip, the next read
with them. Entries that do not decode, jobs that cannot be served and results that cannot be
written go to the dead-letter stream with the reason: no entry stops the worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from kvq import wire
from kvq.bank.server import BAD_JOB
from kvq.bus import Consumer, dead_letter, is_connection_error
from kvq.bus.outage import refusal
from kvq.bus.redis_board import RedisBoard
from kvq.errors import WireError
from kvq.keys import WORKER_GROUP
from kvq.worker.backlog import Backlog
from kvq.worker.shelf import Shelf

log = logging.getLogger("kvq.worker")
BATCH = 32  # inbox entries read at once


class Inbox:
    """Worker `worker_id`'s inbox, open while it holds a slice: jobs in, results out."""

    def __init__(
        self, board: RedisBoard, worker_id: str, shelf: Shelf, plate: Backlog, dead_key: str
    ) -> None:
        """`plate`: the backlog the heartbeat reports; `dead_key`: the dead-letter stream
        its entries go to (its own under its own ACL user, `kvq.bus.deadletters.relay`)."""
        self.board, self.id, self.shelf, self.plate = board, worker_id, shelf, plate
        self._dead_key = dead_key
        self.consumer: Consumer | None = None  # None: closed (it holds no slice)

    def open(self) -> None:
        """Join the inbox's group (made if need be), if not joined yet."""
        if self.consumer is None:
            inbox = self.board.keys.worker_inbox(self.id)
            self.consumer = Consumer(self.board.r, inbox, WORKER_GROUP, self.id)

    def close(self) -> None:
        """Its last slice went: it reads no more until the next one."""
        self.consumer = None

    def reset_pending(self) -> None:
        """After Redis failed a pass: the jobs read but not answered are read again."""
        if self.consumer is not None:
            self.consumer.reset_pending()

    def serve_batch(self, block_ms: int) -> None:
        """Read up to `BATCH` jobs (blocking up to `block_ms`), serve them and answer them."""
        assert self.consumer is not None and self.shelf
        entries = self.consumer.read(count=BATCH, block_ms=block_ms)
        jobs = [(eid, fields, self._decode(eid, fields)) for eid, fields in entries]
        plate = self.plate
        # decoded before serving: the heartbeat reports the batch's rows per coordinator
        plate.read([(job.coord, _rows(job)) for _, _, job in jobs if job is not None])
        served: list[_Served] = []
        try:
            for eid, fields, job in jobs:
                if job is not None:
                    plate.start(job.coord, _rows(job))
                    served.append(self._serve_one(eid, fields, job))
                    plate.done()
        finally:
            plate.read([])
        self._answer(served, block_ms)
        # B5: a batch of jobs is the engine step of the banks it used
        self.shelf.step({(job.model, job.slice) for _, _, job in jobs if job is not None})

    def _decode(self, eid: bytes, fields: dict[bytes, bytes]) -> wire.Job | wire.StageJob | None:
        """The entry's job (an expert job, or a stage job: its `t` says so), or None after
        dead-lettering an entry that does not decode."""
        try:
            if wire.is_stage_job(fields):
                return wire.decode(fields, wire.StageJob)
            return wire.decode(fields, wire.Job)
        except WireError as exc:
            self._dead_letter(eid, fields, str(exc))
            return None

    def _serve_one(
        self, eid: bytes, fields: dict[bytes, bytes], job: wire.Job | wire.StageJob
    ) -> _Served:
        """Compute one job's result (answered with its batch, `_answer`). A job that cannot
        be served (a slice this worker does not hold, rows of the wrong shape) is dead-lettered
        with the reason and still answered, so that its coordinator hears at once."""
        # always this worker's own results stream for the job's coordinator, whatever
        # `reply_to` says (a job moved here from a dead peer names the peer's): results are
        # attributed by where they arrive, and a forged job cannot aim a result elsewhere
        own = self.board.keys.worker_results(self.id, job.coord)
        result = self.shelf.handle(job)
        if result.error is not None and result.error.type == BAD_JOB:
            self._dead_letter(eid, fields, result.error.message, ack=False)
        return _Served(eid, fields, own, wire.encode(result))

    def _answer(self, served: list[_Served], block_ms: int) -> None:
        """Write a batch's results, ack its entries and start the next read, in one round
        trip: a lone worker with a layer's four jobs waits one RTT for them, not four, and
        listens again as its answers land (`Consumer.answer_and_read`). No entry stops the
        worker: one whose result cannot be written (its `coord` names a key of another type,
        or one outside this worker's ACL) is dead-lettered with the reason. Its entry is acked
        by then, with the others: a crash in between loses that one job, which its
        coordinator times out on as on any unanswered job."""
        assert self.consumer is not None
        if not served:
            return
        ttl_s = self.board.lifetimes.coordinator_s()  # outlives no coordinator it serves
        appends = [(s.results, s.encoded, ttl_s) for s in served]
        eids, maxlen = [s.eid for s in served], self.board.maxlen
        errors = self.consumer.answer_and_read(appends, eids, maxlen, BATCH, block_ms)
        for s, exc in zip(served, errors, strict=True):
            if exc is None:
                continue
            if is_connection_error(exc) or refusal(exc):  # the loop waits it out: one log line
                raise exc
            reason = f"cannot write the result to {s.results!r}: {_redis_reason(exc)}"
            self._dead_letter(s.eid, s.fields, reason, ack=False)

    def _dead_letter(
        self, eid: bytes, fields: dict[bytes, bytes], reason: str, ack: bool = True
    ) -> None:
        """Park the entry with its reason (on its own dead-letter stream under its ACL user);
        if even that is refused, log it: the entry is still acknowledged, never retried
        forever."""
        assert self.consumer is not None
        try:
            dead_letter(
                self.board.r,
                self.board.keys,
                self.consumer.stream,
                eid,
                fields,
                reason,
                self.board.maxlen,
                self._dead_key,
            )
        except redis.RedisError as exc:
            if is_connection_error(exc) or refusal(exc):
                raise
            log.error("cannot dead-letter %s (%s): %s", eid.decode(), reason, _redis_reason(exc))
        if ack:
            self.consumer.ack(eid)
        log.warning("dead-lettered %s: %s", eid.decode(), reason)


@dataclass(frozen=True, slots=True)
class _Served:
    """A job's result, computed and not yet written: its entry, where the result goes."""

    eid: bytes
    fields: dict[bytes, bytes]
    results: str  # this worker's results stream for the job's coordinator
    encoded: dict[str, bytes | str]


def _rows(job: wire.Job | wire.StageJob) -> int:
    return int(job.x.shape[0]) if job.x.shape else 0


def _redis_reason(exc: redis.RedisError) -> str:
    """The server's own words, without redis-py's pipeline preamble (which quotes the
    command's binary arguments)."""
    text = str(exc)
    _, sep, tail = text.partition(" of pipeline caused error: ")
    return f"{type(exc).__name__}: {tail if sep else text}"
