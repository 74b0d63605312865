"""The board: every shared record of a kvq deployment, read and written as typed values.

The roles (coordinator, worker, monitor, demo, HTTP API) never name a hash field, a TTL or a
liveness rule: they call a `Board`. Two implementations keep the same contract:

- `RedisBoard` (`kvq.bus.redis_board`): the real one, keys from `kvq.keys`, the market's
  atomic Lua scripts, TTLs from `Lifetimes`;
- `MemoryBoard` (`kvq.bus.memory_board`): plain dicts and an injectable clock, for unit tests
  of role logic without a server (as dramatiq keeps `brokers/stub.py` beside its Redis broker).

`tests/bus/test_board_contract.py` runs the same tests on both.

Streams (requests, inboxes, results, replies) stay with `kvq.bus.streams`: a board only posts
jobs to inboxes and moves a dead worker's jobs, the two inbox operations the control plane owns.
Their in-memory stand-in is fakeredis: `tests/bus/test_streams.py` runs the same tests on it
and on a real server (what it does otherwise is marked there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from kvq import wire
from kvq.bus.connection import Backoff, is_connection_error
from kvq.bus.records import (
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
from kvq.errors import ModelError, WireError
from kvq.machine import parse_cpus

log = logging.getLogger("kvq.bus")

Fields = Mapping[Any, Any]  # stream entry fields (str or bytes names)
Peers = Mapping[tuple[str, str], Sequence[str]]  # (model, slice id) -> live workers holding it


@dataclass(frozen=True, slots=True)
class CoordinatorView:
    """A coordinator registered for a model: its last slot state (None: the key expired)."""

    coord: str
    state: SlotState | None
    alive: bool


class Board(Protocol):
    """What every role reads and writes outside its streams."""

    lifetimes: Lifetimes

    # -- models ---------------------------------------------------------------------------
    def models(self) -> list[str]:
        """Registered model ids, sorted."""
        ...

    def register_model(self, info: ModelInfo, base_replicas: int, restore: bool = False) -> bool:
        """Publish metadata and the slice table, and seed every slice's target (K8); an
        explicit registration clears a removal (`unregister_model`), a `restore` (a monitor
        re-publishing what Redis lost) skips a removed model: False then."""
        ...

    def unregister_model(self, model: str) -> list[str]:
        """Remove `model`: marked removed first, then unlisted, its slices released (coverage,
        workers, grants) and every key of it deleted (requests and cancels included); the
        workers that held a slice of it."""
        ...

    def forget_removed_model(self, model: str, shards: int) -> None:
        """While `model` is marked removed: delete again the keys of it a coordinator writes
        (its place among the coordinators, routed counts, verdicts, its `shards` request
        streams, whose group a reader makes again), left by one that ran on after the
        removal."""
        ...

    def model_removed(self, model: str) -> bool:
        """Whether `kvq model rm` removed `model` since its last registration."""
        ...

    def model_info(self, model: str) -> ModelInfo | None:
        """The registered model, or None."""
        ...

    def model_intact(self, model: str) -> bool:
        """Whether `model`'s registration is whole: listed, with its metadata and slice table
        (False after Redis lost any of them; its monitor registers it again)."""
        ...

    def publish_model_state(
        self, model: str, state: ModelState, targets: Mapping[str, int] | None = None
    ) -> None:
        """The monitor's poll result; every slice's target becomes `targets[slice]`, or
        `effective_target` for slices `targets` leaves out (all of them when None)."""
        ...

    def hold_lease(self, holder: str, ttl_s: float) -> bool:
        """Take or renew the monitors' lease for `ttl_s`; True while `holder` has it (one
        active monitor, the others standing by)."""
        ...

    def drop_lease(self, holder: str) -> None:
        """Give the lease up if `holder` has it (a clean stop: a standby takes over at once)."""
        ...

    def lease_holder(self) -> str | None: ...

    def add_routed(self, model: str, rows: Mapping[str, int]) -> None:
        """A coordinator routed these token rows to these slices since its last call."""
        ...

    def routed(self, model: str) -> dict[str, int]:
        """Token rows routed to each slice of `model` so far, by every coordinator."""
        ...

    def model_state(self, model: str) -> ModelState | None: ...

    # -- the market (atomic per call) -----------------------------------------------------
    def slice_demand(self, model: str) -> dict[str, SliceDemand]:
        """Every targeted slice of `model`, sorted by slice id."""
        ...

    def set_target(self, model: str, sid: str, replicas: int) -> None: ...

    def assignments(self, model: str) -> dict[str, tuple[str, ...]]:
        """Worker id → the slice ids it holds of `model`, sorted."""
        ...

    def held_by(self, model: str, worker: str) -> tuple[str, ...]:
        """The slice ids of `model` listed for `worker` (one field of `assignments`)."""
        ...

    def volunteer(
        self, model: str, worker: str, room: int | None = None, held: Collection[str] = ()
    ) -> str | None:
        """Take a slice `worker` does not hold yet: the largest demand (ties: least covered,
        then lowest id) among those of at most `room` bytes (None: any size). `held`: the
        slices it knows it holds; one reserved to it beyond those (an answer lost on the way)
        comes back first, so a retried ask takes nothing twice. None when nothing (that fits)
        is wanted."""
        ...

    def release(self, model: str, worker: str, sid: str | None = None) -> tuple[str, ...]:
        """Give back `worker`'s slice `sid` (None: every slice it holds of `model`); the
        slice ids released, sorted, () when it held none of them."""
        ...

    def rejoin(self, model: str, worker: str, *sids: str) -> int:
        """Count `worker` as holding each of `sids` again; how many had to be re-added."""
        ...

    def retire(self, model: str, worker: str, sid: str) -> str | None:
        """Release `sid` only if it stays covered at its target (K10); the slice, or None."""
        ...

    # -- workers --------------------------------------------------------------------------
    def workers(self, model: str) -> list[WorkerView]:
        """One view per (worker, slice) of `model` assigned, sorted, with the one liveness
        rule: a worker holding several slices appears once for each."""
        ...

    def beat(self, worker: str, info: WorkerInfo) -> int:
        """Heartbeat and info of a serving worker, with their lifetimes; returns the length
        of its inbox read in the same round trip (its backlog, `kvq.worker.backlog`)."""
        ...

    def worker_info(self, worker: str) -> WorkerInfo | None: ...

    def claim_worker(self, worker: str, instance: str) -> bool:
        """Take the id `worker` for the process `instance` (its heartbeat, set only if absent);
        True if it is now, or already was, this instance's. False: another live process beats
        under this id."""
        ...

    def worker_instance(self, worker: str) -> str | None:
        """The instance token of the live process beating as `worker`, or None."""
        ...

    def worker_alive(self, worker: str) -> bool:
        """THE worker liveness rule for one worker: its heartbeat is up (idle, loading or
        serving)."""
        ...

    def forget_worker(self, worker: str) -> None:
        """Drop the worker's heartbeat, info and inbox (it left, or it was reaped)."""
        ...

    def record_departure(self, worker: str, departure: Departure) -> None:
        """A reaped worker, kept `DEPARTED_KEEP_S` (older ones dropped here)."""
        ...

    def departures(self) -> dict[str, Departure]:
        """The workers reaped in the last `DEPARTED_KEEP_S`, sorted by id."""
        ...

    def quarantine(self, model: str, worker: str, verdict: Quarantine) -> None:
        """Record a coordinator's verdict on `worker` (replacing any earlier one)."""
        ...

    def verdict_history(self, model: str, worker: str) -> list[Quarantine]:
        """`worker`'s verdicts in `model`, newest first (the last `VERDICTS_KEPT` of the
        model's, any worker's, are kept)."""
        ...

    def quarantined(self, model: str) -> dict[str, Quarantine]:
        """Every verdict recorded for `model`'s workers, active or past (`Quarantine.active`)."""
        ...

    def send_jobs(self, jobs: Sequence[tuple[str, Fields]]) -> None:
        """Append each `(worker, fields)` to that worker's inbox, in one round trip."""
        ...

    def requeue_inbox(self, dead: str, peers: Sequence[str] | Peers) -> int:
        """Move `dead`'s unanswered jobs round-robin to `peers` (a mapping: each job to the
        peers of its own model and slice, `spread_jobs`), then drop its inbox."""
        ...

    # -- coordinators ---------------------------------------------------------------------
    def publish_slots(
        self,
        coord: str,
        state: SlotState,
        stats: CoordStats,
        inflight: Iterable[InFlight] = (),
    ) -> bool:
        """Slot state, counters and the requests in flight of a coordinator, which joins its
        model's set; True when its slot record or its place in the set was missing (the
        first publish, an expiry, or Redis lost them)."""
        ...

    def coordinators(self, model: str) -> list[CoordinatorView]:
        """The model's coordinators, sorted, with the one liveness rule."""
        ...

    def forget_coordinator(self, model: str, coord: str) -> None: ...

    def coordinator_alive(self, coord: str) -> bool: ...

    def now_ms(self) -> float:
        """Redis's clock in ms, as this host reads it (`kvq.bus.clock`): what every time that
        another process compares (`ts_ms`, `until_ms`, `deadline_ms`) is written and read on."""
        ...

    def coord_stats(self, coord: str) -> CoordStats | None: ...

    def in_flight(self, coords: Sequence[str]) -> list[InFlight]:
        """The requests `coords` generate now, as each last published them."""
        ...


