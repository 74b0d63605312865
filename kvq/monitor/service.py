"""The monitor: registers models, watches saturation, sets demand, reaps dead workers.

Each tick, per model:
- read every coordinator's slot state; the model is saturated while a coordinator with fresh
  state has `busy >= saturation_threshold` (K6);
- write the replica target of every slice: base, plus boost while saturated (K7, K10);
- reap workers whose heartbeat expired: give their slice back to the market and move the jobs
  still in their inbox to a live worker of the same slice (the coordinator's deadline fallback
  covers the rest).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from kvq.bus import Backoff, Scripts, connect, is_connection_error, xadd
from kvq.config import Settings
from kvq.keys import Keys
from kvq.registry import ModelInfo, list_models, register_model

log = logging.getLogger("kvq.monitor")


@dataclass(frozen=True, slots=True)
class ModelState:
    model: str
    saturated: bool
    busy: int
    total: int
    coordinators: int
    base: int
    effective: int


class Monitor:
    """The control plane; `run()` until `stop` is set."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.keys = Keys(settings.prefix)
        self.r = connect(settings)
        self.scripts = Scripts(self.r, self.keys)
        self.stop = threading.Event()
        self.reaped = 0
        self.requeued = 0

    def register(self, model: str, path: str | Path, source: str | None = None) -> ModelInfo:
        info = register_model(self.r, self.keys, self.s, model, path, source)
        log.info("registered %s: %d slices", model, len(info.slices))
        return info

    def run(self) -> None:
        backoff = Backoff(self.s.reconnect_max_s)
        while not self.stop.is_set():
            try:
                self.tick()
                backoff.reset()
            except redis.RedisError as exc:
                if not is_connection_error(exc):
                    raise
                log.warning("redis unreachable (%s); retrying", exc)
                backoff.wait()
                continue
            self.stop.wait(self.s.monitor_poll_s)

    def tick(self) -> list[ModelState]:
        states = [self.poll(model) for model in list_models(self.r, self.keys)]
        for model in list_models(self.r, self.keys):
            self.reap(model)
        return states

    def poll(self, model: str) -> ModelState:
        """Saturation of `model` from its coordinators' slot state; writes targets."""
        k = self.keys
        coords = sorted(c.decode() for c in self.r.smembers(k.model_coordinators(model)))
        pipe = self.r.pipeline(transaction=False)
        for c in coords:
            pipe.hgetall(k.coord_slots(c))
        now_ms = time.time() * 1000
        busy = total = live = 0
        saturated = False
        for c, slots in zip(coords, pipe.execute() if coords else [], strict=True):
            if not slots:  # expired: the coordinator is gone
                self.r.srem(k.model_coordinators(model), c)
                continue
            if now_ms - float(slots.get(b"ts_ms", 0)) > self.s.slot_state_stale_s * 1000:
                continue
            b, t = int(slots.get(b"busy", 0)), int(slots.get(b"total", 0))
            busy, total, live = busy + b, total + t, live + 1
            saturated |= b >= self.s.saturation_threshold
        effective = self.s.base_replicas + (self.s.boost_replicas if saturated else 0)
        sids = [s.decode() for s in self.r.hkeys(k.model_slices(model))]
        pipe = self.r.pipeline(transaction=False)
        if sids:
            pipe.hset(k.model_target(model), mapping=dict.fromkeys(sids, effective))
        state = ModelState(model, saturated, busy, total, live, self.s.base_replicas, effective)
        pipe.hset(
            k.model_state(model),
            mapping={
                "saturated": int(saturated), "busy": busy, "total": total,
                "coordinators": live, "base_target": state.base,
                "effective_target": effective, "ts_ms": int(now_ms),
            },
        )  # fmt: skip
        pipe.execute()
        return state

    def reap(self, model: str) -> list[str]:
        """Release the slices of workers whose heartbeat expired; requeue their jobs."""
        k = self.keys
        assigned = {
            w.decode(): s.decode() for w, s in self.r.hgetall(k.model_workers(model)).items()
        }
        pipe = self.r.pipeline(transaction=False)
        for w in assigned:
            pipe.exists(k.worker_heartbeat(w))
        alive = dict(zip(assigned, pipe.execute() if assigned else [], strict=True))
        dead = [w for w, ok in alive.items() if not ok]
        for w in dead:
            sid = assigned[w]
            self.scripts.release(self.r, model, w)
            peers = sorted(p for p, s in assigned.items() if s == sid and alive[p])
            self._requeue(w, peers)
            self.r.delete(k.worker_info(w))
            self.reaped += 1
            log.info("reaped worker %s (%s of %s)", w, sid, model)
        return dead

    def _requeue(self, dead: str, peers: list[str]) -> None:
        """Move the dead worker's unanswered jobs to a live peer, then drop its inbox."""
        inbox = self.keys.worker_inbox(dead)
        entries = self._unanswered(inbox)
        if peers and entries:
            pipe = self.r.pipeline(transaction=False)
            for i, (_, fields) in enumerate(entries):
                peer = peers[i % len(peers)]
                xadd(pipe, self.keys.worker_inbox(peer), fields, self.s.stream_maxlen)
            pipe.execute()
            self.requeued += len(entries)
        self.r.delete(inbox)

    def _unanswered(self, inbox: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries never delivered, plus those delivered but not acknowledged."""
        groups = self.r.xinfo_groups(inbox) if self.r.exists(inbox) else []
        if not groups:
            return list(self.r.xrange(inbox))
        g = groups[0]
        last = g["last-delivered-id"]
        pending = {
            p["message_id"]
            for p in self.r.xpending_range(inbox, g["name"], min="-", max="+", count=10_000)
        }
        return [(eid, f) for eid, f in self.r.xrange(inbox) if eid in pending or _id_gt(eid, last)]


def _id_gt(a: bytes, b: bytes) -> bool:
    ams, aseq = (int(p) for p in a.split(b"-"))
    bms, bseq = (int(p) for p in b.split(b"-"))
    return (ams, aseq) > (bms, bseq)
