"""The monitor: registers models, watches saturation, sets demand, reaps dead workers.

Several may run: one is active, holding a lease in Redis (`P:monitor:lease`, renewed every
poll, `KVQ_MONITOR_LEASE_S`); the others stand by, serve their HTTP API and metrics (read from
Redis), and take the lease once it expires, so reaping and demand go on after the active one
dies. A clean stop drops the lease at once.

Each tick, per model:
- read every coordinator's slot state; the model is saturated once some coordinator with
  fresh state has had `busy >= saturation_threshold` for `saturation_enter_s`, and stays so
  until none has for `saturation_leave_s` (K6, `kvq.monitor.hysteresis`);
- write the replica target of every slice: base, plus while saturated the boost copies
  shared by each slice's routed demand (K7, K10; `kvq.monitor.popularity`);
- reap workers whose heartbeat expired: give their slice back to the market and move the jobs
  still in their inbox to a live worker of the same slice (the coordinator's deadline fallback
  covers the rest).

Beside the ticks, the active monitor answers the market asks of workers that may not run the
market's scripts themselves (their least-privilege ACL users; `kvq.bus.market`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from kvq.bus.board import Board
from kvq.bus.market import MarketDesk
from kvq.bus.outage import Outage, run_until_stopped
from kvq.bus.records import ModelState
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.catalog import ModelInfo
from kvq.config import MonitorSettings, Settings
from kvq.gguf.registry import plan_model
from kvq.monitor.departures import Watch, departure, reaped_why
from kvq.monitor.hysteresis import Hysteresis
from kvq.monitor.popularity import Popularity, spread
from kvq.monitor.quota import Quota, QuotaWatch
from kvq.monitor.registration import publish

log = logging.getLogger("kvq.monitor")


class Monitor:
    """The control plane over one board; `run()` until `stop` is set."""

    def __init__(
        self,
        board: Board,
        settings: MonitorSettings,
        clock: Callable[[], float] = time.monotonic,
        monitor_id: str | None = None,
        desk: MarketDesk | None = None,
    ) -> None:
        self.board, self.s, self.clock, self.desk = board, settings, clock, desk
        self.quota: QuotaWatch | None = None  # per-worker quotas (`on_redis`)
        # unique per process: two monitors on one host must not share the lease
        self.id = monitor_id or f"monitor-{socket.gethostname()}-{os.getpid()}"
        self.active = False
        self._led_once = False
        self._saturation: dict[str, Hysteresis] = {}
        self.popularity = Popularity()
        self.stop = threading.Event()
        self.reaped = 0
        self.released_quarantined = 0  # slices lists taken from quarantined workers
        self.requeued = 0
        self.known: dict[str, ModelInfo] = {}  # every model seen registered: re-published
        self.reregistered = 0  # ... when Redis lost its registration
        self.departures = Watch(gap_s=3 * settings.poll_s + 1)  # who stopped holding slices
        self.registering: list[str] = []  # models queued as RQ jobs at start (the ready line)

    @classmethod
    def from_settings(cls, settings: Settings, monitor_id: str | None = None) -> Monitor:
        board = open_board(settings.bus, settings.lifetimes)
        return cls.on_redis(board, settings.monitor, monitor_id)

    @classmethod
    def on_redis(
        cls, board: RedisBoard, settings: MonitorSettings, monitor_id: str | None = None
    ) -> Monitor:
        """A monitor that also answers workers' market asks (`kvq.bus.market`)."""
        desk = MarketDesk(board, board.r, board.keys, board.maxlen)
        mon = cls(board, settings, monitor_id=monitor_id, desk=desk)
        quota = Quota(key_bytes=settings.worker_quota_mib << 20, entries=2 * board.maxlen)
        mon.quota = QuotaWatch(board.r, board.keys, quota, mon.live_coordinators)
        return mon

    def register(self, model: str, path: str | Path, source: str | None = None) -> ModelInfo:
        """Publish a model: metadata, slice table with checksums, base demand per slice (K8)."""
        info = plan_model(
            model,
            path,
            self.s.slice_layers,
            self.s.slice_experts,
            source,
            self.s.request_shards,
            self.s.grain,
            self.s.stage_layers,
        )
        publish(self.board, info, self.s.base_replicas)
        self.known[model] = info
        return info

    def run(self) -> None:
        outage = Outage(log, self.s.reconnect_max_s)
        models = self.board.models()
        pending = [m for m in self.registering if m not in models]
        log.info(
            "ready: monitor %s watches %s%s (poll every %gs)",
            self.id,
            ", ".join(models) if models else "no model yet",
            f"; registering {', '.join(pending)} (RQ jobs)" if pending else "",
            self.s.poll_s,
        )
        sides = []
        if self.desk is not None:
            sides.append(threading.Thread(target=self._serve_market, name="market", daemon=True))
        if self.quota is not None:
            sides.append(threading.Thread(target=self._watch_quotas, name="quota", daemon=True))
        for t in sides:
            t.start()
        try:
            self._run(outage)
        finally:
            for t in sides:
                t.join(timeout=5)
            if self.active:
                try:
                    self.board.drop_lease(self.id)
                except redis.RedisError:
                    pass  # it expires by itself

    def _run(self, outage: Outage) -> None:
        """Polls until stopped; a Redis that is down or refuses (writes, or one command) is
        waited out, logged once per episode (`kvq.bus.outage`)."""
        run_until_stopped(self.stop, self._poll, outage, pause_s=self.s.poll_s)

    def _poll(self) -> None:
        """Lead if no other monitor does; the active one ticks."""
        if self._lead():
            self.tick()

    def _serve_market(self) -> None:
        """Answer workers' market asks while this monitor is the active one."""
        assert self.desk is not None
        block_ms = max(1, int(min(1.0, self.s.poll_s) * 1000))
        outage = Outage(logging.getLogger("kvq.monitor.market"), self.s.reconnect_max_s)
        desk = self.desk

        def answer() -> None:
            if not self.active:
                self.stop.wait(self.s.poll_s)
                return
            try:
                desk.serve(block_ms, self.quota.take_asking() if self.quota else ())
            except redis.RedisError:
                raise  # waited out by run_until_stopped
            except Exception:  # one bad ask must not stop recruitment
                log.exception("market: answering asks failed; going on")
                self.stop.wait(self.s.poll_s)

        run_until_stopped(self.stop, answer, outage)

    def _watch_quotas(self) -> None:
        """Measure every worker user about once a second while active (`kvq.monitor.quota`);
        a monitor whose user may not (a `kvq acl` older than the watch) says so once."""
        assert self.quota is not None
        outage = Outage(logging.getLogger("kvq.monitor.quota"), self.s.reconnect_max_s)
        quota = self.quota

        def measure() -> bool:
            if self.active:
                try:
                    quota.check()
                except redis.exceptions.NoPermissionError as exc:
                    hint = "the monitor's user needs ACL USERS|SETUSER, CLIENT LIST|KILL"
                    log.error("worker quotas not enforced: %s (%s: kvq acl --apply)", exc, hint)
                    return False
            return True

        run_until_stopped(self.stop, measure, outage, pause_s=min(1.0, self.s.poll_s))

    def live_coordinators(self) -> list[str]:
        """Every coordinator listed for a model the monitor knows (whose results streams
        workers write)."""
        return [c.coord for m in self.board.models() for c in self.board.coordinators(m)]

    def _lead(self) -> bool:
        """Take or renew the lease; logs each change between active and standby."""
        held = self.board.hold_lease(self.id, self.s.lease_s)
        if held != self.active or not self._led_once:
            self.active, self._led_once = held, True
            if held:
                log.info("monitor %s is active", self.id)
            else:
                log.info("monitor %s stands by (%s is active)", self.id, self.board.lease_holder())
        return held

    def tick(self) -> list[tuple[str, ModelState]]:
        models = self.keep_registered(self.board.models())
        states = [(model, self.poll(model)) for model in models]
        dead = self.reap(*models)
        barred = [w for model in models for w in self.release_quarantined(model)]
        for model in models:
            self.release_drained(model)
        verdicts = [self.board.quarantined(model) for model in models]
        by = {  # quarantined or drained by hand: the departure names who
            w: q.operator
            for got in verdicts
            for w, q in got.items()
            if (w in barred or q.drain) and q.operator
        }
        drained = {w for got in verdicts for w, q in got.items() if q.drain}
        self.departures.update(self.board, models, dead, barred, by, drained)
        return states

    def release_quarantined(self, model: str) -> list[str]:
        """Take the slices of `model` away from its quarantined workers, so that they stop
        counting as coverage and the pool's spare budget re-covers them (a caught liar's slice
        is served by its other copies meanwhile, never refused while one lives). The market
        refuses such a worker's rejoin and volunteer asks while its verdict lasts."""
        now_ms = self.board.now_ms()
        barred = {w for w, q in self.board.quarantined(model).items() if q.active(now_ms)}
        out = []
        for w, sids in self.board.assignments(model).items():
            if w in barred and sids:
                self.board.release(model, w)
                self.released_quarantined += 1
                out.append(w)
                log.warning(
                    "released %s of %s from quarantined worker %s", ", ".join(sids), model, w
                )
        return out

    def release_drained(self, model: str) -> list[str]:
        """Take the slices of `model` back from workers an operator drained, once their work
        is done: a beat since the drain (its verdict older than a heartbeat lifetime) says
        nothing is computed or waiting. A worker that reads verdicts gives them back itself;
        this is for those that may not (`kvq acl` users, whose rejoin the market refuses while
        they are drained)."""
        now_ms, ttl_ms = self.board.now_ms(), self.board.lifetimes.heartbeat_ms()
        verdicts = self.board.quarantined(model).items()
        drained = {w for w, q in verdicts if q.drain and now_ms - q.ts_ms >= ttl_ms}
        if not drained:
            return []
        idle = {  # one view a slice, each from the worker's one beat
            v.worker_id
            for v in self.board.workers(model)
            if v.worker_id in drained and v.alive and not v.queued_rows
        }
        out = []
        for w, sids in self.board.assignments(model).items():
            if w in idle and sids:
                self.board.release(model, w)
                out.append(w)
                log.info("released %d slice(s) of %s from drained worker %s", len(sids), model, w)
        return out

    def keep_registered(self, listed: list[str]) -> list[str]:
        """The models to tick: those listed, plus every model this monitor has seen
        registered, published again when Redis lost its registration (a restart without
        persistence, `FLUSHALL`, a `DEL` of its metadata, slice table or the model list) from
        the copy kept here: no file is read or checksummed again."""
        for model in listed:
            if model not in self.known:
                info = self.board.model_info(model)
                if info is not None:
                    self.known[model] = info
        removed = [m for m in self.known if self.board.model_removed(m)]
        for model in removed:
            del self.known[model]  # `kvq model rm`: never published again from here
            if model in listed:  # restored by a tick that raced the removal
                self.board.unregister_model(model)
            log.info("model %s was removed (kvq model rm); no longer watched", model)
        for model, info in self.known.items():
            if model in listed and self.board.model_intact(model):
                continue
            log.warning("redis lost the registration of %s; registering it again", model)
            if self.board.register_model(info, self.s.base_replicas, restore=True):
                self.reregistered += 1
        return sorted((set(listed) - set(removed)) | set(self.known))

    def base_target(self, backbone: bool) -> int:
        """Copies per slice at rest: `KVQ_BASE_REPLICAS`, at least `KVQ_BACKBONE_REPLICAS`
        while a live coordinator holds no experts (a lost worker's slices are then served
        only by other replicas, and results are checked by a second holder)."""
        if backbone:
            return max(self.s.base_replicas, self.s.backbone_replicas)
        return self.s.base_replicas

    def poll(self, model: str) -> ModelState:
        """Saturation of `model` from its coordinators' slot state (K6); writes targets (K7)."""
        busy = total = live = 0
        saturated = backbone = False
        for view in self.board.coordinators(model):
            if view.state is None:  # its slot state expired: the coordinator is gone
                self.board.forget_coordinator(model, view.coord)
                continue
            if not view.alive:
                continue
            b, t = view.state.busy, view.state.total
            busy, total, live = busy + b, total + t, live + 1
            backbone |= not view.state.experts
            saturated |= b >= self.s.saturation_threshold
        sat = self._saturation.setdefault(
            model, Hysteresis(self.s.saturation_enter_s, self.s.saturation_leave_s)
        )
        was = sat.on
        saturated = sat.update(saturated, self.clock())
        if saturated != was:
            log.info(
                "%s: %s (busy %d of %d)",
                model,
                "saturated: boosting" if saturated else "drained: boost off",
                busy,
                total,
            )
        base = self.base_target(backbone)
        effective = base + (self.s.boost_replicas if saturated else 0)
        rates = self.popularity.update(model, self.board.routed(model))
        targets = None
        if saturated:
            info = self.board.model_info(model)
            sids = sorted(info.slices) if info is not None else []
            targets = spread(base, self.s.boost_replicas, rates, sids)
        state = ModelState(
            saturated=saturated,
            busy=busy,
            total=total,
            coordinators=live,
            base_target=base,
            effective_target=effective,
            ts_ms=int(self.board.now_ms()),
        )
        self.board.publish_model_state(model, state, targets)
        return state

    def reap(self, *models: str) -> list[str]:
        """Release the slices of dead workers in `models`; move their unanswered jobs to live
        peers of each job's own model and slice (a worker may hold several slices, of one
        model or of several)."""
        views = {m: self.board.workers(m) for m in models}
        peers: dict[tuple[str, str], list[str]] = {}
        dead: dict[str, list[tuple[str, str]]] = {}  # worker -> its (model, slice)s
        for m, vs in views.items():
            for v in vs:
                if v.alive:
                    peers.setdefault((m, v.slice_id), []).append(v.worker_id)
                else:
                    dead.setdefault(v.worker_id, []).append((m, v.slice_id))
        for w, held in dead.items():
            for m in dict.fromkeys(m for m, _ in held):
                self.board.release(m, w)  # every slice it held of the model
            self.requeued += self.board.requeue_inbox(w, peers)
            self.board.forget_worker(w)
            self.board.record_departure(w, departure(self.board, held, reaped_why(self.board)))
            self.reaped += 1
            log.info("reaped worker %s (%s)", w, ", ".join(f"{s} of {m}" for m, s in held))
        return sorted(dead)
