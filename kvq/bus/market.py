"""How a worker takes and gives back slices: straight through the board, or through the monitor.

- `BoardMarket` runs the market's Lua scripts itself (a worker with the default user or any
  user allowed `EVALSHA`): the historical path, and the one unit tests use on a `MemoryBoard`.
- `MarketDoor` asks the monitor (a worker under its least-privilege ACL user, `docs/security.md`):
  it appends the request to its own `P:{w:W}:asks` stream, rings `P:market` with its id, and
  waits for the answer in its own `P:{w:W}:answers`. The monitor's `MarketDesk` reads the
  doorbell, then the asks of that worker, runs the script with the worker id taken from the
  key the ask was found in, never from a field: only the ACL user of W can write W's keys, so
  where an ask is proves who asked.

Asks and answers are plain string fields (readable with `redis-cli XRANGE`):
ask `v=1, op, model, slice, instance, nonce` and, on a volunteer ask, `held` (the slices it
holds or loads, JSON {model: [slice ids]}) and `room` (bytes it can still hold, "" = any);
answer `v=1, nonce, model, slice, error`. `slice` may list several slice ids joined by ","
(`kvq.keys.join_slices`): the slices to rejoin, or those a release gave back; "" in a release
ask means all of the worker's slices of the model. An ask's `skip` (models to leave out, from
workers that held one slice per model) is still honoured.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import redis

from kvq.bus.board import Board
from kvq.bus.peers import blame, is_peer_fault
from kvq.bus.records import holds_text, parse_holds
from kvq.bus.streams import is_cluster, xadd
from kvq.errors import IdentityInUse, KvqError
from kvq.keys import Keys, check_id, join_slices, split_slices

log = logging.getLogger("kvq.bus")

VOLUNTEER, RELEASE, REJOIN, RETIRE = "volunteer", "release", "rejoin", "retire"
_OPS = (VOLUNTEER, RELEASE, REJOIN, RETIRE)
_ASKS_MAXLEN = 100  # a worker's own unanswered asks (no monitor running): capped, not grown
GRANT_TTL_S = 86_400  # a grant outlives the worker's absence this long after the last one


@dataclass(frozen=True, slots=True)
class Held:
    model: str
    sid: str


class Market(Protocol):
    """The four market operations of one worker. `volunteer` offers a slice it does not hold:
    `held` lists what it holds or loads, per model; slices of more than `room` bytes (None:
    any) are left out."""

    def volunteer(
        self,
        worker: str,
        held: Mapping[str, Collection[str]] | None = None,
        room: int | None = None,
        skip: Collection[str] = (),
    ) -> Held | None: ...

    def release(self, model: str, worker: str, sid: str | None = None) -> tuple[str, ...]: ...

    def rejoin(self, model: str, worker: str, *sids: str) -> int: ...

    def retire(self, model: str, worker: str, sid: str) -> str | None: ...


class BoardMarket:
    """The market run by the worker itself through the board's atomic scripts."""

    def __init__(self, board: Board) -> None:
        self.board = board

    def volunteer(
        self,
        worker: str,
        held: Mapping[str, Collection[str]] | None = None,
        room: int | None = None,
        skip: Collection[str] = (),
    ) -> Held | None:
        held = held or {}
        for model in self.board.models():
            if model in skip:
                continue
            sid = self.board.volunteer(model, worker, room, held.get(model, ()))
            if sid is not None:
                return Held(model, sid)
        return None

    def release(self, model: str, worker: str, sid: str | None = None) -> tuple[str, ...]:
        return self.board.release(model, worker, sid)

    def rejoin(self, model: str, worker: str, *sids: str) -> int:
        return self.board.rejoin(model, worker, *sids)

    def retire(self, model: str, worker: str, sid: str) -> str | None:
        return self.board.retire(model, worker, sid)


def _room(text: str) -> int | None:
    """An ask's `room`: bytes, or None (any size) when empty or not a number."""
    try:
        return max(0, int(text)) if text else None
    except ValueError:
        return None


def _s(v: bytes | None) -> str:
    return v.decode() if v is not None else ""


