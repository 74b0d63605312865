"""A worker's place in the market: which slices it holds, its heartbeat, and leaving (K9, K10).

Everything goes through a `Board`, so this runs the same on Redis and in memory. One lock keeps
a heartbeat from re-asserting a slice the worker is giving back.

A worker may hold several slices, of one model or of several: it volunteers
one slice at a time, telling the market which it holds, so it is offered one it does not. The
heartbeat starts before the worker asks for a slice (state "idle") and goes on while it
downloads one (state "loading", with its progress), so the monitor never reaps a worker for a
slow download: the slice stays reserved to it and is not offered again. Every beat re-asserts every slice it holds or loads, and lists
the ones it serves (`WorkerInfo.holds`): routers skip a slice until it is listed there.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis

from kvq import machine
from kvq.bus.board import Board
from kvq.bus.market import BoardMarket, Held, Market
from kvq.bus.records import IDLE, LOADING, SERVING, WorkerInfo, holds_text
from kvq.errors import IdentityInUse, KvqError
from kvq.machine import cpus_text
from kvq.worker.backlog import Backlog

MACHINE = machine.machine_id()  # read once: it cannot change while the process lives

log = logging.getLogger("kvq.worker")

__all__ = ["Held", "Membership"]


class Membership:
    """`worker_id`'s slices on `board`; `served()` gives (jobs served, last_serve_ms),
    `work()` (seconds spent computing, rows computed) since the worker started."""

    def __init__(
        self,
        board: Board,
        worker_id: str,
        device: str,
        served: Callable[[], tuple[int, int]] = lambda: (0, 0),
        work: Callable[[], tuple[float, int]] = lambda: (0.0, 0),
        market: Market | None = None,
        instance: str | None = None,
        backlog: Backlog | None = None,
        kernels: str = "",
    ) -> None:
        self.board, self.id, self.device, self.served = board, worker_id, device, served
        self.kernels = kernels  # `kvq.quant.kernels.describe()`, in every beat
        self.market = market or BoardMarket(board)
        self.instance = instance or uuid.uuid4().hex  # this process, among any of the same id
        self.work = work  # (busy seconds, rows) so far: load and ms per row per beat interval
        self.backlog = backlog or Backlog()  # rows on its plate, filled by the serving loop
        self._unread = 0  # inbox entries not read yet, as of the last beat
        self._last_work = (time.monotonic(), 0.0, 0)
        self.holds: dict[tuple[str, str], Held] = {}  # (model, sid) → loaded, serving (in order)
        self.loading: Held | None = None  # taken from the market, still downloading
        self.dropped: list[Held] = []  # of removed models, for the serving loop to unload
        self.drained: set[str] = set()  # models an operator drained it of: no slice taken
        # a `kvq acl` worker user may not read verdicts (it asks the monitor's market instead)
        self._reads_verdicts = isinstance(self.market, BoardMarket)
        # its own lock: the serving loop takes it every turn, and must never wait for a beat's
        # round trips under `_lock`
        self._dropped_lock = threading.Lock()
        self.progress = (0, 0)  # (bytes loaded, bytes in all) of the slice being loaded
        self._idle_beat = float("-inf")  # last heartbeat while holding nothing
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> Held | None:
        """The slice loaded last (None: it serves none)."""
        return next(reversed(self.holds.values()), None)

    def by_model(self) -> dict[str, list[str]]:
        """Model → the slice ids it holds or loads (what the market is told it has)."""
        out: dict[str, list[str]] = {}
        for h in [*self.holds.values(), *([self.loading] if self.loading else [])]:
            out.setdefault(h.model, []).append(h.sid)
        return out

    def lost_answers(self) -> bool:
        """Whether the market lists for this worker a slice it neither holds nor loads (the
        answer to an ask was lost on the way; `volunteer` returns it, or gives it back when
        it does not fit the room asked with)."""
        mine = self.by_model()
        for model in self.board.models():
            if set(self.board.held_by(model, self.id)) - set(mine.get(model, ())):
                return True
        return False

    def volunteer(self, room: int | None = None) -> Held | None:
        """Ask the market for a slice it does not hold, of at most `room` bytes (None: any
        size) (K9); the one offered is taken and is `loading` until `hold` (or `give_back`).
        The heartbeat is up before the market is asked, so the monitor never sees this worker
        assigned without one."""
        now = time.monotonic()
        if not self.holds and now - self._idle_beat >= self.board.lifetimes.beat_every_s():
            self._idle_beat = now
            idle = WorkerInfo(
                model="",
                slice="",
                device=self.device,
                state=IDLE,
                instance=self.instance,
                holds="{}",
                machine=MACHINE,
                cpus=cpus_text(machine.cpus()),
                kernels=self.kernels,
            )
            self.board.beat(self.id, idle)
        got = self.market.volunteer(self.id, self.by_model(), room, skip=set(self.drained))
        if got is None:
            return None
        with self._lock:
            self.loading, self.progress = got, (0, 0)
            self._beat_locked()
        return self.loading

    def claim(self, wait_s: float) -> None:
        """Take this worker id before anything else (IdentityInUse if another live process
        keeps beating under it for `wait_s`: a crashed predecessor's beat expires by then)."""
        deadline = time.monotonic() + wait_s
        while not self.board.claim_worker(self.id, self.instance):
            if time.monotonic() > deadline:
                raise IdentityInUse(
                    f"worker id {self.id!r} is in use by another live worker (its heartbeat "
                    f"has been renewed for {wait_s:.1f}s); give this one another --id"
                )
            time.sleep(min(0.1, wait_s / 10))

    def loaded(self, done: int, total: int) -> None:
        """Download progress of the slice being loaded (shown on the next beat)."""
        self.progress = (done, total)

    def hold(self, held: Held) -> None:
        """The slice is loaded: count it and start beating for it."""
        with self._lock:
            self.holds[(held.model, held.sid)], self.loading = held, None
            self._beat_locked()

    def give_back(self, held: Held) -> None:
        """The offered slice could not be loaded: return it to the market."""
        with self._lock:
            self.loading = None
            self.market.release(held.model, self.id, held.sid)

    def beat(self) -> None:
        # the removal and drain checks' round trips outside the lock, which the serving loop
        # also takes
        removed = self._removed_models()
        drained = self._drained_models()
        with self._lock:
            self._drop_removed(removed)
            self._give_back_drained(drained)
            self._beat_locked()

    def _beat_locked(self) -> None:
        h = self.loading or self.held
        if h is None:
            return
        for model, sids in self.by_model().items():
            # after a reap it survived, or lost data; not while drained (the monitor may have
            # taken them back: its work is done)
            if model not in self.drained and self.market.rejoin(model, self.id, *sids):
                log.warning(
                    "the market had lost %s's slices of %s (a reap, or Redis lost its "
                    "keys); counted them again",
                    self.id,
                    model,
                )
        served, last = self.served()
        load, ms_per_row = self._load()
        done, total = self.progress
        plate = self.backlog.view()
        info = WorkerInfo(
            model=h.model,
            slice=h.sid,
            device=self.device,
            served=served,
            last_serve_ms=last,
            state=LOADING if self.loading is not None else SERVING,
            loaded_bytes=done,
            total_bytes=total,
            load=load,
            ms_per_row=ms_per_row,
            busy_rows=plate.busy_rows,
            queued_rows=plate.queued_rows + self._unread_rows(self._unread, served),
            queued_by=plate.by_coord_text(),
            instance=self.instance,
            holds=holds_text(self.served_by_model()),
            machine=MACHINE,
            cpus=cpus_text(machine.cpus()),
            kernels=self.kernels,
        )
        inbox = self.board.beat(self.id, info)
        # for the next beat: what waits unread now (one beat stale, no extra round trip)
        self._unread = max(0, inbox - plate.jobs) if self.holds else 0

    def _removed_models(self) -> set[str]:
        """The held models `kvq model rm` removed (one read each, under no lock)."""
        held = {h.model for h in list(self.holds.values())}
        return {model for model in held if self.board.model_removed(model)}

    def _drop_removed(self, removed: set[str]) -> None:
        """Stop holding the slices of `removed` models (their keys are gone: a rejoin would
        bring some back); the serving loop drops their servers (`take_dropped`)."""
        for model in removed:
            gone = [k for k in self.holds if k[0] == model]
            if gone:
                with self._dropped_lock:
                    self.dropped.extend(self.holds.pop(k) for k in gone)
                log.info(
                    "model %s was removed: no longer serving its %d slice(s)", model, len(gone)
                )

    def _drained_models(self) -> set[str]:
        """The models (held, or drained of before) whose latest verdict on this worker is an
        operator's drain (`kvq workers drain`); a release ends it. Asked only where the worker
        runs the market itself (the default user): a `kvq acl` worker user may not read
        verdicts, and the monitor takes a drained one's slices back (`release_drained`)."""
        if not self._reads_verdicts:
            return set()
        held = {h.model for h in list(self.holds.values())} | self.drained
        out = set()
        for model in held:
            q = self.board.quarantined(model).get(self.id)
            if q is not None and q.drain:
                out.add(model)
        return out

    def _give_back_drained(self, drained: set[str]) -> None:
        """Give back the slices of `drained` models once nothing is on its plate (what it was
        sent is answered first) and the drain was seen at an earlier beat too (coordinators
        reread verdicts every KVQ_DISPATCH_REFRESH_MS: none sends it a job after that)."""
        seen, self.drained = self.drained, drained
        plate = self.backlog.view()
        if plate.jobs or self._unread or plate.busy_rows or plate.queued_rows:
            return
        for model in drained & seen:
            gone = [k for k in self.holds if k[0] == model]
            if not gone:
                continue
            with self._dropped_lock:
                self.dropped.extend(self.holds.pop(k) for k in gone)
            self.market.release(model, self.id)  # every slice of it at once
            log.info(
                "drained of %s by an operator: its work done, gave back its %d slice(s)",
                model,
                len(gone),
            )

    def take_dropped(self) -> list[Held]:
        """The slices the heartbeat stopped holding since the last call (removed models, or
        drained ones given back)."""
        with self._dropped_lock:
            out, self.dropped = self.dropped, []
            return out

    def served_by_model(self) -> dict[str, list[str]]:
        """Model → the slice ids it serves (loaded), what its beat lists in `holds`."""
        out: dict[str, list[str]] = {}
        for h in self.holds.values():
            out.setdefault(h.model, []).append(h.sid)
        return out

    def _unread_rows(self, unread: int, served: int) -> int:
        """Rows of the jobs unread in the inbox at the last beat, at this worker's mean rows
        per job (no Redis call here: a beat through a slow link must stay one round trip)."""
        rows = self.work()[1]
        return round(unread * rows / served) if unread and served else unread

    def _load(self) -> tuple[float, float]:
        """(share of the time since the last beat spent computing, ms per row over it)."""
        now = time.monotonic()
        busy, rows = self.work()
        t0, busy0, rows0 = self._last_work
        self._last_work = (now, busy, rows)
        dt, dbusy, drows = now - t0, busy - busy0, rows - rows0
        load = min(1.0, max(0.0, dbusy / dt)) if dt > 0 else 0.0
        return load, (dbusy * 1000 / drows if drows > 0 else 0.0)

    def leave(self) -> None:
        """Give every slice back and drop this worker's keys (its inbox's jobs are recomputed
        by their coordinators)."""
        with self._lock:
            models = list(self.by_model())
            self.holds, self.loading = {}, None
            try:
                if self.board.worker_instance(self.id) not in (None, "", self.instance):
                    return  # another live process has this id: its keys are not ours to drop
                for model in models:
                    self.market.release(model, self.id)  # every slice of it at once
                self.board.forget_worker(self.id)  # an idle worker's beat goes too
            except (redis.RedisError, KvqError):
                pass  # the monitor reaps us once the heartbeat expires

    def retire(self, model: str | None = None, sid: str | None = None) -> Held | None:
        """K10: give the slice `sid` of `model` (default: the one of `model`, or of any model,
        loaded last) back only if it stays covered; what was given back, or None. The worker's
        keys go with its last slice."""
        with self._lock:
            if model is None:
                h = self.held
            elif sid is None:  # the one of `model` loaded last
                h = next((x for x in reversed(self.holds.values()) if x.model == model), None)
            else:
                h = self.holds.get((model, sid))
            if h is None or self.market.retire(h.model, self.id, h.sid) is None:
                return None
            del self.holds[(h.model, h.sid)]  # the heartbeat must not rejoin
            if self.holds or self.loading is not None:
                self._beat_locked()  # its other slices: no longer listing this one
            else:
                self.board.forget_worker(self.id)
            return h

    # -- the heartbeat thread -------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _loop(self) -> None:
        while not self._stop.wait(self.board.lifetimes.beat_every_s()):
            try:
                self.beat()
            except redis.RedisError as exc:
                log.debug("heartbeat failed: %s", exc)
            except KvqError as exc:  # e.g. IdentityInUse: the main loop meets it at its next ask
                log.error("heartbeat: %s", exc)
