"""`RedisBoard`: the board on a Redis server (keys from `kvq.keys`, records from `records`).

Every write that belongs together goes in one pipeline, and every pipeline stays inside one
hash tag (`{m:..}`, `{w:..}`, `{c:..}`) except where noted, so a Redis Cluster can serve it.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import cast

import redis

from kvq import wire
from kvq.bus.board import CoordinatorView, Fields, Peers, spread_jobs, worker_view
from kvq.bus.clock import ServerClock, read_server_ms
from kvq.bus.connection import connect
from kvq.bus.peers import blame, is_peer_fault
from kvq.bus.records import (
    DEPARTED_KEEP_S,
    VERDICTS_KEPT,
    CoordStats,
    Departure,
    InFlight,
    Lifetimes,
    ModelEntry,
    ModelState,
    Quarantine,
    SliceDemand,
    SlotState,
    WorkerInfo,
    WorkerView,
)
from kvq.bus.scripts import Scripts
from kvq.bus.streams import is_cluster, unanswered, xadd
from kvq.catalog import ModelInfo, meta_from_dict, meta_to_dict
from kvq.errors import ConfigError, WireError
from kvq.keys import Keys, request_streams, split_slices
from kvq.settings_parts import BusSettings
from kvq.slices import SliceSpec


def _s(b: bytes) -> str:
    return b.decode()


_INFO_FIELDS = WorkerInfo.fields()
_MAX_INSTANCE = 512  # bytes of a beat's instance token read (`WorkerInfo.instance`: Text512)


def _read_info(pipe: redis.client.Pipeline, key: str) -> None:
    """Queue the read of a worker's `info` hash: only the fields kvq knows (`HMGET`), so a
    hash of 10^5 fields costs what one of 15 does."""
    pipe.hmget(key, list(_INFO_FIELDS))


def _known_fields(values: list[bytes | None]) -> dict[bytes, bytes]:
    """An `HMGET` reply as the hash of the fields that are set."""
    return {f.encode(): v for f, v in zip(_INFO_FIELDS, values, strict=True) if v is not None}


class RedisBoard:
    """The board of one prefix on one Redis client."""

    def __init__(
        self, r: redis.Redis, keys: Keys, lifetimes: Lifetimes, stream_maxlen: int = 10_000
    ) -> None:
        self.r, self.keys, self.lifetimes = r, keys, lifetimes
        self.maxlen = stream_maxlen
        self.scripts = Scripts(r, keys)
        self.clock = ServerClock(read_server_ms(r, keys.models()))
        self.cluster = is_cluster(r)  # pipelines over several slots lose their order there

    # -- models ---------------------------------------------------------------------------
    def models(self) -> list[str]:
        return sorted(_s(m) for m in self.r.smembers(self.keys.models()))

    def register_model(self, info: ModelInfo, base_replicas: int, restore: bool = False) -> bool:
        k, m = self.keys, info.model
        if restore and self.model_removed(m):
            return False  # a `model rm` racing this restore: the monitor's next tick removes it
        meta = info.meta
        entry = ModelEntry(
            source=info.source,
            arch=meta.arch,
            block_count=meta.block_count,
            expert_count=meta.expert_count,
            expert_used_count=meta.expert_used_count,
            slice_count=len(info.slices),
            meta=json.dumps(meta_to_dict(meta)),
            header_sha256=info.header_sha256,
            request_shards=info.request_shards,
        )
        self._check_shards(m, info.request_shards)
        pipe = self.r.pipeline(transaction=True)
        if not restore:
            pipe.delete(k.model_removed(m))
        pipe.hset(k.model_meta(m), mapping=entry.to_hash())
        pipe.delete(k.model_slices(m))
        pipe.hset(k.model_slices(m), mapping={s.sid: s.to_json() for s in info.slices.values()})
        pipe.hset(k.model_target(m), mapping=dict.fromkeys(info.slices, base_replicas))
        pipe.execute()
        self.r.sadd(k.models(), m)  # another hash slot: not in the transaction (Redis Cluster)
        return True

    def unregister_model(self, model: str) -> list[str]:
        k, m = self.keys, model
        shards = request_shards(self.r, k, m) or 1
        holders = sorted(_s(w) for w in self.r.hkeys(k.model_workers(m)))
        self.r.set(k.model_removed(m), int(self.now_ms()))  # first: no monitor restores it
        self.r.srem(k.models(), m)
        own = [
            k.model_meta(m),
            k.model_slices(m),
            k.model_target(m),
            k.model_coverage(m),
            k.model_routed(m),
            k.model_workers(m),
            k.model_coordinators(m),
            k.model_state(m),
            k.model_quarantine(m),
            k.model_verdicts(m),
            k.model_cancels(m),
            *(k.model_grant(m, w) for w in holders),
        ]
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(*own, k.model_requests(m))
        pipe.execute()
        for stream in request_streams(k, m, shards)[1:]:  # each shard its own hash slot
            self.r.delete(stream)
        return holders

    def forget_removed_model(self, model: str, shards: int) -> None:
        if not self.model_removed(model):
            return  # registered again meanwhile
        k, m = self.keys, model
        own = (k.model_routed(m), k.model_coordinators(m), k.model_quarantine(m))
        self.r.delete(*own, k.model_verdicts(m))  # one hash tag: one slot
        for stream in request_streams(k, m, shards):  # each shard its own hash slot
            self.r.delete(stream)

    def model_removed(self, model: str) -> bool:
        return bool(self.r.exists(self.keys.model_removed(model)))

    def shard_count(self, model: str) -> int:
        """How many request streams `model` has (1 when not registered)."""
        return request_shards(self.r, self.keys, model) or 1

    def _check_shards(self, model: str, shards: int) -> None:
        """A registered model's shard count changes only while its request streams are empty:
        requests queued on a shard nobody reads any more would never be answered."""
        old = ModelEntry.from_hash(self.r.hgetall(self.keys.model_meta(model)))
        if old is None or old.request_shards == shards:
            return
        streams = request_streams(self.keys, model, old.request_shards)
        queued = sum(int(self.r.xlen(s)) for s in streams)
        if queued:
            raise ConfigError(
                f"KVQ_REQUEST_SHARDS={shards}: model {model!r} is registered with "
                f"{old.request_shards} request shards, and {queued} requests are still queued "
                "on them; let them drain (or keep the old count), then register again"
            )

    def model_info(self, model: str) -> ModelInfo | None:
        entry = ModelEntry.from_hash(self.r.hgetall(self.keys.model_meta(model)))
        if entry is None:
            return None
        table = self.r.hgetall(self.keys.model_slices(model))
        slices = {_s(k): SliceSpec.from_json(_s(k), v) for k, v in table.items()}
        meta = meta_from_dict(json.loads(entry.meta))
        return ModelInfo(
            model, entry.source, meta, slices, entry.header_sha256, entry.request_shards
        )

    def model_intact(self, model: str) -> bool:
        k = self.keys
        if not self.r.sismember(k.models(), model):
            return False
        return int(self.r.exists(k.model_meta(model), k.model_slices(model))) == 2  # one tag

    def publish_model_state(
        self, model: str, state: ModelState, targets: Mapping[str, int] | None = None
    ) -> None:
        k = self.keys
        sids = [_s(x) for x in self.r.hkeys(k.model_slices(model))]
        pipe = self.r.pipeline(transaction=False)
        if sids:
            wanted = {sid: (targets or {}).get(sid, state.effective_target) for sid in sids}
            pipe.hset(k.model_target(model), mapping=wanted)
        pipe.hset(k.model_state(model), mapping=state.to_hash())
        pipe.execute()

    def hold_lease(self, holder: str, ttl_s: float) -> bool:
        return self.scripts.lease(self.r, holder, max(1, int(ttl_s * 1000)))

    def drop_lease(self, holder: str) -> None:
        self.scripts.lease(self.r, holder, 0)

    def lease_holder(self) -> str | None:
        got = self.r.get(self.keys.monitor_lease())
        return _s(got) if got else None

    def add_routed(self, model: str, rows: Mapping[str, int]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for sid, n in rows.items():
            if n > 0:
                pipe.hincrby(self.keys.model_routed(model), sid, n)
        pipe.execute()

    def routed(self, model: str) -> dict[str, int]:
        return {_s(k): int(v) for k, v in self.r.hgetall(self.keys.model_routed(model)).items()}

    def model_state(self, model: str) -> ModelState | None:
        return ModelState.from_hash(self.r.hgetall(self.keys.model_state(model)))

    # -- the market -----------------------------------------------------------------------
    def slice_demand(self, model: str) -> dict[str, SliceDemand]:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.model_target(model))
        pipe.hgetall(self.keys.model_coverage(model))
        target_h, cover_h = pipe.execute()
        target = {_s(k): int(v) for k, v in target_h.items()}
        cover = {_s(k): int(v) for k, v in cover_h.items()}
        return {sid: SliceDemand(target[sid], cover.get(sid, 0)) for sid in sorted(target)}

    def set_target(self, model: str, sid: str, replicas: int) -> None:
        self.r.hset(self.keys.model_target(model), sid, replicas)

    def assignments(self, model: str) -> dict[str, tuple[str, ...]]:
        raw = self.r.hgetall(self.keys.model_workers(model))
        got = {_s(w): split_slices(v) for w, v in raw.items()}
        return {w: sids for w, sids in got.items() if sids}

    def held_by(self, model: str, worker: str) -> tuple[str, ...]:
        return split_slices(self.r.hget(self.keys.model_workers(model), worker))

    def volunteer(
        self, model: str, worker: str, room: int | None = None, held: Collection[str] = ()
    ) -> str | None:
        return self.scripts.volunteer(self.r, model, worker, room, held)

    def release(self, model: str, worker: str, sid: str | None = None) -> tuple[str, ...]:
        return self.scripts.release(self.r, model, worker, sid)

    def rejoin(self, model: str, worker: str, *sids: str) -> int:
        return self.scripts.rejoin(self.r, model, worker, *sids)

    def retire(self, model: str, worker: str, sid: str) -> str | None:
        return self.scripts.retire(self.r, model, worker, sid)

    # -- workers --------------------------------------------------------------------------
    def workers(self, model: str) -> list[WorkerView]:
        assigned = sorted(self.assignments(model).items())
        if not assigned:
            return []
        pipe = self.r.pipeline(transaction=False)
        for w, _ in assigned:
            pipe.exists(self.keys.worker_heartbeat(w))  # the liveness rule: the beat is up
            _read_info(pipe, self.keys.worker_info(w))
        got = pipe.execute(raise_on_error=False)
        out: list[WorkerView] = []
        for i, (w, sids) in enumerate(assigned):
            alive, info = got[2 * i], self._info(w, got[2 * i + 1])
            if isinstance(alive, Exception):  # EXISTS takes any type: the server's trouble
                raise alive
            out.extend(worker_view(w, sid, bool(alive), info, model) for sid in sids)
        return out

    def _info(self, worker: str, reply: object) -> WorkerInfo | None:
        """A worker's record from its `HMGET` reply; None (the worker skipped, as if it had
        no record) when its `info` key is not a hash: the worker wrote it so."""
        if isinstance(reply, Exception):
            if not is_peer_fault(reply):
                raise reply
            blame(self.keys.worker_info(worker), reply, worker)
            return None
        return WorkerInfo.from_hash(_known_fields(cast(list[bytes | None], reply)))

    def beat(self, worker: str, info: WorkerInfo) -> int:
        k, life = self.keys, self.lifetimes
        pipe = self.r.pipeline(transaction=False)
        pipe.set(k.worker_heartbeat(worker), info.instance, px=life.heartbeat_ms())
        pipe.hset(k.worker_info(worker), mapping=info.to_hash())
        pipe.expire(k.worker_info(worker), life.worker_info_s())
        pipe.xlen(k.worker_inbox(worker))  # answered entries are deleted: what is left waits
        return int(pipe.execute()[-1])

    def worker_info(self, worker: str) -> WorkerInfo | None:
        pipe = self.r.pipeline(transaction=False)
        _read_info(pipe, self.keys.worker_info(worker))
        return self._info(worker, pipe.execute(raise_on_error=False)[0])

    def worker_alive(self, worker: str) -> bool:
        return bool(self.r.exists(self.keys.worker_heartbeat(worker)))

    def heartbeat_ages_s(self, workers: Sequence[str]) -> dict[str, float | None]:
        """Seconds since each worker's last beat (each beat resets its key's TTL); None when
        the beat lapsed. For operators' views (the monitor's dashboard)."""
        pipe = self.r.pipeline(transaction=False)
        for w in workers:
            pipe.pttl(self.keys.worker_heartbeat(w))
        ttl_ms = self.lifetimes.heartbeat_ms()
        return {
            w: round(max(0, ttl_ms - left) / 1000, 1)
            if isinstance(left, int) and left >= 0
            else None
            for w, left in zip(workers, pipe.execute(), strict=True)
        }

    def claim_worker(self, worker: str, instance: str) -> bool:
        hb = self.keys.worker_heartbeat(worker)
        if self.r.set(hb, instance, nx=True, px=self.lifetimes.heartbeat_ms()):
            return True
        return self.worker_instance(worker) == instance

    def worker_instance(self, worker: str) -> str | None:
        """The instance token in `worker`'s beat; None without a beat. Read boundedly
        (`GETRANGE`), and "" when the worker made its beat another type (`blame`)."""
        key = self.keys.worker_heartbeat(worker)
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(key)
        pipe.getrange(key, 0, _MAX_INSTANCE - 1)
        there, got = pipe.execute(raise_on_error=False)
        if isinstance(there, Exception):
            raise there
        if not there:
            return None
        if isinstance(got, Exception):
            if not is_peer_fault(got):
                raise got
            blame(key, got, worker)
            return ""
        return _s(got)

    def forget_worker(self, worker: str) -> None:
        k = self.keys
        self.r.delete(
            k.worker_heartbeat(worker),
            k.worker_info(worker),
            k.worker_inbox(worker),
            k.worker_asks(worker),
            k.worker_answers(worker),
        )

    def record_departure(self, worker: str, departure: Departure) -> None:
        key = self.keys.departed()
        old = {_s(w): Departure.from_json(v) for w, v in self.r.hgetall(key).items()}
        cutoff = departure.ts_ms - DEPARTED_KEEP_S * 1000
        pipe = self.r.pipeline(transaction=False)
        stale = [w for w, d in old.items() if d is None or d.ts_ms < cutoff]
        if stale:
            pipe.hdel(key, *stale)
        pipe.hset(key, worker, departure.to_json())
        pipe.execute()

    def departures(self) -> dict[str, Departure]:
        raw = self.r.hgetall(self.keys.departed())
        cutoff = self.now_ms() - DEPARTED_KEEP_S * 1000
        got = {_s(w): Departure.from_json(v) for w, v in raw.items()}
        return {w: d for w, d in sorted(got.items()) if d is not None and d.ts_ms >= cutoff}

    def quarantine(self, model: str, worker: str, verdict: Quarantine) -> None:
        pipe = self.r.pipeline(transaction=False)  # one hash tag, {m:M}: one slot
        pipe.hset(self.keys.model_quarantine(model), worker, verdict.to_json())
        log_entry = {b"worker": worker.encode(), b"verdict": verdict.to_json()}
        xadd(pipe, self.keys.model_verdicts(model), log_entry, VERDICTS_KEPT)
        pipe.execute()

    def verdict_history(self, model: str, worker: str) -> list[Quarantine]:
        """`worker`'s verdicts in `model`, newest first, among the last VERDICTS_KEPT."""
        rows = self.r.xrevrange(self.keys.model_verdicts(model), count=VERDICTS_KEPT)
        got = [
            Quarantine.from_json(f.get(b"verdict", b""))
            for _, f in rows
            if f.get(b"worker") == worker.encode()
        ]
        return [q for q in got if q is not None]

    def quarantined(self, model: str) -> dict[str, Quarantine]:
        raw = self.r.hgetall(self.keys.model_quarantine(model))
        got = {_s(w): Quarantine.from_json(v) for w, v in raw.items()}
        return {w: q for w, q in sorted(got.items()) if q is not None}

    def send_jobs(self, jobs: Sequence[tuple[str, Fields]]) -> None:
        if not jobs:
            return
        # one MULTI/EXEC on one server: a worker blocked on its inbox wakes once, to every
        # job of the step (Redis serves a blocked reader after each command otherwise, so it
        # took a layer's first job alone and paid one more round trip for the rest); on a
        # cluster, one inbox per tag: independent appends
        pipe = self.r.pipeline(transaction=not self.cluster)
        for worker, fields in jobs:
            xadd(pipe, self.keys.worker_inbox(worker), fields, self.maxlen)
        self._blame_inboxes(jobs, pipe.execute(raise_on_error=False))

    def _blame_inboxes(self, jobs: Sequence[tuple[str, Fields]], replies: list[object]) -> None:
        """A job refused by its inbox (the worker made it another type) is lost to that worker
        alone: its deadline passes and the job is recomputed or asked of another holder."""
        for (worker, _), reply in zip(jobs, replies, strict=True):
            if isinstance(reply, Exception):
                if not is_peer_fault(reply):
                    raise reply
                blame(self.keys.worker_inbox(worker), reply, worker)

    def requeue_inbox(self, dead: str, peers: Sequence[str] | Peers) -> int:
        inbox = self.keys.worker_inbox(dead)
        moves = spread_jobs([f for _, f in unanswered(self.r, inbox)], peers)
        self.send_jobs(moves)
        self.r.delete(inbox)
        return len(moves)

    # -- coordinators ---------------------------------------------------------------------
    def publish_slots(
        self,
        coord: str,
        state: SlotState,
        stats: CoordStats,
        inflight: Iterable[InFlight] = (),
    ) -> bool:
        k, life = self.keys, self.lifetimes
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(k.coord_slots(coord), mapping=state.to_hash())  # fields added: new record
        pipe.expire(k.coord_slots(coord), life.slots_s())
        pipe.hset(k.coord_stats(coord), mapping=stats.to_hash())
        pipe.expire(k.coord_stats(coord), life.coordinator_s())
        pipe.set(k.coord_inflight(coord), InFlight.encode_list(inflight), ex=life.slots_s())
        got = []
        if self.cluster:  # {c:C} and {m:M}: a cluster runs the parts in no order, so wait
            got = pipe.execute()
            pipe = self.r.pipeline(transaction=False)
        # after the slots: the monitor drops members whose slots key is gone
        pipe.sadd(k.model_coordinators(state.model), coord)
        got += pipe.execute()
        return bool(got[0]) or bool(got[-1])

    def coordinators(self, model: str) -> list[CoordinatorView]:
        coords = sorted(_s(c) for c in self.r.smembers(self.keys.model_coordinators(model)))
        if not coords:
            return []
        pipe = self.r.pipeline(transaction=False)
        for c in coords:
            pipe.hgetall(self.keys.coord_slots(c))
        now_ms = self.now_ms()
        out = []
        for c, h in zip(coords, pipe.execute(), strict=True):
            state = SlotState.from_hash(h)
            out.append(CoordinatorView(c, state, self.lifetimes.coordinator_alive(state, now_ms)))
        return out

    def forget_coordinator(self, model: str, coord: str) -> None:
        self.r.srem(self.keys.model_coordinators(model), coord)

    def coordinator_alive(self, coord: str) -> bool:
        state = SlotState.from_hash(self.r.hgetall(self.keys.coord_slots(coord)))
        return self.lifetimes.coordinator_alive(state, self.now_ms())

    def now_ms(self) -> float:
        return self.clock.now_ms()

    def coord_stats(self, coord: str) -> CoordStats | None:
        return CoordStats.from_hash(self.r.hgetall(self.keys.coord_stats(coord)))

    def in_flight(self, coords: Sequence[str]) -> list[InFlight]:
        """The requests `coords` generate now, as each last published them."""
        if not coords:
            return []
        pipe = self.r.pipeline(transaction=False)
        for c in coords:
            pipe.get(self.keys.coord_inflight(c))
        return [row for raw in pipe.execute() for row in InFlight.decode_list(raw)]

    # -- requests: runs and what their reply streams already hold --------------------------
    def start_attempt(self, request: str, entry: bytes) -> int:
        """Start a run of `request` from its stream entry: 1 for the first, more after a
        restart or takeover; 0 if a different entry owns the id (a duplicate request id)."""
        key, eid = self.keys.request_run(request), entry.decode()
        # WATCH/MULTI rather than a script: a coordinator's ACL user runs no scripts
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    owner = pipe.hget(key, "entry")
                    if owner is not None and owner.decode() != eid:
                        return 0
                    # no record: a first run, or Redis lost it; then the runs that wrote this
                    # entry's events count (readers ignore a run numbered below one they saw)
                    runs = 0 if owner is not None else self._runs_seen(request, eid)
                    pipe.multi()
                    pipe.hset(key, mapping={"entry": eid, **({"attempts": runs} if runs else {})})
                    pipe.hincrby(key, "attempts", 1)
                    pipe.expire(key, self.lifetimes.reply_s())
                    return int(pipe.execute()[1])
                except redis.WatchError:
                    continue  # another coordinator started it meanwhile: look again

    def _runs_seen(self, request: str, entry: str) -> int:
        """The highest run number on `request`'s reply stream among `entry`'s events (0 for a
        new request: its reply stream is empty)."""
        return max(
            (e.attempt for e in self.reply_events(request) if e.entry in ("", entry)), default=0
        )

    def reply_events(self, request: str) -> list[wire.ReplyEvent]:
        """The events written so far on `request`'s reply stream, in order (undecodable
        entries skipped: only coordinators write there)."""
        out = []
        for _, fields in self.r.xrange(self.keys.request_reply(request)):
            try:
                out.append(wire.decode(fields, wire.ReplyEvent))
            except WireError:
                continue
        return out

    # -- the gateway's per-key request counter ---------------------------------------------
    def count_api_call(self, key_sha: str, window_s: int) -> tuple[int, float]:
        """Count one call of an API key (by its hash) in its current window: the calls in it
        so far, and the seconds until it ends. The window opens at the key's first call after
        the last one closed; shared by every gateway."""
        name = self.keys.apikey_calls(key_sha)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(name, 0, ex=window_s, nx=True)
        pipe.incr(name)
        pipe.pttl(name)
        _, n, left_ms = pipe.execute()
        return int(n), max(0, int(left_ms)) / 1000


def open_board(bus: BusSettings, lifetimes: Lifetimes) -> RedisBoard:
    """A board on a new client for `KVQ_REDIS_URL` (see `kvq.bus.connect`)."""
    return RedisBoard(connect(bus), Keys(bus.prefix), lifetimes, bus.stream_maxlen)


def request_shards(r: redis.Redis, keys: Keys, model: str) -> int | None:
    """How many request streams `model` has (`KVQ_REQUEST_SHARDS` of the monitor that
    registered it), or None if no monitor registered it under this prefix: what a client asks
    before queueing a request (nobody would answer one for an unregistered model), in one
    round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.sismember(keys.models(), model)
    pipe.hget(keys.model_meta(model), "request_shards")
    registered, shards = pipe.execute()
    if not registered:
        return None
    try:
        return max(1, int(shards)) if shards is not None else 1  # None: an older monitor
    except ValueError:
        return 1