class MarketDoor:
    """The worker's side of the monitor-run market; each call waits up to `wait_s`."""

    def __init__(
        self, r: redis.Redis, keys: Keys, instance: str, wait_s: float, maxlen: int
    ) -> None:
        self.r, self.keys, self.instance, self.wait_s = r, keys, instance, wait_s
        self.maxlen = maxlen
        self._cluster = is_cluster(r)
        self._seq = itertools.count()
        self._cursor = b"0-0"
        self._lock = threading.Lock()  # the heartbeat thread asks too: one reader of answers

    def _ask(
        self, worker: str, op: str, model: str = "", sid: str = "", **more: str
    ) -> dict[str, str] | None:
        """Send one ask and wait for its answer (None: no monitor answered in time)."""
        with self._lock:
            return self._ask_locked(worker, op, model, sid, more)

    def _ask_locked(
        self, worker: str, op: str, model: str, sid: str, more: dict[str, str]
    ) -> dict[str, str] | None:
        nonce = f"{self.instance}:{next(self._seq)}"
        fields = {
            "v": "1",
            "op": op,
            "model": model,
            "slice": sid,
            "instance": self.instance,
            "nonce": nonce,
            **more,
        }
        pipe = self.r.pipeline(transaction=False)
        xadd(pipe, self.keys.worker_asks(worker), fields, _ASKS_MAXLEN)
        if self._cluster:  # the ask before its doorbell: a cluster runs the parts in no order
            pipe.execute()
            pipe = self.r.pipeline(transaction=False)
        xadd(pipe, self.keys.market(), {"worker": worker}, self.maxlen)
        pipe.execute()
        deadline = time.monotonic() + self.wait_s
        answers = self.keys.worker_answers(worker)
        while (left := deadline - time.monotonic()) > 0:
            resp = self.r.xread({answers: self._cursor}, count=16, block=max(1, int(left * 1000)))
            entries = [e for _, batch in resp or [] for e in batch]
            if not entries:
                continue
            self._cursor = entries[-1][0]
            self.r.xdel(answers, *[eid for eid, _ in entries])
            for _, f in entries:
                got = {_s(k): _s(v) for k, v in f.items()}
                if got.get("nonce") == nonce:
                    if got.get("in_use"):
                        raise IdentityInUse(f"the monitor refused {op} of {worker}: {got['error']}")
                    if got.get("error"):  # as if unanswered: the caller asks again later
                        log.warning("the monitor refused %s of %s: %s", op, worker, got["error"])
                        return None
                    return got
        log.info("no monitor answered %s of %s within %.1fs", op, worker, self.wait_s)
        return None

    def volunteer(
        self,
        worker: str,
        held: Mapping[str, Collection[str]] | None = None,
        room: int | None = None,
        skip: Collection[str] = (),
    ) -> Held | None:
        more = {"held": holds_text(held or {}), "room": "" if room is None else str(room)}
        if skip:
            more["skip"] = ",".join(sorted(skip))
        got = self._ask(worker, VOLUNTEER, **more)
        return Held(got["model"], got["slice"]) if got and got.get("slice") else None

    def release(self, model: str, worker: str, sid: str | None = None) -> tuple[str, ...]:
        got = self._ask(worker, RELEASE, model, sid or "")
        return split_slices(got.get("slice")) if got else ()

    def rejoin(self, model: str, worker: str, *sids: str) -> int:
        # the workers hash is readable: ask only for the slices the monitor forgot
        listed = split_slices(self.r.hget(self.keys.model_workers(model), worker))
        missing = [sid for sid in dict.fromkeys(sids) if sid and sid not in listed]
        if not missing:
            return 0
        return len(missing) if self._ask(worker, REJOIN, model, join_slices(missing)) else 0

    def retire(self, model: str, worker: str, sid: str) -> str | None:
        got = self._ask(worker, RETIRE, model, sid)
        return (got.get("slice") or None) if got else None


