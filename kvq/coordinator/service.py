"""The coordinator process: requests in, tokens out, expert slices local or remote.

Requests come from the model's request stream through a consumer group (several coordinators
share them; a restarted coordinator re-reads its own pending requests). Each request's tokens
stream back on its own reply stream. Slot state (busy, total, ts_ms) is published every tick for
the monitor.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import redis

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bus import (
    Backoff,
    Consumer,
    claim_from_dead,
    connect,
    dead_letter,
    is_connection_error,
    xadd,
)
from kvq.config import Settings
from kvq.coordinator.dispatch import Dispatcher
from kvq.coordinator.engine import Engine, Sequence
from kvq.coordinator.slots import SlotPoller
from kvq.errors import UncoveredSlice, WireError
from kvq.keys import COORDINATOR_GROUP, Keys
from kvq.model import Backbone, load_tokenizer
from kvq.registry import wait_for_model

log = logging.getLogger("kvq.coordinator")


class Coordinator:
    """Serves one model from `model_path`, registered in Redis as `model`."""

    def __init__(
        self, settings: Settings, coord_id: str, model: str, model_path: str | Path
    ) -> None:
        self.s, self.id, self.model = settings, coord_id, model
        self.keys = Keys(settings.prefix)
        self.r = connect(settings)
        self.backbone = Backbone.from_gguf(model_path)
        self.tokenizer = load_tokenizer(model_path)  # the file's own vocabulary (or bytes)
        self.engine = Engine(self.backbone, self.tokenizer, settings.n_slots)
        self.bank = Bank(self.backbone.experts, BankOptions.from_settings(settings), "cpu")
        self.info = wait_for_model(
            self.r, self.keys, model, settings.model_wait_s, settings.reconnect_max_s
        )
        self.dispatch = Dispatcher(
            self.r, self.keys, settings, coord_id, self.info, self.bank,
            slot_state=lambda: self.slots.current(),
        )  # fmt: skip
        self._requests_key = self.keys.model_requests(model)
        self.requests = Consumer(self.r, self._requests_key, COORDINATOR_GROUP, coord_id)
        self.slots = SlotPoller(
            lambda: self.engine.busy, settings.n_slots, settings.saturation_threshold,
            self._publish_slots, settings.slot_poll_s, settings.slot_state_stale_s,
        )  # fmt: skip
        self.stop = threading.Event()
        self.completed = 0
        self.tokens = 0
        self.claimed = 0
        self._claim_at = 0.0

    def run(self) -> None:
        backoff = Backoff(self.s.reconnect_max_s)
        self.slots.start()
        try:
            self._serve(backoff)
        finally:
            self.slots.close()
            self.slots.poll_once()

    def _serve(self, backoff: Backoff) -> None:
        while not self.stop.is_set():
            try:
                self.tick()
                backoff.reset()
            except redis.RedisError as exc:
                if not is_connection_error(exc):
                    raise
                log.warning("redis unreachable (%s); retrying", exc)
                backoff.wait()
                self.requests.reset_pending()

    def tick(self) -> None:
        """Take over orphans, admit what fits, run one step."""
        self._claim_orphans()
        if self.engine.free:
            block = None if self.engine.busy else self.s.block_ms  # never stall live sequences
            for eid, fields in self.requests.read(self.engine.free, block):
                self._admit(eid, fields)
        self.slots.note(self.engine.busy)
        if self.engine.busy:
            self.engine.step(self.dispatch, self._emit)
            self.bank.step()  # B5: dynamic updates count engine steps

    def _claim_orphans(self) -> None:
        """Take over requests left pending by coordinators that stopped publishing slots."""
        now = time.monotonic()
        if now - self._claim_at < self.s.claim_idle_ms / 2000:
            return
        self._claim_at = now
        n = claim_from_dead(
            self.r, self._requests_key, COORDINATOR_GROUP, self.id,
            self._coordinator_alive, self.s.claim_idle_ms,
        )  # fmt: skip
        if n:
            log.info("claimed %d requests of dead coordinators", n)
            self.claimed += n
            self.requests.reset_pending()

    def _coordinator_alive(self, coord: str) -> bool:
        ts = self.r.hget(self.keys.coord_slots(coord), "ts_ms")
        return ts is not None and time.time() * 1000 - float(ts) < self.s.slot_state_stale_s * 1000

    def _admit(self, eid: bytes, fields: dict[bytes, bytes]) -> None:
        if any(seq.entry_id == eid for seq in self.engine.active):
            return  # already generating it (re-read during a pending pass)
        try:
            req = wire.decode(fields, wire.Request)
        except WireError as exc:
            dead_letter(
                self.r, self.keys, self._requests_key, eid, fields, str(exc), self.s.stream_maxlen
            )
            self.requests.ack(eid)
            return
        ids = (
            req.prompt_ids
            if req.prompt_ids is not None
            else self.tokenizer.encode(req.prompt or "")
        )
        problem = self._validate(req, ids)
        if problem is not None:
            event = wire.ReplyEvent(
                kind="error", error=wire.Failure(type="BadRequest", message=problem)
            )
            pipe = self.r.pipeline(transaction=False)
            self._reply(pipe, req.request_id, event)
            pipe.xack(self._requests_key, COORDINATOR_GROUP, eid)
            pipe.execute()
            return
        self.engine.admit(req.request_id, ids, req.max_tokens, eid)

    def _validate(self, req: wire.Request, ids: list[int]) -> str | None:
        """Why the request cannot be served, or None."""
        if req.model != self.model:
            return f"request for model {req.model!r} reached the coordinator of {self.model!r}"
        if req.max_tokens > self.s.max_tokens_limit:
            return f"max_tokens {req.max_tokens} > KVQ_MAX_TOKENS_LIMIT {self.s.max_tokens_limit}"
        try:
            self.dispatch.routing.check()
        except UncoveredSlice as exc:
            return str(exc)
        vocab = self.backbone.meta.vocab_size
        if req.prompt_ids is not None and any(not 0 <= t < vocab for t in req.prompt_ids):
            return f"prompt_ids must be in [0, {vocab})"
        if not ids:
            return "empty prompt: give prompt or prompt_ids"
        n = len(ids)  # tokens of this model's vocabulary
        if n + req.max_tokens >= self.backbone.meta.context_length:
            return f"prompt ({n}) + max_tokens exceeds the context length {self.backbone.meta.context_length}"
        return None

    def _emit(self, seqs: list[Sequence]) -> None:
        """One pipeline per step: each sequence's new token, and `done` for finished ones."""
        pipe = self.r.pipeline(transaction=False)
        for seq in seqs:
            tok = seq.generated[-1]
            self.tokens += 1
            text = self.tokenizer.decode([tok])
            index = len(seq.generated) - 1
            self._reply(
                pipe,
                seq.request_id,
                wire.ReplyEvent(kind="token", index=index, token_id=tok, text=text),
            )
            if seq.finish:
                text = self.tokenizer.decode(seq.generated)
                done = wire.ReplyEvent(kind="done", index=index + 1, text=text, finish=seq.finish)
                self._reply(pipe, seq.request_id, done)
                pipe.xack(self._requests_key, COORDINATOR_GROUP, seq.entry_id)
                self.completed += 1
        pipe.execute()

    def _reply(self, pipe: redis.client.Pipeline, request_id: str, event: wire.ReplyEvent) -> None:
        key = self.keys.request_reply(request_id)
        xadd(pipe, key, wire.encode(event), self.s.stream_maxlen)
        pipe.expire(key, self.s.request_ttl_s)

    def _publish_slots(self, busy: int, total: int) -> None:
        """Slot state for the monitor, and dispatch counters (on the slot-poll thread)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(
            self.keys.coord_slots(self.id),
            mapping={"model": self.model, "busy": busy, "total": total,
                     "ts_ms": int(time.time() * 1000)},
        )  # fmt: skip
        pipe.expire(self.keys.coord_slots(self.id), int(self.s.slot_state_stale_s * 3) + 1)
        pipe.sadd(self.keys.model_coordinators(self.model), self.id)  # after the slots: see monitor
        hot, cold = self.bank.hit_rates()
        stats = self.dispatch.stats.as_dict() | {
            "hot_hit_rate": round(hot, 4), "cold_hit_rate": round(cold, 4),
            "replans": self.dispatch.routing.router.replans,
            "rescues": self.dispatch.routing.rescues,
            "completed": self.completed, "tokens": self.tokens, "claimed": self.claimed,
        }  # fmt: skip
        pipe.hset(self.keys.coord_stats(self.id), mapping=stats)
        ttl = int(self.s.request_ttl_s)
        pipe.expire(self.keys.coord_stats(self.id), ttl)  # a gone coordinator's keys age out
        pipe.expire(self.keys.coord_results(self.id), ttl)
        pipe.execute()