def worker_view(
    worker: str, sid: str, alive: bool, info: WorkerInfo | None, model: str
) -> WorkerView:
    """What routers see of a worker holding `sid` of `model`: its liveness and what its last
    beat said (ready: it serves that slice, whatever else it holds or loads)."""
    if info is None:
        return WorkerView(worker, sid, alive)
    ready = info.ready_for(model, sid)
    return WorkerView(
        worker,
        sid,
        alive,
        info.last_serve_ms,
        info.load if ready else None,
        ready=ready,
        ms_per_row=info.ms_per_row,
        queued_rows=info.busy_rows + info.queued_rows,
        queued_by=tuple(sorted(info.queued_by_coord().items())),
        device=info.device,
        machine=info.machine,
        cpus=parse_cpus(info.cpus),
        kernels=info.kernels,
    )


def spread_jobs(
    entries: Sequence[Fields], peers: Sequence[str] | Peers
) -> list[tuple[str, Fields]]:
    """Where each of a dead worker's jobs goes: round-robin over `peers`, or, for a mapping
    (a worker may hold slices of several models), over the peers of the job's own model and
    slice. A job no peer holds is dropped: its coordinator computes it at its deadline. An
    entry that does not decode goes to any peer, whose worker dead-letters it with the reason
    (the evidence is kept, as if it had been read where it was sent)."""
    if not isinstance(peers, Mapping):
        return [(peers[i % len(peers)], f) for i, f in enumerate(entries)] if peers else []
    out: list[tuple[str, Fields]] = []
    turn: dict[tuple[str, str], int] = {}
    anyone = sorted({w for ws in peers.values() for w in ws})
    for f in entries:
        if wire.is_stage_job(f):
            continue  # a stage job needs its sequences' state: its coordinator replays them
        try:
            job = wire.decode(f, wire.Job)
            key, them = (job.model, job.slice), peers.get((job.model, job.slice), ())
        except WireError:
            key, them = ("", ""), anyone
        if them:
            n = turn.get(key, 0)
            turn[key] = n + 1
            out.append((them[n % len(them)], f))
    return out


def wait_for_model(board: Board, model: str, give_up_s: float, backoff_cap_s: float) -> ModelInfo:
    """`board.model_info`, retried while Redis is unreachable or the model is not registered
    yet: a coordinator may start before the monitor or Redis (compose, systemd). ModelError
    once `give_up_s` has passed."""
    deadline = time.monotonic() + give_up_s
    backoff = Backoff(backoff_cap_s)
    while True:
        try:
            info = board.model_info(model)
            if info is not None:
                return info
            problem = f"model {model!r} is not registered; run the monitor with --model"
        except redis.RedisError as exc:
            if not is_connection_error(exc):
                raise
            problem = str(exc)
        if time.monotonic() > deadline:
            raise ModelError(f"model {model!r} not available after {give_up_s:.0f}s: {problem}")
        if backoff.failures == 0:
            log.info("waiting for model %s (%s)", model, problem)
        backoff.wait()
