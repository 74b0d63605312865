"""`Volunteer`: a worker asks the market for slices and loads what it is given (K9, K11).

Serving nothing, it asks and loads in the serving loop. Serving already, the ask (its round
trips to the market and the reads it decides on) and the load run on a thread beside the
loop, so that no job waits for them; the loop picks up what the thread found (`found`). While
its memory budget has room and some slice has demand it keeps asking; full while a slice of a
model it serves has no holder, it gives back a copy that others hold too (coverage before
copies). A slice that fails to load goes back to the market, and the next ask waits a
back-off; a source whose bytes fail their checksums is not downloaded from again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kvq.bus import Backoff
from kvq.bus.redis_board import RedisBoard
from kvq.config import WorkerSettings
from kvq.errors import BankError, KvqError
from kvq.worker.budget import Budget
from kvq.worker.loader import Fingerprint, Loaded, Loader, TamperedSource
from kvq.worker.membership import Held, Membership
from kvq.worker.shelf import Shelf

log = logging.getLogger("kvq.worker")


class Volunteer:
    """The asking and loading of one worker, whose slices are on `shelf`."""

    def __init__(
        self,
        board: RedisBoard,
        settings: WorkerSettings,
        budget: Budget,
        shelf: Shelf,
        membership: Membership,
        loader: Loader,
    ) -> None:
        self.board, self.s, self.budget, self.shelf = board, settings, budget, shelf
        self.membership, self.loader = membership, loader
        self._next_ask = 0.0  # monotonic time of the next ask
        self._thread: threading.Thread | None = None  # asking and loading beside the serving
        self._found: queue.SimpleQueue[_Found] = queue.SimpleQueue()
        self.loading = threading.Event()  # the thread is loading (not just asking)
        # after a failed load: volunteer_poll_s doubled per failure, up to load_retry_max_s
        self.backoff = Backoff(settings.load_retry_max_s, settings.volunteer_poll_s)
        self._tampered: set[Fingerprint] = set()  # slices whose source failed their checksums

    @property
    def asking(self) -> bool:
        """An ask (or the load it led to) is under way beside the serving loop."""
        return self._thread is not None

    def due(self) -> bool:
        """Time to ask. Right after a slice is installed the next ask is due at once; an ask
        that finds nothing waits `volunteer_poll_s` (the heartbeat's pace while serving)."""
        return time.monotonic() >= self._next_ask and self._thread is None

    def ask_soon(self) -> None:
        """Room was freed (or a slice installed): the next ask is due at once."""
        self._next_ask = 0.0

    def installed(self) -> None:
        """A slice it loaded serves now: no back-off, and room left? ask again at once."""
        self.backoff.reset()
        self._next_ask = 0.0

    def ask(self) -> Loaded | bool:
        """Ask for a slice and load it: here while serving nothing (the slice loaded, for
        the caller to install), beside the serving loop while serving (True: the thread
        asks; `found` hands over what it gets). False: nothing offered, or it failed."""
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
            self._thread = threading.Thread(
                target=self._ask_beside, args=(room,), name="volunteer", daemon=True
            )
            self._thread.start()
            return True
        got = self._ask(room)
        if not isinstance(got, Held):
            return False
        try:
            return self.loader.load(got, self.membership.loaded, refused=self._tampered)
        except KvqError as exc:
            self._failed(got, exc)
            return False

    def found(self) -> Loaded | None:
        """What the thread found: a loaded slice for the caller to install; a slice given
        back is taken off the shelf here, a failure handled here. None: nothing to install."""
        try:
            got = self._found.get_nowait()
        except queue.Empty:
            return None
        self._thread = None
        self.loading.clear()
        if got is None or isinstance(got, Loaded):
            return got
        if isinstance(got, _GaveBack):
            self.shelf.drop(got.model, got.sid)
            self._next_ask = 0.0  # the room is free: ask for the uncovered slice at once
            return None
        held, exc = got
        if held is None:  # the ask itself failed (Redis down, refusing): the loop decides
            raise exc
        if not isinstance(exc, KvqError):
            self.membership.give_back(held)
            raise exc
        self._failed(held, exc)
        return None

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
        """`_ask`, and the load of what it was offered, on the thread; whatever comes of it
        (even an error) goes to the serving loop through `_found`."""
        held: Held | None = None
        try:
            got = self._ask(room)
            if isinstance(got, Held):
                held = got
                self.loading.set()
                self._found.put(self.loader.load(got, self.membership.loaded, True, self._tampered))
            else:
                self._found.put(got)
        except Exception as exc:  # noqa: BLE001 - handed to the main loop, which decides
            self._found.put((held, exc))

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

    def _failed(self, held: Held, exc: KvqError) -> None:
        """The offered slice could not be loaded: give it back, ask again after a back-off."""
        self.membership.give_back(held)
        if isinstance(exc, BankError):
            log.error("cannot serve %s %s: %s", held.model, held.sid, exc)
            raise exc  # this node's bank settings cannot work: retrying would loop forever
        delay = self.backoff.next_delay()
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


@dataclass(frozen=True, slots=True)
class _Room:
    """What the shelf held when an ask began: bytes, slices, and which."""

    used: int
    count: int
    keys: frozenset[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class _GaveBack:
    """A slice given back to the market to make room (`Volunteer._make_room_for_coverage`)."""

    model: str
    sid: str


# what the thread hands the serving loop: a loaded slice, a slice given back, nothing, or a
# failure (with the slice it was loading, None if the ask itself failed)
_Found = Loaded | _GaveBack | None | tuple[Held | None, Exception]
