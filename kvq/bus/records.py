"""Every hash record kvq writes, its one encode/decode, the TTL rules and the liveness rules.

A record's fields are the hash's fields: `HGETALL` shows them as they are (`docs/streams.md`).
Nothing outside `kvq.bus` names a hash field: the roles get and give these records through a
`Board` (`kvq.bus.board`).

| record       | key                 | written by          | lives                               |
|--------------|---------------------|---------------------|-------------------------------------|
| `ModelEntry` | P:{m:M}:meta        | monitor (register)  | until re-registered                 |
| `ModelState` | P:{m:M}:state       | monitor (each poll) | until overwritten                   |
| `SlotState`  | P:{c:C}:slots       | coordinator C       | `Lifetimes.slots_s()`               |
| `CoordStats` | P:{c:C}:stats       | coordinator C       | `Lifetimes.coordinator_s()`         |
| `InFlight`   | P:{c:C}:inflight    | coordinator C       | `Lifetimes.slots_s()`, a JSON list  |
| `WorkerInfo` | P:{w:W}:info        | worker W            | `Lifetimes.worker_info_s()`         |
| heartbeat    | P:{w:W}:hb (string) | worker W            | `Lifetimes.heartbeat_ms()`          |
| `Quarantine` | P:{m:M}:quarantine  | coordinators        | permanent, one JSON field per worker|
| `Departure`  | P:departed          | monitor (tick)      | `DEPARTED_KEEP_S`, one JSON field per worker |
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple, Self

import msgspec

log = logging.getLogger("kvq.bus")

HashValue = str | int | float


class HashCodec:
    """One hash per struct: one field per struct field; numbers are stored as their text."""

    __slots__ = ()
    __struct_fields__: tuple[str, ...]

    def to_hash(self) -> dict[str, HashValue]:
        out: dict[str, HashValue] = {}
        for name in self.__struct_fields__:
            v = getattr(self, name)
            out[name] = int(v) if isinstance(v, bool) else v
        return out

    @classmethod
    def from_hash(cls, h: Mapping[bytes, bytes] | Mapping[str, HashValue]) -> Self | None:
        """The record, or None when the hash is empty or does not decode (logged: a corrupt
        hash is treated as absent, it must not stop the reader)."""
        if not h:
            return None
        plain = {_text(k): _text(v) for k, v in h.items()}
        try:
            return msgspec.convert(plain, cls, strict=False)
        except msgspec.ValidationError as exc:
            _warn_once(
                f"{cls.__name__}: {exc}",
                "ignoring a %s hash that does not decode (%s): %.200r",
                cls.__name__,
                exc,
                plain,
            )
            return None

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return cls.__struct_fields__


_warned: set[str] = set()


def _warn_once(what: str, msg: str, *args: object) -> None:
    """A warning the first time `what` happens, debug after: a worker that writes the same bad
    record on every beat must not flood the log of every reader."""
    if what in _warned:
        log.debug(msg, *args)
        return
    if len(_warned) < 1024:
        _warned.add(what)
    log.warning(msg, *args)


# Bounds of the fields a worker writes (its `info` hash): past them the record does not decode
# and is ignored (the worker is then as good as absent). Sizes far above any honest value, small
# enough that reading one costs nothing.
Text64 = Annotated[str, msgspec.Meta(max_length=64)]
Text512 = Annotated[str, msgspec.Meta(max_length=512)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]  # NaN and infinity fail the bounds
MAX_JSON_FIELD = 256 * 1024  # `holds`, `queued_by`: JSON text (3,700 slice ids: about 80 KB)


class Record(msgspec.Struct, HashCodec, frozen=True, kw_only=True):
    """A hash record as a frozen value."""


class Counters(msgspec.Struct, HashCodec, kw_only=True):
    """A hash record its writer counts in, in place."""


def _text(v: bytes | HashValue) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class ModelEntry(Record, frozen=True, kw_only=True):
    """A registered model (`meta` hash): where to fetch it and its layout as JSON text."""

    source: str
    arch: str
    block_count: int
    expert_count: int
    expert_used_count: int
    slice_count: int
    meta: str  # kvq.catalog.meta_to_dict(...) as JSON
    header_sha256: str = ""  # of the GGUF bytes before the tensor data ("": an older monitor)
    request_shards: int = 1  # request streams (KVQ_REQUEST_SHARDS; 1: an older monitor)


class ModelState(Record, frozen=True, kw_only=True):
    """The monitor's view of one model after a poll (K6, K7, K13)."""

    saturated: bool = False
    busy: int = 0
    total: int = 0
    coordinators: int = 0
    base_target: int = 0
    effective_target: int = 0
    ts_ms: int = 0

    def fresh(self, now_ms: float, within_s: float) -> bool:
        """Written by a monitor tick within `within_s`: some monitor is running."""
        return now_ms - self.ts_ms <= within_s * 1000

    def public(self) -> dict[str, int | bool]:
        """As `GET /api/moe/recruitment` shows it (K13): every field but the timestamp."""
        return {f: getattr(self, f) for f in self.__struct_fields__ if f != "ts_ms"}


