"""`Intake`: request entries in, each started as a sequence of the engine or refused.

Requests come from every shard of the model's request stream through the coordinators' group
(several coordinators share them; a restarted coordinator re-reads its own pending entries,
and takes over those of coordinators that stopped publishing slots). An entry that does not
decode, names another model, asks for too much, or was started `KVQ_MAX_ATTEMPTS` times
without finishing is answered with an error event (and dead-lettered where the entry itself
is at fault); a restarted request replays the tokens it already streamed.
"""

from __future__ import annotations

import logging
import time

import redis

from kvq import wire
from kvq.bus import claim_from_dead, dead_letter
from kvq.bus.redis_board import RedisBoard
from kvq.bus.shards import ShardedConsumer
from kvq.config import CoordinatorSettings
from kvq.coordinator.cancels import CancelFeed
from kvq.coordinator.engine import Engine
from kvq.coordinator.replies import Replies, streamed_tokens
from kvq.coordinator.routing import SliceRouter
from kvq.errors import ModelError, UncoveredSlice, WireError
from kvq.keys import COORDINATOR_GROUP
from kvq.prompts import render_chat
from kvq.text import Tokenizer
from kvq.text.chat import ChatTemplate

log = logging.getLogger("kvq.coordinator")
READ_PER_TICK = 256  # request entries one tick may read (refusals free their slot at once)