class MarketDesk:
    """The monitor's side: answers the asks of workers that rang the doorbell."""

    def __init__(self, board: Board, r: redis.Redis, keys: Keys, maxlen: int) -> None:
        self.board, self.r, self.keys, self.maxlen = board, r, keys, maxlen
        self.market = BoardMarket(board)
        self._cursor = b"0-0"
        self.answered = 0
        self.refused = 0

    def serve(self, block_ms: int | None, also: Iterable[str] = ()) -> int:
        """Answer every ask of the workers whose doorbell rang, and of those in `also` (found
        with asks waiting by the quota watch: a worker may trim the doorbells away); the
        number answered."""
        resp = self.r.xread({self.keys.market(): self._cursor}, count=256, block=block_ms)
        entries = [e for _, batch in resp or [] for e in batch]
        if entries:
            self._cursor = entries[-1][0]
            self.r.xdel(self.keys.market(), *[eid for eid, _ in entries])
        workers = dict.fromkeys([*(_s(f.get(b"worker"))[:128] for _, f in entries), *also])
        return sum(self._serve_one(w) for w in workers)

    def _serve_one(self, worker: str) -> int:
        """`serve_worker`, where a worker that made its asks or answers stream another type
        is skipped (its fault, logged by `blame`), not every worker after it in the batch."""
        try:
            return self.serve_worker(worker)
        except redis.ResponseError as exc:
            if not is_peer_fault(exc):
                raise
            blame(self.keys.worker_asks(worker), exc, worker)
            return 0

    def serve_worker(self, worker: str) -> int:
        try:
            check_id("worker id", worker)
        except KvqError:  # no worker can have written under that name: a forged doorbell
            return 0
        asks = self.keys.worker_asks(worker)
        entries = self.r.xrange(asks, count=_ASKS_MAXLEN)
        for eid, f in entries:
            ask = {_s(k): _s(v) for k, v in f.items()}
            try:
                answer = self._answer(worker, ask)
            except (KvqError, redis.ResponseError) as exc:  # answered, never retried forever
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            answer |= {"v": "1", "nonce": ask.get("nonce", "")}
            pipe = self.r.pipeline(transaction=False)
            xadd(pipe, self.keys.worker_answers(worker), answer, _ASKS_MAXLEN)
            pipe.expire(self.keys.worker_answers(worker), self.board.lifetimes.worker_info_s())
            pipe.xdel(asks, eid)
            pipe.execute()
            self.answered += 1
        return len(entries)

    def _barred_in(self, worker: str) -> set[str]:
        """The models in which `worker` is quarantined, banned or drained now."""
        now_ms = self.board.now_ms()
        return {
            m
            for m in self.board.models()
            if (q := self.board.quarantined(m).get(worker)) and q.idle(now_ms)
        }

    def granted(self, model: str, worker: str) -> set[str]:
        """The slices of `model` this monitor (or one before it) granted `worker`."""
        return {_s(m) for m in self.r.smembers(self.keys.model_grant(model, worker))}

    def _grant(self, model: str, worker: str, sids: Collection[str]) -> None:
        # in Redis, so that a restarted monitor honours the grants of the one before it; kept
        # GRANT_TTL_S after the last grant (a worker gone that long volunteers afresh)
        pipe = self.r.pipeline(transaction=False)
        pipe.sadd(self.keys.model_grant(model, worker), *sids)
        pipe.expire(self.keys.model_grant(model, worker), GRANT_TTL_S)
        pipe.execute()

    def _rejoin(self, worker: str, model: str, sids: tuple[str, ...]) -> dict[str, str]:
        """A worker counts its slices again (it outlived its reap, or Redis lost its keys).
        Taken only for slices this desk granted it, or that are still wanted (replica target
        above coverage), as a volunteer would get them: a worker that holds nothing cannot list
        itself beside every slice's holders and fake coverage."""
        info = self.board.model_info(model)
        bad = [s for s in sids if info is None or s not in info.slices]
        if bad or not sids:
            return {
                "error": f"no slice {join_slices(bad) or join_slices(sids)!r} of model {model!r}"
            }
        mine = self.granted(model, worker)
        demand = self.board.slice_demand(model)
        wanted = {sid for sid, d in demand.items() if d.target > d.coverage}
        taken = [s for s in sids if s in mine or s in wanted]
        refused = [s for s in sids if s not in taken]
        if taken:
            self.market.rejoin(model, worker, *taken)
            self._grant(model, worker, taken)
        if refused:
            self.refused += 1
            log.warning(
                "refused rejoin of %s to %s of %s: never granted here and not wanted",
                worker,
                join_slices(refused),
                model,
            )
            if not taken:
                return {
                    "error": f"rejoin of {join_slices(refused)} of {model!r} refused: not "
                    "granted by this monitor and not wanted; volunteer instead"
                }
        return {"model": model, "slice": join_slices(taken)}

    def _answer(self, worker: str, ask: dict[str, str]) -> dict[str, str]:
        op, model, sid = ask.get("op", ""), ask.get("model", ""), ask.get("slice", "")
        live = self.board.worker_instance(worker)
        if live and live != ask.get("instance"):  # "" or None: no process claims it now
            self.refused += 1
            log.warning("refused %s of %s: another live process uses this id", op, worker)
            return {
                "error": f"worker id {worker!r} is in use by another live process",
                "in_use": "1",
            }
        if op not in _OPS:
            return {"error": f"unknown op {op!r}"}
        if op in (VOLUNTEER, REJOIN):  # a caught worker takes nothing while its verdict lasts
            barred = self._barred_in(worker)
            if op == REJOIN and model in barred:
                self.refused += 1
                return {"error": f"worker {worker!r} is quarantined for {model!r}"}
        if op == VOLUNTEER:
            skip = {m for m in ask.get("skip", "").split(",") if m} | barred
            held = parse_holds(ask.get("held", ""))
            got = self.market.volunteer(worker, held, _room(ask.get("room", "")), skip)
            if got:
                self._grant(got.model, worker, [got.sid])
            return {"model": got.model, "slice": got.sid} if got else {"slice": ""}
        if op == REJOIN:
            return self._rejoin(worker, model, split_slices(sid))
        if op == RELEASE:
            gone = self.market.release(model, worker, sid or None)
            if gone:
                self.r.srem(self.keys.model_grant(model, worker), *gone)
            return {"model": model, "slice": join_slices(gone)}
        if not sid:  # an ask from a worker that held one slice per model: that one
            sid = next(iter(self.board.assignments(model).get(worker, ())), "")
        retired = self.market.retire(model, worker, sid)
        if retired:
            self.r.srem(self.keys.model_grant(model, worker), retired)
        return {"model": model, "slice": retired or ""}