class SlotState(Record, frozen=True, kw_only=True):
    """A coordinator's inference slots (K2), published on its slot-poll thread."""

    model: str
    busy: int
    total: int
    ts_ms: int
    # whether it can recompute expert results itself (False: a backbone file, every expert
    # job goes to workers and replicas check each other): the monitor then wants more copies
    experts: bool = True


INFLIGHT_MOST = 256  # requests one coordinator's `inflight` record lists (its slots: fewer)


class InFlight(msgspec.Struct, frozen=True, kw_only=True):
    """A request a coordinator is generating now: one element of its `inflight` JSON list,
    replaced whole at each slot poll (so it is never older than `KVQ_SLOT_POLL_S`)."""

    request: Text512
    model: Text512
    coordinator: Text64
    grain: Text64  # expert | stage (X12): how its blocks run
    state: Text64  # prefill: reading its prompt; decode: generating
    prompt_tokens: Count
    generated: Count
    max_tokens: Count
    queued_ms: Count  # its request entry's id: when Redis took it (its age is the server's)
    attempt: Count = 1

    @staticmethod
    def encode_list(rows: Iterable[InFlight]) -> bytes:
        return msgspec.json.encode(list(rows)[:INFLIGHT_MOST])

    @staticmethod
    def decode_list(raw: bytes | str | None) -> list[InFlight]:
        """The list, or [] when absent or it does not decode (logged once)."""
        if not raw:
            return []
        try:
            got = msgspec.json.decode(raw, type=list[InFlight])
        except msgspec.DecodeError as exc:
            _warn_once("InFlight", "ignoring an inflight record that does not decode (%s)", exc)
            return []
        return got[:INFLIGHT_MOST]


class DispatchCounters(Counters, kw_only=True):
    """The dispatcher's counters since the coordinator started (counted in place)."""

    local_jobs: int = 0
    remote_sent: int = 0  # jobs whose results the layer waits for
    remote_jobs: int = 0
    trials_sent: int = 0  # K4 trials and re-probes: also computed locally, not waited for
    trials_answered: int = 0
    fallback_jobs: int = 0
    remote_errors: int = 0
    late_results: int = 0
    foreign_results: int = 0  # a result for a job sent to another worker: ignored
    uncovered_local: int = 0
    microbatched_steps: int = 0  # engine steps offered KVQ_MICROBATCHES > 1 micro-batches
    verified: int = 0  # remote results recomputed here before use (spot-checks)
    mismatches: int = 0  # of those, how many disagreed beyond the dtype's tolerance
    max_abs_err: float = (
        0.0  # largest relative row error among the verified (kvq.coordinator.check)
    )
    nonfinite_results: int = 0  # results holding NaN or infinity: rejected, recomputed here
    barred_results: int = 0  # results of quarantined or banned workers: not used
    quarantines: int = 0  # workers this coordinator caught and quarantined
    witness_jobs: int = 0  # without experts: jobs sent to a second holder to confirm a result
    unwitnessed: int = 0  # without experts: results drawn for a check that no other holder had
    unresolved: int = 0  # without experts: jobs whose answers disagreed with none left to ask
    remote_rows: int = 0  # token rows of remote results received
    verified_rows: int = 0  # of those, rows recomputed here to check them
    local_expert_s: float = 0.0  # seconds computing expert slices here (kept, fallbacks, checks)
    local_rows: int = 0  # token rows of those slices: local_expert_s / local_rows is a row's cost
    remote_wait_s: float = 0.0  # seconds a layer waited for remote results after its own part
    remote_send_s: float = 0.0  # seconds making, encoding and sending remote jobs
    stage_replays: int = 0  # stage grain: sequences whose state was rebuilt by replaying them
    stage_moves: int = 0  # stage grain: sequences moved to another holder of a span


