"""Every Redis key kvq uses, built in one place.

Keys carry a hash tag so that a Redis Cluster keeps what one script or pipeline touches in one
slot: a model's control keys share `{m:<model>}`, each worker's keys `{w:<worker>}`, each
coordinator's `{c:<coord>}`, each request's `{r:<request>}`. `P` is the prefix (`KVQ_PREFIX`,
default `kvq`). `docs/streams.md` mirrors this table with `redis-cli` lines.

| key                          | type   | writer → readers                           |
|------------------------------|--------|--------------------------------------------|
| P:models                     | set    | monitor → workers, monitor                 |
| P:{m:M}:meta                 | hash   | monitor (register) → workers, API          |
| P:{m:M}:slices               | hash   | monitor: slice id → JSON layout + sha256   |
| P:{m:M}:target               | hash   | monitor: slice id → wanted replicas        |
| P:{m:M}:coverage             | hash   | volunteer script / reaper: slice → workers |
| P:{m:M}:routed               | hash   | coordinators: slice → token rows routed (a counter) |
| P:{m:M}:workers              | hash   | volunteer script: worker → its slice ids,  |
|                              |        | sorted, joined by "," (`join_slices`)      |
| P:{m:M}:coordinators         | set    | coordinator → monitor                      |
| P:{m:M}:requests             | stream | clients → coordinators (group): shard 0    |
| P:{m:M#I}:requests           | stream | the same, shard I (1 ≤ I < request_shards) |
| P:{m:M}:cancel               | stream | clients → coordinators: requests given up  |
| P:{m:M}:state                | hash   | monitor: saturated, busy, targets, ts_ms   |
| P:{m:M}:quarantine           | hash   | coordinators: worker → JSON verdict (until,|
|                              |        | mismatches, banned) → coordinators, monitor|
| P:{m:M}:verdicts             | stream | every verdict written to `quarantine`, |
|                              |        | in order (capped) → dashboard (history)    |
| P:{m:M}:removed              | string | `kvq model rm`: ms it was unregistered →   |
|                              |        | monitor (never restores M); cleared by a   |
|                              |        | registration of M                          |
| P:{w:W}:inbox                | stream | coordinators → worker W (group)            |
| P:{w:W}:hb                   | string | worker W (expires) → coordinators, monitor |
| P:{w:W}:info                 | hash   | worker W: holds (its slices), model, slice,|
|                              |        | device, served, last_serve_ms (expires)    |
| P:{w:W}:results:C            | stream | worker W → coordinator C (W's results to C) |
| P:{w:W}:asks                 | stream | worker W → monitor: market requests        |
| P:{w:W}:answers              | stream | monitor → worker W: market answers         |
| P:{w:W}:dead                 | stream | worker W (under its ACL user) → monitor:   |
|                              |        | its dead letters, moved to P:deadletter    |
| P:market                     | stream | workers → monitor: "look at my asks"       |
| P:{c:C}:slots                | hash   | coordinator C: busy, total, ts_ms          |
| P:{c:C}:stats                | hash   | coordinator C: job counters                |
| P:{c:C}:inflight             | string | coordinator C: JSON list of the requests   |
|                              |        | it generates now → monitor (dashboard)     |
| P:{r:R}:reply                | stream | coordinator → client of request R          |
| P:{r:R}:run                  | hash   | coordinators: entry owning id R, attempts  |
| P:deadletter                 | stream | coordinators, trusted workers, the monitor |
|                              |        | (moving P:{w:W}:dead) → operators          |
| P:departed                   | hash   | monitor: departed worker → JSON (when, why,|
|                              |        | what it held) → dashboard, for an hour     |
| P:monitor:lease              | string | the active monitor's id, expiring (lease.lua) |
| P:bench:<name>               | stream | `kvq bench` scratch, deleted per round     |
| P:bench:{T}:inbox, :results  | stream | `kvq bench bus --cluster` scratch          |
| P:{k:K}:calls                | string | `kvq api`: calls of API key K (a hash of   |
|                              |        | it) in its current minute (expires)        |
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from kvq.errors import ConfigError

WORKER_GROUP = "workers"
SLICE_SEP = ","  # between the slice ids of one worker in `P:{m:M}:workers`
COORDINATOR_GROUP = "coordinators"

# Worker and coordinator ids appear inside ACL key patterns (`P:{w:<id>}:*`), where `*`, `?`,
# `[`, `]` and `\\` are glob syntax and `{`, `}` or `:` would let one id's pattern reach another's
# keys: ids are limited to these characters.
_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def join_slices(sids: Iterable[str]) -> str:
    """A `P:{m:M}:workers` value: the slice ids a worker holds, sorted, joined by "," (slice
    ids never hold one, `kvq.slices.slice_id`); the Lua scripts split and join the same way."""
    return SLICE_SEP.join(sorted(set(sids)))


def split_slices(value: str | bytes | None) -> tuple[str, ...]:
    """The slice ids of a `P:{m:M}:workers` value (`join_slices`), sorted; () for none."""
    if value is None:
        return ()
    text = value.decode() if isinstance(value, bytes) else value
    return tuple(sorted({sid for sid in text.split(SLICE_SEP) if sid}))


def request_shard(request_id: str, shards: int) -> int:
    """Which of a model's `shards` request streams takes request `request_id`: a CRC-32 of
    the id, so every client (in any language) picks the same one, and a reused id lands on
    the stream its first use did."""
    return zlib.crc32(request_id.encode()) % shards if shards > 1 else 0


def request_streams(keys: Keys, model: str, shards: int) -> list[str]:
    """Every request stream of `model`, shard 0 first."""
    return [keys.model_requests(model, i) for i in range(max(1, shards))]


def check_id(what: str, value: str) -> str:
    """`value` if it is a safe worker/coordinator id, else ConfigError saying what is allowed."""
    if not _SAFE_ID.fullmatch(value):
        raise ConfigError(
            f"{what} {value!r} is not allowed: use 1 to 64 of A-Z a-z 0-9 _ . - (ids appear in "
            "ACL key patterns, where other characters are glob syntax or separators)"
        )
    return value


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder bound to one prefix."""

    prefix: str = "kvq"

    # global
    def models(self) -> str:
        return f"{self.prefix}:models"

    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    def departed(self) -> str:
        """Workers that stopped holding slices (`records.Departure` JSON per worker), an hour."""
        return f"{self.prefix}:departed"

    def monitor_lease(self) -> str:
        return f"{self.prefix}:monitor:lease"

    def market(self) -> str:
        """Doorbells of workers with market requests waiting in their own `asks` stream."""
        return f"{self.prefix}:market"

    def bench(self, name: str) -> str:
        """Scratch streams of `kvq bench` (deleted before each round)."""
        return f"{self.prefix}:bench:{name}"

    def bench_tagged(self, tag: str, name: str) -> str:
        """Scratch streams of `kvq bench bus --cluster`, under hash tag `{tag}`."""
        return f"{self.prefix}:bench:{{{tag}}}:{name}"

    # per model
    def _m(self, model: str, what: str) -> str:
        return f"{self.prefix}:{{m:{model}}}:{what}"

    def model_meta(self, model: str) -> str:
        return self._m(model, "meta")

    def model_slices(self, model: str) -> str:
        return self._m(model, "slices")

    def model_target(self, model: str) -> str:
        return self._m(model, "target")

    def model_coverage(self, model: str) -> str:
        return self._m(model, "coverage")

    def model_routed(self, model: str) -> str:
        return self._m(model, "routed")

    def model_workers(self, model: str) -> str:
        return self._m(model, "workers")

    def model_grant(self, model: str, worker: str) -> str:
        """The slices of `model` the monitor granted `worker` (a set, the monitor's alone): what
        a `rejoin` may claim back, across monitor restarts."""
        return self._m(model, f"grant:{worker}")

    def model_coordinators(self, model: str) -> str:
        return self._m(model, "coordinators")

    def model_requests(self, model: str, shard: int = 0) -> str:
        """Request stream `shard` of `model` (`KVQ_REQUEST_SHARDS` of them). Shard 0 keeps the
        model's tag; shard I ≥ 1 has its own, `{m:M#I}` (model ids never hold `#`), so that a
        cluster spreads the shards over its slots and masters."""
        return self._m(model if shard == 0 else f"{model}#{shard}", "requests")

    def model_state(self, model: str) -> str:
        return self._m(model, "state")

    def model_cancels(self, model: str) -> str:
        return self._m(model, "cancel")

    def model_removed(self, model: str) -> str:
        """Set by `kvq model rm` (the time, ms): no monitor publishes `model` again from its
        memory; an explicit registration deletes it."""
        return self._m(model, "removed")

    def model_quarantine(self, model: str) -> str:
        """Workers caught returning wrong results (`records.Quarantine` JSON per worker)."""
        return self._m(model, "quarantine")

    def model_verdicts(self, model: str) -> str:
        """Every verdict written to `model_quarantine`, in order (a capped stream): a worker's
        trust history."""
        return self._m(model, "verdicts")

    # per API key (the gateway's request limit); the key itself is never stored, its hash is
    def apikey_calls(self, key_sha: str) -> str:
        return f"{self.prefix}:{{k:{key_sha}}}:calls"

    # per worker
    def worker_inbox(self, worker: str) -> str:
        return f"{self.prefix}:{{w:{worker}}}:inbox"

    def worker_heartbeat(self, worker: str) -> str:
        return f"{self.prefix}:{{w:{worker}}}:hb"

    def worker_info(self, worker: str) -> str:
        return f"{self.prefix}:{{w:{worker}}}:info"

    def worker_results(self, worker: str, coord: str) -> str:
        """Results of `worker` for `coord`: a worker may write only its own keys, so where a
        result arrives says who computed it."""
        return f"{self.prefix}:{{w:{worker}}}:results:{coord}"

    def worker_asks(self, worker: str) -> str:
        return f"{self.prefix}:{{w:{worker}}}:asks"

    def worker_answers(self, worker: str) -> str:
        return f"{self.prefix}:{{w:{worker}}}:answers"

    def worker_dead(self, worker: str) -> str:
        """Worker `worker`'s own dead letters, which the monitor moves to `deadletter` with
        the worker's id on each: its ACL user may not write the shared stream, where one
        `XADD ... MAXLEN 0` would erase everyone's."""
        return f"{self.prefix}:{{w:{worker}}}:dead"

    # per coordinator

    def coord_slots(self, coord: str) -> str:
        return f"{self.prefix}:{{c:{coord}}}:slots"

    def coord_stats(self, coord: str) -> str:
        return f"{self.prefix}:{{c:{coord}}}:stats"

    def coord_inflight(self, coord: str) -> str:
        """The requests coordinator `coord` generates now (`records.InFlight`, a JSON list)."""
        return f"{self.prefix}:{{c:{coord}}}:inflight"

    # per request
    def request_reply(self, request: str) -> str:
        return f"{self.prefix}:{{r:{request}}}:reply"

    def request_cancel(self, request: str) -> str:
        """Set by the request's client to give up on it (`kvq.client.cancel`): one key per
        request, so no storm of other cancels can hide it."""
        return f"{self.prefix}:{{r:{request}}}:cancel"

    def request_run(self, request: str) -> str:
        """Which request entry owns the id, and how many runs it has had (`start_attempt`)."""
        return f"{self.prefix}:{{r:{request}}}:run"
