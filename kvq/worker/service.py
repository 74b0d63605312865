"""The worker process: volunteer → download → register → serve, over outbound Redis only.

Life cycle:
1. idle: poll every model's demand through the atomic volunteer script (K9, K11); holding no
   slice for `KVQ_IDLE_SHUTDOWN_S` (> 0) it exits;
2. given a slice: fetch exactly its bytes, verify checksums, decode into tensors, and run
   each expert once (warm-up) before announcing "serving", so first results are warm (K4);
   then it keeps volunteering, at once after each slice it loads, for slices it does not hold
   while its memory budget has room (`kvq.worker.budget`) and some slice has demand: it may
   serve several slices, of one model or of several;
3. heartbeat on a thread (a key that expires), re-asserting every slice after a reap or a
   Redis restart;
4. serve: XREADGROUP BLOCK on its own inbox, pending entries first; each job goes to the server
   of its model and slice (`kvq.worker.shelf`); its result is written before the job is acknowledged;
   malformed entries go to the dead-letter stream;
5. wind-down (K10), per slice: no job for a slice for `KVQ_IDLE_RELEASE_S` while it is covered
   beyond its target → give it back and drop it from memory; with none left, back to 1.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import redis

from kvq import wire
from kvq.bank import BankOptions
from kvq.bank.server import BAD_JOB, ExpertServer
from kvq.bus import Backoff, Consumer, dead_letter, is_connection_error
from kvq.bus.market import Market, MarketDoor
from kvq.bus.outage import Outage, refusal, run_until_stopped
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings, WorkerSettings
from kvq.device import pick_device
from kvq.errors import BankError, ConfigError, KvqError, WireError
from kvq.keys import WORKER_GROUP, check_id
from kvq.quant import kernels
from kvq.security.acl import user_name
from kvq.worker.budget import Budget
from kvq.worker.loader import Fingerprint, Loaded, Loader, TamperedSource
from kvq.worker.membership import Held, Membership
from kvq.worker.shelf import Shelf
from kvq.worker.stage import StageServer

log = logging.getLogger("kvq.worker")
_BATCH = 32  # inbox entries read at once
_LOADING_BLOCK_MS = 20  # the inbox read's block while a slice loads beside the serving


class Worker:
    """One worker; `run()` until `stop` is set (or it idles out)."""

    def __init__(
        self,
        board: RedisBoard,
        settings: WorkerSettings,
        bank: BankOptions,
        worker_id: str,
        market: Market | None = None,
        instance: str | None = None,
    ) -> None:
        self.board, self.s, self.bank_options = board, settings, bank
        self.id = check_id("worker id", worker_id)
        self.device = pick_device(settings.device)
        self.budget = Budget.of(settings, self.device)
        self.shelf = Shelf(self.id)
        self.consumer: Consumer | None = None
        self.membership = Membership(
            board,
            worker_id,
            str(self.device),
            self.shelf.served,
            self.shelf.work,
            market,
            instance,
            kernels=kernels.describe(self.device.type),
        )
        self.stop = threading.Event()
        self._idle_since = time.monotonic()  # holding no slice since
        self._next_ask = 0.0  # monotonic time of the next volunteer ask
        self.loader = Loader(
            board,
            self.id,
            self.device,
            settings.compute_dtype,
            settings.download_timeout_s,
            bank,
            settings.stage_max_seqs,
        )
        self._loader: threading.Thread | None = None  # asking and loading beside the serving
        self._loads: queue.SimpleQueue[_Found] = queue.SimpleQueue()
        self._loading = threading.Event()  # the volunteer thread is loading (not just asking)
        # after a failed load: volunteer_poll_s doubled per failure, up to load_retry_max_s
        self._load_backoff = Backoff(settings.load_retry_max_s, settings.volunteer_poll_s)
        self._tampered: set[Fingerprint] = set()  # slices whose source failed their checksums
        # under its own ACL user (the market through the monitor) its dead letters go to its
        # own stream, which the monitor moves to the shared one (`kvq.bus.deadletters.relay`)
        keys = board.keys
        self._dead_key = keys.worker_dead(self.id) if market is not None else keys.deadletter()

    @classmethod
    def from_settings(cls, settings: Settings, worker_id: str) -> Worker:
        check_id("worker id", worker_id)
        board = open_board(settings.bus, settings.lifetimes)
        instance = uuid.uuid4().hex
        market: Market | None = None
        if _through_monitor(board, settings.worker.market, worker_id):
            market = MarketDoor(
                board.r, board.keys, instance, settings.worker.market_wait_s, board.maxlen
            )
        bank = BankOptions.from_settings(settings)
        return cls(board, settings.worker, bank, worker_id, market, instance)

    @property
    def holding(self) -> Held | None:
        """The slice loaded last (None: it serves none)."""
        return self.membership.held

    @property
    def holdings(self) -> list[Held]:
        """Every slice it serves, in the order loaded."""
        return list(self.membership.holds.values())

    @property
    def server(self) -> ExpertServer | StageServer | None:
        """The server of the slice loaded last."""
        h = self.holding
        return self.shelf.servers.get((h.model, h.sid)) if h is not None else None

    @property
    def served(self) -> int:
        """Jobs served by the slices it holds now."""
        return self.shelf.served()[0]

    # -- main loop -----------------------------------------------------------------------
    def run(self) -> None:
        outage = Outage(log, self.s.reconnect_max_s)
        self.membership.claim(self.board.lifetimes.claim_wait_s())
        self.membership.start()
        models = self.board.models()
        log.info(
            "ready: worker %s on %s (%s) volunteers for slices of %s",
            self.id,
            self.device,
            self.membership.kernels,
            ", ".join(models) if models else "the models a monitor registers",
        )
        try:
            run_until_stopped(self.stop, self._turn, outage, after_failure=self._reread_pending)
        finally:
            self.stop.set()
            self.membership.close()
            held, served = len(self.shelf), self.served
            self.membership.leave()
            log.info(
                "stopped: worker %s gave back %d slice(s) after %d job(s) served on them",
                self.id,
                held,
                served,
            )

    def _turn(self) -> None:
        """One pass of the serving loop: install what the volunteer thread loaded, ask for a
        slice when due, serve a batch of jobs (or idle a poll)."""
        self._install_loaded()
        self._unload_removed()
        took = self._volunteer() if self._volunteer_due() else False
        if self.shelf:
            self._serve_batch()
        elif not took:
            self._maybe_idle_out()
            self.stop.wait(self.s.volunteer_poll_s)

    def _unload_removed(self) -> None:
        """Drop the servers of slices whose model was removed (`Membership.take_dropped`)."""
        for h in self.membership.take_dropped():
            self.shelf.drop(h.model, h.sid)
            self._next_ask = 0.0
        if not self.shelf and self.consumer is not None:
            self.consumer = None
            self._idle_since = time.monotonic()

    def _reread_pending(self) -> None:
        """After Redis failed a pass: the jobs read but not answered are read again."""
        if self.consumer is not None:
            self.consumer.reset_pending()

    def _maybe_idle_out(self) -> None:
        """Holding no slice for `idle_shutdown_s` (> 0): exit (code 0)."""
        if self._idle_for() > self.s.idle_shutdown_s > 0 and self._loader is None:
            log.info("no slice for %.0fs; shutting down", self._idle_for())
            self.stop.set()

    def _idle_for(self) -> float:
        return time.monotonic() - self._idle_since

    # -- volunteering and loading --------------------------------------------------------
    def _volunteer_due(self) -> bool:
        """Time to ask. Right after a slice is installed the next ask is due at once; an ask
        that finds nothing waits `volunteer_poll_s` (the heartbeat's pace while serving)."""
        return time.monotonic() >= self._next_ask and self._loader is None

    def _volunteer(self) -> bool:
        """Ask for a slice and load it: here while serving nothing; while serving, the ask
        (its round trips to the market and the reads it decides on) and the load run on a
        thread beside the serving loop, so that no job waits for them (`_install_loaded`
        applies what the thread found). True if one was offered, or is being asked for."""
        now = time.monotonic()
        # serving already: look for more at the heartbeat's pace, not the idle poll's
        pace = (
            self.s.volunteer_poll_s
            if not self.shelf
            else max(self.s.volunteer_poll_s, self.board.lifetimes.beat_every_s())
        )
        self._next_ask = max(self._next_ask, now + pace)
        room = _Room(self.shelf.used_bytes, len(self.shelf), frozenset(self.shelf))
        if self.shelf:
            self._loader = threading.Thread(
                target=self._ask_beside, args=(room,), name="volunteer", daemon=True
            )
            self._loader.start()
            return True
        got = self._ask(room)
        if not isinstance(got, Held):
            return False
        try:
            loaded = self.loader.load(got, self.membership.loaded, refused=self._tampered)
        except KvqError as exc:
            self._failed(got, exc)
            return False
        self._install(loaded)
        return True

    def _ask(self, room: _Room) -> Held | _GaveBack | None:
        """The market's offer for the room `room` leaves (taken: `loading` until installed),
        or a slice given back to make room for an uncovered one, or None."""
        if not self.budget.can_take(room.used, room.count):
            # full: ask only to give back a slice whose answer was lost on the way (listed
            # for this worker, unknown to it), which room 0 does and takes nothing new
            if self.membership.lost_answers():
                self.membership.volunteer(0)
            return self._make_room_for_coverage(room)
        free = self.budget.room(room.used)
        held = self.membership.volunteer(free)
        if held is None and free is not None:  # nothing wanted fits the room left
            return self._make_room_for_coverage(room)
        return held

    def _ask_beside(self, room: _Room) -> None:
        """`_ask`, and the load of what it was offered, on the volunteer thread; whatever
        comes of it (even an error) goes to the serving loop through `_loads`."""
        held: Held | None = None
        try:
            got = self._ask(room)
            if isinstance(got, Held):
                held = got
                self._loading.set()
                self._loads.put(self.loader.load(got, self.membership.loaded, True, self._tampered))
            else:
                self._loads.put(got)
        except Exception as exc:  # noqa: BLE001 - handed to the main loop, which decides
            self._loads.put((held, exc))

    def _make_room_for_coverage(self, room: _Room) -> _GaveBack | None:
        """Full while a slice of a model it serves has no holder (its holder died and nobody
        has room): give back a slice that another worker also holds and whose bytes make room
        for the uncovered one, so that the next ask takes it (coverage before copies). The
        market refuses a last copy, and any copy while every wanted slice has a holder. The
        slice given back, if any (its server is still on the shelf: the caller drops it)."""
        free = self.budget.room(room.used)  # None: any size fits
        for model, mine in self.membership.by_model().items():
            info = self.board.model_info(model)
            if info is None:
                continue
            holders = Counter(
                sid for sids in self.board.assignments(model).values() for sid in sids
            )
            need = [s.nbytes for sid, s in info.slices.items() if not holders[sid]]
            if not need:
                continue
            spare = sorted(
                (
                    sid
                    for sid in mine
                    if holders[sid] >= 2
                    and (model, sid) in room.keys
                    and (free is None or free + info.slices[sid].nbytes >= min(need))
                ),
                key=lambda sid: (-holders[sid], sid),
            )
            for sid in spare:
                if self.membership.retire(model, sid) is not None:
                    log.info(
                        "%d slice(s) of %s have no holder: gave back %s (%d holders) to take one",
                        len(need),
                        model,
                        sid,
                        holders[sid],
                    )
                    return _GaveBack(model, sid)
        return None

    def _install_loaded(self) -> None:
        """Apply what the volunteer thread found: a loaded slice goes on the shelf, one given
        back comes off it, a failure is handled here."""
        try:
            got = self._loads.get_nowait()
        except queue.Empty:
            return
        self._loader = None
        self._loading.clear()
        if got is None:
            return
        if isinstance(got, Loaded):
            self._install(got)
            return
        if isinstance(got, _GaveBack):
            self.shelf.drop(got.model, got.sid)
            self._next_ask = 0.0  # the room is free: ask for the uncovered slice at once
            return
        held, exc = got
        if held is None:  # the ask itself failed (Redis down, refusing): the loop decides
            raise exc
        if not isinstance(exc, KvqError):
            self.membership.give_back(held)
            raise exc
        self._failed(held, exc)

    def _failed(self, held: Held, exc: KvqError) -> None:
        """The offered slice could not be loaded: give it back, ask again after a back-off."""
        self.membership.give_back(held)
        if isinstance(exc, BankError):
            log.error("cannot serve %s %s: %s", held.model, held.sid, exc)
            raise exc  # this node's bank settings cannot work: retrying would loop forever
        delay = self._load_backoff.next_delay()
        self._next_ask = time.monotonic() + delay
        if isinstance(exc, TamperedSource):
            # said once per slice and source: the same bytes would come every time
            if not exc.again:
                self._tampered.add(exc.fingerprint)
                log.error(
                    "cannot serve %s %s: %s; not downloading it from there again while its "
                    "checksums stay as published (fix the monitor's --source, or register "
                    "the model again)",
                    held.model,
                    held.sid,
                    exc,
                )
            return
        log.error(
            "cannot serve %s %s: %s; volunteering again in %.1fs", held.model, held.sid, exc, delay
        )

    def _install(self, got: Loaded) -> None:
        """A loaded slice starts serving: on the shelf, counted, beating."""
        held = got.held
        self.shelf.add(held.model, held.sid, got.server, got.nbytes)
        if self.consumer is None:
            inbox = self.board.keys.worker_inbox(self.id)
            self.consumer = Consumer(self.board.r, inbox, WORKER_GROUP, self.id)
        # logged before `hold` makes it count among `holdings`: whoever sees it there finds
        # the line already written
        log.info(
            "serving %s %s (%d bytes in %.2fs, warm-up %.2fs) on %s; %d slice(s), %.1f MB",
            held.model,
            held.sid,
            got.nbytes,
            got.seconds,
            got.warm_s,
            self.device,
            len(self.shelf),
            self.shelf.used_bytes / 1e6,
        )
        self.membership.hold(held)
        self._load_backoff.reset()
        self._next_ask = 0.0  # room left? ask again at once

    # -- serving -------------------------------------------------------------------------
    def _serve_batch(self) -> None:
        assert self.consumer is not None and self.shelf
        # a slice loading beside: short reads, so it is installed (and the next one asked
        # for) promptly rather than after a full block
        block = (
            min(self.s.block_ms, _LOADING_BLOCK_MS) if self._loading.is_set() else self.s.block_ms
        )
        entries = self.consumer.read(count=_BATCH, block_ms=block)
        jobs = [(eid, fields, self._decode(eid, fields)) for eid, fields in entries]
        plate = self.membership.backlog
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
        self._answer(served, block)
        # B5: a batch of jobs is the engine step of the banks it used
        self.shelf.step({(job.model, job.slice) for _, _, job in jobs if job is not None})
        if self.s.idle_release_s > 0:
            self._release_if_surplus()

    def _release_if_surplus(self) -> None:
        """K10 wind-down, per slice: no job for it in `idle_release_s` and beyond its target
        → give it back, free its memory and volunteer again (exiting is `idle_shutdown_s`'s
        business)."""
        now = time.monotonic()
        for key in self.shelf:
            if now - self.shelf.last_job.get(key, now) <= self.s.idle_release_s:
                continue
            h = self.membership.retire(*key)
            if h is None:
                self.shelf.last_job[key] = now  # still needed: look again later
                continue
            log.info(
                "no job for %.0fs and %s %s is over-covered: released it",
                self.s.idle_release_s,
                h.model,
                h.sid,
            )
            self.shelf.drop(h.model, h.sid)
            self._next_ask = 0.0
        if not self.shelf:
            self.consumer = None  # its inbox went with the last slice
            self._idle_since = now

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
        assert self.consumer is not None
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
        errors = self.consumer.answer_and_read(appends, eids, maxlen, _BATCH, block_ms)
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
class _Room:
    """What the shelf held when an ask began: bytes, slices, and which."""

    used: int
    count: int
    keys: frozenset[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class _GaveBack:
    """A slice given back to the market to make room (`Worker._make_room_for_coverage`)."""

    model: str
    sid: str


# what the volunteer thread hands the serving loop: a loaded slice, a slice given back,
# nothing, or a failure (with the slice it was loading, None if the ask itself failed)
_Found = Loaded | _GaveBack | None | tuple[Held | None, Exception]


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


def _through_monitor(board: RedisBoard, mode: str, worker_id: str) -> bool:
    """`KVQ_WORKER_MARKET`: auto asks the monitor unless connected as the default user (which
    may run the market's scripts itself). A worker logged in as another worker's ACL user
    fails here, at start, rather than on its first NOPERM."""
    try:
        got = board.r.execute_command("ACL", "WHOAMI")
    except redis.ResponseError:  # a server before ACLs (Redis < 6): everyone is "default"
        got = b"default"
    who = got.decode() if isinstance(got, bytes) else str(got)
    mine = user_name(board.keys.prefix, "worker", worker_id)
    if who.startswith(user_name(board.keys.prefix, "worker", "x")[:-1]) and who != mine:
        raise ConfigError(
            f"logged in as ACL user {who!r}, which may only serve as its own worker id; "
            f"--id {worker_id!r} needs the user {mine!r}"
        )
    if mode != "auto":
        return mode == "monitor"
    return who != "default"