class CoordStats(DispatchCounters, kw_only=True):
    """A coordinator's counters as published: dispatch, bank hit rates, requests."""

    hot_hit_rate: float = 0.0
    cold_hit_rate: float = 0.0
    replans: int = 0
    rescues: int = 0
    completed: int = 0
    tokens: int = 0
    claimed: int = 0
    finishes: str = "{}"  # JSON {finish reason or "error": requests}
    # `kvq.bus.histogram.Histogram` texts, seconds ("" before the first observation)
    job_rtt_s: str = ""  # a remote job: sent -> its result read
    ttft_s: str = ""  # a request: admitted -> its first token event written
    token_gap_s: str = ""  # between two token events of one request
    stage_wait_s: str = "{}"  # stage grain: JSON {span slice id: seconds waited for its jobs}


class Quarantine(msgspec.Struct, frozen=True, kw_only=True):
    """A coordinator's verdict on a worker whose result did not match its own recomputation
    (one JSON value per worker in the model's `quarantine` hash; the latest verdict wins)."""

    until_ms: int  # no work and no result used before then (Redis's clock, `Board.now_ms`)
    mismatches: int  # mismatches counted for this id so far, by any coordinator
    banned: bool = False  # never trusted again (the `ban_after`-th mismatch)
    coord: str = ""  # the coordinator that caught it
    reason: str = ""
    ts_ms: int = 0  # when it was caught (or an operator decided)
    # set by hand (`kvq workers`, the dashboard): who; its word replaces the coordinators'
    # earlier verdicts, a release included
    operator: str = ""
    drain: bool = False  # an operator's drain: no new work, its results still used

    def active(self, now_ms: float) -> bool:
        return self.banned or now_ms < self.until_ms

    def idle(self, now_ms: float) -> bool:
        """No new work for it: quarantined, banned or drained."""
        return self.drain or self.active(now_ms)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Quarantine | None:
        """The record, or None when the value does not decode (logged, treated as absent)."""
        try:
            return msgspec.json.decode(raw, type=cls)
        except msgspec.DecodeError as exc:
            log.warning("ignoring a quarantine value that does not decode (%s): %r", exc, raw)
            return None


VERDICTS_KEPT = 1000  # a model's verdict log (`P:{m:M}:verdicts`): the newest this many
DEPARTED_KEEP_S = 3600.0  # how long a reaped worker stays listed, with when and why


class Departure(msgspec.Struct, frozen=True, kw_only=True):
    """A worker that stopped holding slices (reaped, quarantined, or gone by itself): when,
    why, what it held (one JSON value per worker in `P:departed`, kept `DEPARTED_KEEP_S`
    for the operators' view)."""

    ts_ms: int  # Redis's clock (`Board.now_ms`)
    why: str
    held: str = ""  # e.g. "tiny: 2 slices, L000-001 E000-007"

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Departure | None:
        """The record, or None when the value does not decode (treated as absent)."""
        try:
            return msgspec.json.decode(raw, type=cls)
        except msgspec.DecodeError:
            return None


