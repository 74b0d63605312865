"""`MemoryBoard`: the board in plain dicts, for unit tests of role logic without a server.

Same contract as `RedisBoard` (`tests/bus/test_board_contract.py` runs both): the market
follows the Lua scripts step for step, expiry follows `Lifetimes` on an injectable clock, and
one lock stands in for Redis's one command at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from kvq.bus.board import CoordinatorView, Fields, Peers, spread_jobs, worker_view
from kvq.bus.records import (
    DEPARTED_KEEP_S,
    VERDICTS_KEPT,
    CoordStats,
    Departure,
    InFlight,
    Lifetimes,
    ModelState,
    Quarantine,
    SliceDemand,
    SlotState,
    WorkerInfo,
    WorkerView,
)
from kvq.catalog import ModelInfo
from kvq.config import Settings


class MemoryBoard:
    """A board that lives in this process; `clock()` is wall time in seconds."""

    def __init__(
        self, lifetimes: Lifetimes | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.lifetimes = lifetimes or Settings.model_construct().lifetimes  # the defaults
        self.clock = clock
        self._lock = threading.RLock()
        self._models: dict[str, ModelInfo] = {}
        self._departed: dict[str, Departure] = {}  # reaped workers, for operators
        self._removed: set[str] = set()  # `unregister_model` since their last registration
        self._state: dict[str, ModelState] = {}
        self._target: dict[str, dict[str, int]] = {}
        self._routed: dict[str, dict[str, int]] = {}  # model -> slice -> rows routed
        self._lease: tuple[str, float] | None = None  # (holder, monotonic expiry)
        self._coverage: dict[str, dict[str, int]] = {}
        self._workers: dict[str, dict[str, list[str]]] = {}  # model -> worker -> sids
        self._expiring: dict[tuple[str, str], tuple[object, float]] = {}  # (kind, id) → value
        self.inboxes: dict[str, list[Fields]] = {}  # unanswered jobs per worker
        self._coords: dict[str, set[str]] = {}
        self._stats: dict[str, CoordStats] = {}
        self._quarantine: dict[str, dict[str, Quarantine]] = {}  # model -> worker -> verdict
        self._verdicts: dict[str, list[tuple[str, Quarantine]]] = {}  # model -> every verdict

    # -- expiry ---------------------------------------------------------------------------
    def _put(self, kind: str, ident: str, value: object, ttl_s: float) -> None:
        self._expiring[(kind, ident)] = (value, self.clock() + ttl_s)

    def _get(self, kind: str, ident: str) -> object | None:
        with self._lock:  # expiring is a write: never between another thread's check and put
            got = self._expiring.get((kind, ident))
            if got is None:
                return None
            value, until = got
            if self.clock() >= until:
                del self._expiring[(kind, ident)]
                return None
            return value

    def lapse(self, kind: str, ident: str) -> None:
        """Let one expiring record run out now (`"hb"`, `"info"`, `"slots"`), as its TTL
        would: what a test does to a worker that died or a coordinator long gone."""
        with self._lock:
            self._expiring.pop((kind, ident), None)

    # -- models ---------------------------------------------------------------------------
    def models(self) -> list[str]:
        return sorted(self._models)

    def register_model(self, info: ModelInfo, base_replicas: int, restore: bool = False) -> bool:
        with self._lock:
            if restore and info.model in self._removed:
                return False
            self._removed.discard(info.model)
            self._models[info.model] = info
            self._target[info.model] = dict.fromkeys(info.slices, base_replicas)
            return True

    def unregister_model(self, model: str) -> list[str]:
        with self._lock:
            self._removed.add(model)
            holders = sorted(self._workers.pop(model, {}))
            for table in (self._models, self._state, self._target, self._routed):
                table.pop(model, None)
            for other in (self._coverage, self._coords, self._quarantine, self._verdicts):
                other.pop(model, None)
            return holders

    def forget_removed_model(self, model: str, shards: int) -> None:
        with self._lock:
            if model in self._removed:
                for table in (self._routed, self._coords, self._quarantine, self._verdicts):
                    table.pop(model, None)

    def model_removed(self, model: str) -> bool:
        return model in self._removed

    def model_info(self, model: str) -> ModelInfo | None:
        return self._models.get(model)

    def model_intact(self, model: str) -> bool:
        return model in self._models

    def publish_model_state(
        self, model: str, state: ModelState, targets: Mapping[str, int] | None = None
    ) -> None:
        with self._lock:
            info = self._models.get(model)
            if info is not None and info.slices:
                target = self._target.setdefault(model, {})
                target.update(
                    {s: (targets or {}).get(s, state.effective_target) for s in info.slices}
                )
            self._state[model] = state

    def hold_lease(self, holder: str, ttl_s: float) -> bool:
        with self._lock:
            now = time.monotonic()
            cur = self._lease if self._lease and self._lease[1] > now else None
            if cur is None or cur[0] == holder:
                self._lease = (holder, now + ttl_s)
                return True
            return False

    def drop_lease(self, holder: str) -> None:
        with self._lock:
            if self._lease and self._lease[0] == holder:
                self._lease = None

    def lease_holder(self) -> str | None:
        with self._lock:
            cur = self._lease
            return cur[0] if cur and cur[1] > time.monotonic() else None

    def add_routed(self, model: str, rows: Mapping[str, int]) -> None:
        with self._lock:
            routed = self._routed.setdefault(model, {})
            for sid, n in rows.items():
                if n > 0:
                    routed[sid] = routed.get(sid, 0) + n

    def routed(self, model: str) -> dict[str, int]:
        with self._lock:
            return dict(self._routed.get(model, {}))

    def model_state(self, model: str) -> ModelState | None:
        return self._state.get(model)

    # -- the market (the Lua scripts, step for step) --------------------------------------
    def slice_demand(self, model: str) -> dict[str, SliceDemand]:
        target = self._target.get(model, {})
        cover = self._coverage.get(model, {})
        return {sid: SliceDemand(target[sid], cover.get(sid, 0)) for sid in sorted(target)}

    def set_target(self, model: str, sid: str, replicas: int) -> None:
        with self._lock:
            self._target.setdefault(model, {})[sid] = replicas

    def assignments(self, model: str) -> dict[str, tuple[str, ...]]:
        with self._lock:
            return {w: tuple(sids) for w, sids in self._workers.get(model, {}).items()}

    def held_by(self, model: str, worker: str) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._workers.get(model, {}).get(worker, ()))

    def volunteer(
        self, model: str, worker: str, room: int | None = None, held: Collection[str] = ()
    ) -> str | None:
        with self._lock:
            info = self._models.get(model)

            def fits(sid: str) -> bool:
                return room is None or (
                    info is not None and sid in info.slices and info.slices[sid].nbytes <= room
                )

            known = set(held)
            listed = self._workers.setdefault(model, {}).get(worker, [])
            mine = [sid for sid in listed if sid in known or fits(sid)]
            if mine != listed:  # lost answers that do not fit `room`: given back
                for sid in set(listed) - set(mine):
                    self._uncover(model, sid)
                self._keep(model, worker, mine)
            lost = [sid for sid in mine if sid not in known]
            if lost:
                return lost[0]
            cover = self._coverage.setdefault(model, {})
            routed = self._routed.get(model, {})
            # as volunteer.lua: uncovered first, then hottest, largest demand, fewest holders
            best: tuple[int, int, int, int, str] | None = None  # min wins
            for sid, want in self._target.get(model, {}).items():
                cov = cover.get(sid, 0)
                if sid in mine or not fits(sid) or want - cov <= 0:
                    continue
                key = (-(cov == 0), -routed.get(sid, 0), cov - want, cov, sid)
                if best is None or key < best:
                    best = key
            if best is None:
                return None
            sid = best[4]
            cover[sid] = cover.get(sid, 0) + 1
            self._workers[model][worker] = sorted([*mine, sid])
            return sid

    def _uncover(self, model: str, sid: str) -> None:
        cover = self._coverage.setdefault(model, {})
        left = cover.get(sid, 0) - 1
        if left <= 0:
            cover.pop(sid, None)
        else:
            cover[sid] = left

    def _keep(self, model: str, worker: str, sids: list[str]) -> None:
        """Set what `worker` holds of `model` (an empty list drops its field, as HDEL)."""
        workers = self._workers.setdefault(model, {})
        if sids:
            workers[worker] = sorted(sids)
        else:
            workers.pop(worker, None)

    def release(self, model: str, worker: str, sid: str | None = None) -> tuple[str, ...]:
        with self._lock:
            mine = self._workers.get(model, {}).get(worker, [])
            gone = [s for s in mine if sid is None or s == sid]
            if not gone:
                return ()
            self._keep(model, worker, [s for s in mine if s not in gone])
            for s in gone:
                self._uncover(model, s)
            return tuple(gone)

    def rejoin(self, model: str, worker: str, *sids: str) -> int:
        with self._lock:
            mine = list(self._workers.setdefault(model, {}).get(worker, []))
            cover = self._coverage.setdefault(model, {})
            added = 0
            for sid in sids:
                if sid and sid not in mine:
                    mine.append(sid)
                    cover[sid] = cover.get(sid, 0) + 1
                    added += 1
            if added:
                self._keep(model, worker, mine)
            return added

    def retire(self, model: str, worker: str, sid: str) -> str | None:
        with self._lock:
            mine = self._workers.get(model, {}).get(worker, [])
            if sid not in mine:
                return None
            want = self._target.get(model, {}).get(sid, 0)
            cover = self._coverage.get(model, {})
            targets = self._target.get(model, {})
            uncovered = any(n > 0 and cover.get(s, 0) <= 0 for s, n in targets.items())
            cov = cover.get(sid, 0)
            if cov <= want and not (cov >= 2 and uncovered):  # retire.lua's rule
                return None
            self._keep(model, worker, [s for s in mine if s != sid])
            self._uncover(model, sid)
            return sid

    # -- workers --------------------------------------------------------------------------
    def workers(self, model: str) -> list[WorkerView]:
        out: list[WorkerView] = []
        for w, sids in sorted(self.assignments(model).items()):
            info = self.worker_info(w)
            alive = self._get("hb", w) is not None  # the liveness rule: the beat is up
            out.extend(worker_view(w, sid, alive, info, model) for sid in sids)
        return out

    def beat(self, worker: str, info: WorkerInfo) -> int:
        with self._lock:
            self._put("hb", worker, info.instance, self.lifetimes.heartbeat_ms() / 1000)
            self._put("info", worker, info, self.lifetimes.worker_info_s())
            return len(self.inboxes.get(worker, []))

    def worker_info(self, worker: str) -> WorkerInfo | None:
        got = self._get("info", worker)
        return got if isinstance(got, WorkerInfo) else None

    def worker_alive(self, worker: str) -> bool:
        return self._get("hb", worker) is not None

    def claim_worker(self, worker: str, instance: str) -> bool:
        with self._lock:
            held = self._get("hb", worker)
            if held is None:
                self._put("hb", worker, instance, self.lifetimes.heartbeat_ms() / 1000)
                return True
            return held == instance

    def worker_instance(self, worker: str) -> str | None:
        got = self._get("hb", worker)
        return got if isinstance(got, str) else None

    def forget_worker(self, worker: str) -> None:
        with self._lock:
            self.lapse("hb", worker)
            self.lapse("info", worker)
            self.inboxes.pop(worker, None)

    def record_departure(self, worker: str, departure: Departure) -> None:
        with self._lock:
            cutoff = departure.ts_ms - DEPARTED_KEEP_S * 1000
            self._departed = {w: d for w, d in self._departed.items() if d.ts_ms >= cutoff}
            self._departed[worker] = departure

    def departures(self) -> dict[str, Departure]:
        cutoff = self.now_ms() - DEPARTED_KEEP_S * 1000
        with self._lock:
            return {w: d for w, d in sorted(self._departed.items()) if d.ts_ms >= cutoff}

    def quarantine(self, model: str, worker: str, verdict: Quarantine) -> None:
        with self._lock:
            self._quarantine.setdefault(model, {})[worker] = verdict
            log = self._verdicts.setdefault(model, [])
            log.append((worker, verdict))
            del log[:-VERDICTS_KEPT]

    def verdict_history(self, model: str, worker: str) -> list[Quarantine]:
        with self._lock:
            return [q for w, q in reversed(self._verdicts.get(model, [])) if w == worker]

    def quarantined(self, model: str) -> dict[str, Quarantine]:
        with self._lock:
            return dict(sorted(self._quarantine.get(model, {}).items()))

    def send_jobs(self, jobs: Sequence[tuple[str, Fields]]) -> None:
        with self._lock:
            for worker, fields in jobs:
                self.inboxes.setdefault(worker, []).append(dict(fields))

    def requeue_inbox(self, dead: str, peers: Sequence[str] | Peers) -> int:
        moves = spread_jobs(self.inboxes.pop(dead, []), peers)
        self.send_jobs(moves)
        return len(moves)

    # -- coordinators ---------------------------------------------------------------------
    def publish_slots(
        self,
        coord: str,
        state: SlotState,
        stats: CoordStats,
        inflight: Iterable[InFlight] = (),
    ) -> bool:
        with self._lock:
            members = self._coords.setdefault(state.model, set())
            new = self._slots(coord) is None or coord not in members
            self._put("slots", coord, state, self.lifetimes.slots_s())
            self._put("inflight", coord, list(inflight), self.lifetimes.slots_s())
            members.add(coord)
            self._stats[coord] = stats
            return new

    def _slots(self, coord: str) -> SlotState | None:
        got = self._get("slots", coord)
        return got if isinstance(got, SlotState) else None

    def coordinators(self, model: str) -> list[CoordinatorView]:
        now_ms = self.now_ms()
        out = []
        for c in sorted(self._coords.get(model, set())):
            state = self._slots(c)
            out.append(CoordinatorView(c, state, self.lifetimes.coordinator_alive(state, now_ms)))
        return out

    def forget_coordinator(self, model: str, coord: str) -> None:
        with self._lock:
            self._coords.get(model, set()).discard(coord)

    def coordinator_alive(self, coord: str) -> bool:
        return self.lifetimes.coordinator_alive(self._slots(coord), self.now_ms())

    def now_ms(self) -> float:
        return self.clock() * 1000

    def coord_stats(self, coord: str) -> CoordStats | None:
        return self._stats.get(coord)

    def in_flight(self, coords: Sequence[str]) -> list[InFlight]:
        out: list[InFlight] = []
        for c in coords:
            got = self._get("inflight", c)
            out += got if isinstance(got, list) else []
        return out
