"""The worker process: volunteer → download → register → serve, over outbound Redis only.

Life cycle:
1. idle: poll every model's demand through the atomic volunteer script (K9, K11); holding no
   slice for `KVQ_IDLE_SHUTDOWN_S` (> 0) it exits;
2. given a slice: fetch exactly its bytes, verify checksums, decode into tensors, and run
   each expert once (warm-up) before announcing "serving", so first results are warm (K4);
   then it keeps volunteering (`kvq.worker.volunteer`), at once after each slice it loads, for
   slices it does not hold while its memory budget has room (`kvq.worker.budget`) and some
   slice has demand: it may serve several slices, of one model or of several;
3. heartbeat on a thread (a key that expires), re-asserting every slice after a reap or a
   Redis restart;
4. serve: XREADGROUP BLOCK on its own inbox (`kvq.worker.inbox`), pending entries first; each
   job goes to the server of its model and slice (`kvq.worker.shelf`); its result is written
   before the job is acknowledged; malformed entries go to the dead-letter stream;
5. wind-down (K10), per slice: no job for a slice for `KVQ_IDLE_RELEASE_S` while it is covered
   beyond its target → give it back and drop it from memory; with none left, back to 1.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import redis

from kvq.bank import BankOptions
from kvq.bank.server import ExpertServer
from kvq.bus.market import Market, MarketDoor
from kvq.bus.outage import Outage, run_until_stopped
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings, WorkerSettings
from kvq.device import pick_device
from kvq.errors import ConfigError
from kvq.keys import check_id
from kvq.quant import kernels
from kvq.security.acl import user_name
from kvq.worker.budget import Budget
from kvq.worker.inbox import Inbox
from kvq.worker.loader import Loaded, Loader
from kvq.worker.membership import Held, Membership
from kvq.worker.shelf import Shelf
from kvq.worker.stage import StageServer
from kvq.worker.volunteer import Volunteer

log = logging.getLogger("kvq.worker")
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
        self.loader = Loader(
            board,
            self.id,
            self.device,
            settings.compute_dtype,
            settings.download_timeout_s,
            bank,
            settings.stage_max_seqs,
        )
        self.volunteer = Volunteer(
            board, settings, self.budget, self.shelf, self.membership, self.loader
        )
        # under its own ACL user (the market through the monitor) its dead letters go to its
        # own stream, which the monitor moves to the shared one (`kvq.bus.deadletters.relay`)
        keys = board.keys
        dead_key = keys.worker_dead(self.id) if market is not None else keys.deadletter()
        self.inbox = Inbox(board, self.id, self.shelf, self.membership.backlog, dead_key)

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
        loaded = self.volunteer.found()
        if loaded is not None:
            self._install(loaded)
        self._unload_removed()
        took = self._volunteer() if self.volunteer.due() else False
        if self.shelf:
            self._serve_batch()
        elif not took:
            self._maybe_idle_out()
            self.stop.wait(self.s.volunteer_poll_s)

    def _unload_removed(self) -> None:
        """Drop the servers of slices whose model was removed (`Membership.take_dropped`)."""
        for h in self.membership.take_dropped():
            self.shelf.drop(h.model, h.sid)
            self.volunteer.ask_soon()
        if not self.shelf and self.inbox.consumer is not None:
            self.inbox.close()
            self._idle_since = time.monotonic()

    def _reread_pending(self) -> None:
        """After Redis failed a pass: the jobs read but not answered are read again."""
        self.inbox.reset_pending()

    def _maybe_idle_out(self) -> None:
        """Holding no slice for `idle_shutdown_s` (> 0): exit (code 0)."""
        if self._idle_for() > self.s.idle_shutdown_s > 0 and not self.volunteer.asking:
            log.info("no slice for %.0fs; shutting down", self._idle_for())
            self.stop.set()

    def _idle_for(self) -> float:
        return time.monotonic() - self._idle_since

    # -- slices in and out --------------------------------------------------------------
    def _volunteer(self) -> bool:
        """Ask for a slice (`Volunteer.ask`), installing one loaded here. True if one was
        offered, or is being asked for beside the serving."""
        got = self.volunteer.ask()
        if isinstance(got, Loaded):
            self._install(got)
            return True
        return got

    def _install(self, got: Loaded) -> None:
        """A loaded slice starts serving: on the shelf, counted, beating."""
        held = got.held
        self.shelf.add(held.model, held.sid, got.server, got.nbytes)
        self.inbox.open()
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
        self.volunteer.installed()

    # -- serving -------------------------------------------------------------------------
    def _serve_batch(self) -> None:
        # a slice loading beside: short reads, so it is installed (and the next one asked
        # for) promptly rather than after a full block
        loading = self.volunteer.loading.is_set()
        self.inbox.serve_batch(
            min(self.s.block_ms, _LOADING_BLOCK_MS) if loading else self.s.block_ms
        )
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
            self.volunteer.ask_soon()
        if not self.shelf:
            self.inbox.close()  # its inbox went with the last slice
            self._idle_since = now


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