class Intake:
    """The request entries of coordinator `coord_id` of `model`, admitted into `engine`."""

    def __init__(
        self,
        board: RedisBoard,
        settings: CoordinatorSettings,
        coord_id: str,
        model: str,
        engine: Engine,
        feeds: tuple[ShardedConsumer, CancelFeed],
        replies: Replies,
        text: tuple[Tokenizer, ChatTemplate],
        routing: SliceRouter,
        local_experts: bool,
    ) -> None:
        """`feeds`: the request shards and the cancels; `text`: the model's tokenizer and
        chat template; `local_experts`: this coordinator holds a bank (an uncovered slice is
        then refused at once, not waited for)."""
        self.board, self.s, self.id, self.model = board, settings, coord_id, model
        self.engine, self.replies, self.routing = engine, replies, routing
        self.requests, self.cancels = feeds
        self.tokenizer, self.chat = text
        self.local_experts = local_experts
        self.claimed = 0
        self._claim_at = 0.0

    def take(self) -> None:
        """Admit new requests while slots are free. Refused ones take no slot, so reading
        goes on (up to READ_PER_TICK entries): a flood of bad entries is answered at Redis
        speed, not one slot's worth per engine step."""
        block = None if self.engine.busy else self.s.block_ms  # never stall live sequences
        left = READ_PER_TICK
        while self.engine.free and left > 0:
            new = self.requests.read(min(self.engine.free, left), block)
            if not new:
                return
            for stream, eid, fields in new:
                self._admit(stream, eid, fields)
            left -= len(new)
            block = None

    def claim_orphans(self) -> None:
        """Take over requests left pending by coordinators that stopped publishing slots."""
        now = time.monotonic()
        if now - self._claim_at < self.s.claim_idle_ms / 2000:
            return
        self._claim_at = now
        n = sum(
            claim_from_dead(
                self.board.r,
                stream,
                COORDINATOR_GROUP,
                self.id,
                self.board.coordinator_alive,
                self.s.claim_idle_ms,
            )
            for stream in self.requests.streams
        )
        if n:
            log.info("claimed %d requests of dead coordinators", n)
            self.claimed += n
            self.requests.reset_pending()

    def _admit(self, stream: str, eid: bytes, fields: dict[bytes, bytes]) -> None:
        if any(s.entry_id == eid and s.source == stream for s in self.engine.active):
            return  # already generating it (re-read during a pending pass)
        try:
            req = wire.decode(fields, wire.Request)
        except WireError as exc:
            self._bad_entry(stream, eid, fields, str(exc))
            return
        try:
            self._start(stream, eid, fields, req)
        except redis.RedisError:
            raise  # the serving loop waits out an outage; the entry is re-read after it
        except Exception as exc:  # one request's fault must not stop serving
            log.exception("request entry %s of %s could not be started", eid.decode(), stream)
            self._bad_entry(stream, eid, fields, f"{type(exc).__name__}: {exc}")

    def _bad_entry(self, stream: str, eid: bytes, fields: dict[bytes, bytes], why: str) -> None:
        """Dead-letter an entry that cannot be served, and tell its sender when the entry
        holds a readable request id (its reply stream is named by it)."""
        self._dead_letter(stream, eid, fields, why)
        rid = wire.request_id_of(fields)
        if rid is None:  # nobody to tell: the dead letter is the only record
            self.requests.ack(stream, eid)
            return
        self.replies.refuse(rid, stream, eid, 0, "BadRequest", f"refused: {why}")

    def _start(
        self, stream: str, eid: bytes, fields: dict[bytes, bytes], req: wire.Request
    ) -> None:
        rid = req.request_id
        attempt = self.board.start_attempt(rid, eid)
        if attempt == 0:
            self.replies.refuse(
                rid,
                stream,
                eid,
                0,
                "BadRequest",
                f"refused: duplicate request id {rid!r}: "
                "another request already uses it; give each request its own id",
            )
            return
        if attempt > self.s.max_attempts:
            why = (
                f"started {attempt - 1} times without finishing (KVQ_MAX_ATTEMPTS "
                f"{self.s.max_attempts}): its coordinators died or stopped while serving it"
            )
            self._dead_letter(stream, eid, fields, why)
            self.replies.refuse(rid, stream, eid, attempt, "Poison", why)
            return
        forced: list[int] = []
        if attempt > 1:
            history = [e for e in self.board.reply_events(rid) if e.entry in ("", eid.decode())]
            if any(e.kind != "token" for e in history):
                self.requests.ack(stream, eid)  # answered before the restart; its ack was lost
                return
            forced = streamed_tokens(history)
        problem, ids = self.prompt(req)
        problem = problem or self._validate(req, ids)
        if problem is None and (self.cancels.cancelled(rid) or self.cancels.check([rid])):
            problem = "cancelled by its client before it started"
        if problem is not None:
            self.replies.refuse(rid, stream, eid, attempt, "BadRequest", problem)
            return
        self.engine.admit(rid, ids, req.max_tokens, eid, req.sampling, attempt, forced, stream)
        if attempt == 1:
            self.replies.times.admitted(rid)

    def _dead_letter(
        self, stream: str, eid: bytes, fields: dict[bytes, bytes], reason: str
    ) -> None:
        dead_letter(self.board.r, self.board.keys, stream, eid, fields, reason, self.board.maxlen)

    def prompt(self, req: wire.Request) -> tuple[str | None, list[int]]:
        """The prompt's token ids: given, encoded, or a chat rendered by the model's template."""
        if req.prompt_ids is not None:
            return None, req.prompt_ids
        if req.messages is None:
            return None, self.tokenizer.encode(req.prompt or "")
        try:
            text = render_chat(self.chat, req.messages, req.tools)
        except ModelError as exc:
            return str(exc), []
        return None, self.tokenizer.encode(text)

    def _validate(self, req: wire.Request, ids: list[int]) -> str | None:
        """Why the request cannot be served, or None."""
        if req.model != self.model:
            return f"request for model {req.model!r} reached the coordinator of {self.model!r}"
        if req.max_tokens > self.s.max_tokens_limit:
            return f"max_tokens {req.max_tokens} > KVQ_MAX_TOKENS_LIMIT {self.s.max_tokens_limit}"
        try:
            self.routing.check()
        except UncoveredSlice as exc:
            if self.local_experts:
                return str(exc)
            # a backbone file: admitted, its step waits up to KVQ_REPLICA_WAIT_S for workers
        meta = self.engine.backbone.meta
        vocab = meta.vocab_size
        if req.prompt_ids is not None and any(not 0 <= t < vocab for t in req.prompt_ids):
            return f"prompt_ids must be in [0, {vocab})"
        if not ids:
            return "empty prompt: give prompt, prompt_ids or messages"
        if any(not 0 <= t < vocab for t in req.sampling.stop_token_ids):
            return f"stop_token_ids must be in [0, {vocab})"
        n = len(ids)  # tokens of this model's vocabulary
        # vLLM's rule: prompt + completion fit the context (the engine ends at it, `context`)
        if n + req.max_tokens > meta.context_length:
            return f"prompt ({n}) + max_tokens exceeds the context length {meta.context_length}"
        return None