IDLE, LOADING, SERVING = "idle", "loading", "serving"  # WorkerInfo.state


class WorkerInfo(Record, frozen=True, kw_only=True):
    """What a worker says of itself on each heartbeat, from the moment it takes a slice.

    While it downloads (`state` "loading") it beats like a serving worker, so it is never
    reaped for a slow download and its reservation holds; routers skip it until "serving"."""

    model: Text512
    slice: Text512
    device: Text64
    served: Count = 0
    last_serve_ms: Count = 0  # > 0: it has really computed experts (K3)
    state: Text64 = SERVING  # IDLE before it takes a slice, LOADING while it downloads one
    loaded_bytes: Count = 0  # download progress while loading
    total_bytes: Count = 0
    load: Rate = 0.0  # share of the last beat interval spent computing jobs, in [0, 1] (H5)
    ms_per_row: Rate = 0.0  # its own compute time per token row over that interval (0: none)
    busy_rows: Count = 0  # rows of the job it was computing at the beat
    queued_rows: Count = 0  # rows waiting: read and not started, plus unread jobs x mean rows
    # JSON {coordinator: rows} of busy + read rows (not the unread)
    queued_by: Annotated[str, msgspec.Meta(max_length=MAX_JSON_FIELD)] = "{}"

    def queued_by_coord(self) -> dict[str, int]:
        """`queued_by` decoded; {} when it does not decode (an older or corrupt beat)."""
        got = _json_object(self.queued_by)
        return {
            str(k)[:512]: int(v)
            for k, v in got.items()
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**53
        }

    instance: Text512 = ""  # the process's random token: two live workers cannot share an id
    # JSON {model: [slice ids]} of every slice it serves (loaded and warm), "{}" for none;
    # `model`, `slice` and `state` are then the slice it is loading, else the one it loaded
    # last. "" (a beat from before workers held several slices): `state` alone says it serves.
    holds: Annotated[str, msgspec.Meta(max_length=MAX_JSON_FIELD)] = ""
    machine: Text512 = ""  # the kernel's boot id (`kvq.machine`): "" unknown
    cpus: Text512 = ""  # the CPUs it computes on, e.g. "0-3,8"; "" unknown
    kernels: Text512 = ""  # what computes its products (`kvq.quant.kernels.describe`); "" unknown

    @property
    def ready(self) -> bool:
        return self.state not in (IDLE, LOADING)

    def held(self) -> dict[str, tuple[str, ...]]:
        """`holds` decoded (`parse_holds`): model → the slice ids served, sorted."""
        return parse_holds(self.holds)

    def ready_for(self, model: str, sid: str) -> bool:
        """Whether it serves `sid` of `model` now (routable), not just holds it reserved."""
        if not self.holds:
            return self.ready
        return sid in self.held().get(model, ())


def holds_text(held: Mapping[str, Iterable[str]]) -> str:
    """Slices by model as one text field (`WorkerInfo.holds`, a volunteer ask's `held`): JSON
    {model: [slice ids, sorted]}."""
    doc = {m: sorted(set(sids)) for m, sids in sorted(held.items())}
    return json.dumps(doc, separators=(",", ":"))


def parse_holds(text: str) -> dict[str, tuple[str, ...]]:
    """`holds_text` decoded; {} when it does not decode. A model's single slice id (as beats
    wrote it before a worker held several slices of one model) reads as a one-slice list."""
    got = _json_object(text)
    out: dict[str, tuple[str, ...]] = {}
    for k, v in got.items():
        sids = [v] if isinstance(v, str) else v if isinstance(v, list) else []
        out[str(k)] = tuple(sorted({x for x in sids if isinstance(x, str)}))
    return out


def _json_object(text: str) -> dict[Any, Any]:
    """A JSON object of a worker-written field, or {} for anything else: not JSON, nested past
    the parser's depth, too long, not an object."""
    if not text or len(text) > MAX_JSON_FIELD:
        return {}
    try:
        got = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return got if isinstance(got, dict) else {}


class SliceDemand(NamedTuple):
    """A slice's wanted replicas (target) against the workers holding it (coverage)."""

    target: int
    coverage: int

    @property
    def demand(self) -> int:
        return max(0, self.target - self.coverage)

    @property
    def recruiting(self) -> bool:
        return self.target > self.coverage


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """The TTL rules, from the settings they derive from.

    A worker is alive while its heartbeat key exists; it beats every third of
    `heartbeat_ttl_s`, so one lost beat is not death. A coordinator is alive while its slot
    state is fresher than `slot_state_stale_s`.
    """

    heartbeat_ttl_s: float  # KVQ_HEARTBEAT_TTL_S (`Settings.lifetimes`)
    slot_state_stale_s: float  # KVQ_SLOT_STATE_STALE_S
    request_ttl_s: int  # KVQ_REQUEST_TTL_S

    def load_fresh_s(self) -> float:
        """How long a slot sample counts as load (K5): for the coordinator's own dispatch as for
        the monitor, so both stop seeing load at the same age."""
        return self.slot_state_stale_s

    def heartbeat_ms(self) -> int:
        return int(self.heartbeat_ttl_s * 1000)

    def claim_wait_s(self) -> float:
        """How long a starting worker waits for its id's beat to lapse (a crashed
        predecessor's does within one TTL; a live twin's never does)."""
        return self.heartbeat_ttl_s * 1.5

    def beat_every_s(self) -> float:
        return self.heartbeat_ttl_s / 3

    def late_after_s(self) -> float:
        """A live worker whose last beat is older than this has missed one (it beats every
        third of the TTL): late, shown so at once, long before it is lost."""
        return self.heartbeat_ttl_s / 2

    def worker_info_s(self) -> int:
        """Info outlives the heartbeat tenfold: the reaper and operators still see what a dead
        worker held and served."""
        return int(self.heartbeat_ttl_s * 10) + 1

    def slots_s(self) -> int:
        """Slot state outlives staleness threefold, so a stale coordinator is seen as stale
        (ignored) before its key vanishes (forgotten)."""
        return int(self.slot_state_stale_s * 3) + 1

    def coordinator_s(self) -> int:
        """A gone coordinator's stats and results stream age out with its last requests."""
        return int(self.request_ttl_s)

    def reply_s(self) -> int:
        return int(self.request_ttl_s)

    def coordinator_alive(self, state: SlotState | None, now_ms: float) -> bool:
        """THE coordinator liveness rule: slot state published within `slot_state_stale_s`."""
        return state is not None and now_ms - state.ts_ms <= self.slot_state_stale_s * 1000


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One slice of this model a worker holds, as read at a coverage refresh (a worker holding
    several slices gives one view each)."""

    worker_id: str
    slice_id: str
    alive: bool = True  # its heartbeat key exists
    last_serve_ms: int = 0  # from its info hash (self-reported): > 0 makes it worth a re-probe
    load: float | None = None  # its own load in [0, 1] if it reports one
    first_seen_ms: float | None = None  # K4 grace start; None: when this router first saw it
    ready: bool = True  # False while it still downloads its slice (alive, not routable)
    ms_per_row: float = 0.0  # its own compute time per row over its last beat (0: none)
    queued_rows: int = 0  # rows it computes or has waiting, all coordinators (its last beat)
    queued_by: tuple[tuple[str, int], ...] = ()  # the part of those it knows per coordinator
    device: str = ""  # "cpu", "cuda", ...; "" unknown
    machine: str = ""  # the kernel's boot id of its host; "" unknown (`kvq.machine`)
    cpus: frozenset[int] = frozenset()  # the CPUs it computes on; empty: unknown
    kernels: str = ""  # what computes its products (`WorkerInfo.kernels`); "" unknown
