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
from dataclasses import replace
from pathlib import Path

import msgspec
import redis
import torch

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bank.server import ExpertServer
from kvq.bus import claim_from_dead, dead_letter
from kvq.bus.board import Fields, wait_for_model
from kvq.bus.outage import Outage, run_until_stopped
from kvq.bus.records import CoordStats, InFlight, SlotState
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.bus.shards import ShardedConsumer
from kvq.bus.streams import entry_ms
from kvq.catalog import ModelInfo
from kvq.config import CoordinatorSettings, DispatchSettings, RoutingSettings, Settings
from kvq.coordinator.cancels import CancelFeed
from kvq.coordinator.chain import Chain
from kvq.coordinator.dispatch import Dispatcher
from kvq.coordinator.drafts import DraftPlan
from kvq.coordinator.engine import Engine, Sequence
from kvq.coordinator.own_bytes import OwnBytes
from kvq.coordinator.removal import Removal
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.slots import SlotPoller
from kvq.coordinator.stage_check import Referee
from kvq.coordinator.telemetry import RequestTimes
from kvq.coordinator.trust import Trust, trust_policy
from kvq.device import compute_dtype
from kvq.errors import (
    ConfigError,
    ModelCorrupt,
    ModelError,
    ModelRemoved,
    NoReplica,
    UncoveredSlice,
    WireError,
)
from kvq.gguf import read_meta
from kvq.gguf.registry import check_backbone_file, check_model_file
from kvq.gguf.split import backbone_source
from kvq.keys import COORDINATOR_GROUP, request_streams
from kvq.model import Backbone
from kvq.prompts import render_chat
from kvq.text import load_tokenizer
from kvq.text.chat import load_chat_template

log = logging.getLogger("kvq.coordinator")
READ_PER_TICK = 256  # request entries one tick may read (refusals free their slot at once)


def streamed_tokens(history: list[wire.ReplyEvent]) -> list[int]:
    """The token ids a request's reply stream already holds, index 0 onwards without a gap:
    what a new run of the request replays without streaming it again."""
    by_index: dict[int, int] = {}
    for ev in history:
        if ev.kind == "token" and ev.token_id is not None:
            by_index.setdefault(ev.index, ev.token_id)
    out: list[int] = []
    while len(out) in by_index:
        out.append(by_index[len(out)])
    return out


def _load(
    info: ModelInfo,
    model_path: str | Path,
    routing: RoutingSettings,
    settings: CoordinatorSettings,
) -> tuple[Backbone, RoutingSettings, torch.dtype]:
    """The backbone this coordinator runs from `model_path` (checked against the registered
    model first: the wrong file fails fast), the routing it implies, and its compute dtype.
    At stage grain (X12) only the embedding and the head: the blocks run on stage holders."""
    source = backbone_source(model_path)  # None: the full file, experts and all
    if source is None:
        check_model_file(info, model_path)
    else:
        check_backbone_file(info, model_path, source)
    meta = read_meta(model_path)
    dtype = compute_dtype(torch.device("cpu"), settings.compute_dtype, info.meta.expert_types())
    stage = info.grain == "stage"
    if stage:
        routing = replace(routing, local_experts=False)
        meta = replace(meta, expert_tensors={})  # no bank: nothing routed is computed here
    backbone = Backbone.from_gguf(
        model_path, dtype=dtype, meta=meta, span=range(0) if stage else None
    )
    if not meta.holds_experts and routing.local_experts:
        raise ConfigError(
            f"{str(model_path)!r} is a backbone file without routed experts, so this "
            "coordinator cannot compute them: unset KVQ_COORDINATOR_EXPERTS (or set it to "
            "none), or start the coordinator on the full model file"
        )
    return backbone, routing, dtype


class Coordinator:
    """Serves one model from `model_path`, registered on the board as `model`."""

    def __init__(
        self,
        board: RedisBoard,
        settings: CoordinatorSettings,
        routing: RoutingSettings,
        dispatch: DispatchSettings,
        bank: BankOptions,
        coord_id: str,
        model: str,
        model_path: str | Path,
    ) -> None:
        self.board, self.s, self.id, self.model = board, settings, coord_id, model
        self.info = wait_for_model(board, model, settings.model_wait_s, settings.reconnect_max_s)
        self.backbone, routing, dtype = _load(self.info, model_path, routing, settings)
        meta, stage = self.backbone.meta, self.info.grain == "stage"
        self.tokenizer = load_tokenizer(model_path)  # the file's own vocabulary (or bytes)
        self.chat = load_chat_template(model_path)  # the file's own, or ChatML
        cpu = torch.device("cpu")  # the backbone runs on the CPU (docs/limits.md)
        # a backbone file holds no expert: no bank, every slice on workers
        self.bank = Bank(self.backbone.experts.values(), bank, cpu) if meta.holds_experts else None
        hidden = self.backbone.meta.embedding_length
        self.server = ExpertServer(coord_id, model, self.bank, hidden, dtype, board.now_ms)
        self.trust = Trust(trust_policy(dispatch), coord_id, clock_ms=board.now_ms)
        self.routing = SliceRouter(
            board, routing, coord_id, self.info, self.trust, torch.get_num_threads()
        )
        self.dispatch = Dispatcher(
            board,
            board.r,
            board.keys,
            dispatch,
            coord_id,
            self.info,
            self.server,
            self.routing,
            board.maxlen,
        )
        self.chain = self._stage_chain(dispatch, model_path) if stage else None
        drafts = DraftPlan(settings.speculative, settings.draft_tokens)
        s = settings
        self.engine = Engine(
            self.backbone, self.tokenizer, s.n_slots, s.prefill_chunk, self.chain, drafts
        )
        self.requests, self.cancels, self.slots = self._intake(settings)
        self.stop = threading.Event()
        # the registered checksums of this coordinator's own expert ranges, before any blame
        self.own = OwnBytes(model_path, self.info) if backbone_source(model_path) is None else None
        if self.own is not None:
            self.dispatch.verifier.own_bytes = self.own.refuse
            if self.chain is not None:
                self.chain.referee.own_bytes = self.own.refuse
        self.completed = 0
        self.cancelled = 0
        self.tokens = 0
        self.claimed = 0
        self.times = RequestTimes()
        self._claim_at = 0.0
        self._published = False  # a slot record was published once (a later new one: lost)
        self.removal = Removal(self.board, self.model, self.id)

    def _stage_chain(self, dispatch: DispatchSettings, model_path: str | Path) -> Chain:
        """The chain of stage jobs of a model sliced by stage, and its referee."""
        return Chain(
            self.backbone,
            self.info,
            self.id,
            self.routing,
            self.dispatch.mailbox,
            self.dispatch.tally,
            dispatch.stage_deadline_ms,
            dispatch.replica_wait_s,
            dispatch.microbatches,
            self.dispatch.verifier,
            Referee(model_path, self.info.stages()),
            self.board.now_ms,
        )

    def _intake(
        self, settings: CoordinatorSettings
    ) -> tuple[ShardedConsumer, CancelFeed, SlotPoller]:
        """What comes in: every shard of the model's requests (through its group,
        kvq.bus.shards), its cancels, and the slot poller that publishes how busy we are."""
        board, model = self.board, self.model
        shards = request_streams(board.keys, model, self.info.request_shards)
        requests = ShardedConsumer(board.r, shards, COORDINATOR_GROUP, self.id)
        cancels = CancelFeed(board.r, board.keys.model_cancels(model), board.keys)
        slots = SlotPoller(
            lambda: self.engine.busy,
            settings.n_slots,
            settings.saturation_threshold,
            self._publish_slots,
            settings.slot_poll_s,
            board.lifetimes.load_fresh_s(),
        )
        return requests, cancels, slots

    @classmethod
    def from_settings(
        cls, settings: Settings, coord_id: str, model: str, model_path: str | Path
    ) -> Coordinator:
        routing = settings.routing
        if backbone_source(model_path) is not None and (
            "coordinator_experts" not in settings.model_fields_set
        ):  # a backbone file implies KVQ_COORDINATOR_EXPERTS=none (set to all: refused)
            routing = replace(routing, local_experts=False)
        board = open_board(settings.bus, settings.lifetimes)
        # KVQ_COORDINATOR_EXPERTS=none: no hot experts; fallback and verification read the
        # mapped file (a backbone file has none: no bank at all)
        only_backbone = {} if routing.local_experts else {"hot_bytes": 0, "dynamic": False}
        bank = BankOptions.from_settings(settings, **only_backbone)
        return cls(
            board,
            settings.coordinator,
            routing,
            settings.dispatch,
            bank,
            coord_id,
            model,
            model_path,
        )

    def run(self) -> None:
        outage = Outage(log, self.s.reconnect_max_s)
        self.slots.start()
        log.info(
            "ready: coordinator %s serves model %s (%d slots, %d request stream(s), %d slices)",
            self.id,
            self.model,
            self.engine.n_slots,
            len(self.requests.streams),
            len(self.info.slices),
        )
        if self.own is not None:
            self.own.start_sweep(self.stop)
        try:
            self._serve(outage)
        finally:
            self.slots.close()
            self.slots.poll_once()
            # gone at once for gateways (their waiting calls turn 503), not after staleness
            try:
                self.board.forget_coordinator(self.model, self.id)
                self.removal.clean(len(self.requests.streams))
            except redis.RedisError as exc:
                log.warning("could not leave %s's coordinators: %s", self.model, exc)

    def _serve(self, outage: Outage) -> None:
        """Ticks until stopped. A Redis that is down, refuses writes (`MISCONF`, `OOM`, ...)
        or refuses one command is waited out (`kvq.bus.outage`): no such error ends the
        coordinator; the requests it holds are read again from its pending entries."""
        run_until_stopped(self.stop, self.tick, outage, after_failure=self.requests.reset_pending)

    def tick(self) -> None:
        """Take over orphans, drop cancelled requests, admit what fits, run one step."""
        if self.own is not None and self.own.corrupt:
            raise ModelCorrupt(self.own.corrupt)  # refused: the operator replaces the file
        if self.removal.seen:
            self._end_all(self.removal.error())
        self._claim_orphans()
        gone = self.cancels.poll() | self.cancels.due(s.request_id for s in self.engine.active)
        if gone:
            self._retire(self.engine.cancel(gone))
        self._take_requests()
        self.slots.note(self.engine.busy)
        if self.engine.busy:
            moe = None if self.chain is not None else self.dispatch.for_step(*self.slots.current())
            try:
                self.engine.step(moe, self._emit)
            except NoReplica as exc:  # a backbone file, and no worker for a slice in time
                self._fail_active(exc)
                return
            if self.bank is not None:
                self.bank.step()  # B5: dynamic updates count engine steps

    def _fail_active(self, exc: NoReplica) -> None:
        """End every sequence of the failed step with an error event (and ack it): a step
        without a slice's result has no token to give, and none is made up."""
        log.warning("%s; %d request(s) end with an error", exc, self.engine.busy)
        for seq in self.engine.drop_all():
            self._refuse(
                seq.request_id, seq.source, seq.entry_id, seq.attempt, "NoReplica", str(exc)
            )

    def _end_all(self, exc: ModelRemoved) -> None:
        """End every request held with `exc` as its error event, then stop with it."""
        log.error("%s; %d request(s) end with an error", exc, self.engine.busy)
        for seq in self.engine.drop_all():
            self._refuse(
                seq.request_id, seq.source, seq.entry_id, seq.attempt, "ModelRemoved", str(exc)
            )
        raise exc

    def _take_requests(self) -> None:
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

    def _claim_orphans(self) -> None:
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
        self._refuse(rid, stream, eid, 0, "BadRequest", f"refused: {why}")

    def _start(
        self, stream: str, eid: bytes, fields: dict[bytes, bytes], req: wire.Request
    ) -> None:
        rid = req.request_id
        attempt = self.board.start_attempt(rid, eid)
        if attempt == 0:
            self._refuse(
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
            self._refuse(rid, stream, eid, attempt, "Poison", why)
            return
        forced: list[int] = []
        if attempt > 1:
            history = [e for e in self.board.reply_events(rid) if e.entry in ("", eid.decode())]
            if any(e.kind != "token" for e in history):
                self.requests.ack(stream, eid)  # answered before the restart; its ack was lost
                return
            forced = streamed_tokens(history)
        problem, ids = self._prompt(req)
        problem = problem or self._validate(req, ids)
        if problem is None and (self.cancels.cancelled(rid) or self.cancels.check([rid])):
            problem = "cancelled by its client before it started"
        if problem is not None:
            self._refuse(rid, stream, eid, attempt, "BadRequest", problem)
            return
        self.engine.admit(rid, ids, req.max_tokens, eid, req.sampling, attempt, forced, stream)
        if attempt == 1:
            self.times.admitted(rid)

    def _dead_letter(
        self, stream: str, eid: bytes, fields: dict[bytes, bytes], reason: str
    ) -> None:
        dead_letter(self.board.r, self.board.keys, stream, eid, fields, reason, self.board.maxlen)

    def _refuse(
        self, rid: str, stream: str, eid: bytes, attempt: int, kind: str, message: str
    ) -> None:
        """Answer request entry `eid` of `stream` with an error event, and ack it."""
        event = wire.ReplyEvent(
            kind="error",
            error=wire.Failure(type=kind, message=message),
            attempt=attempt,
            entry=eid.decode(),
        )
        self.times.finished(rid, "error")
        self.requests.answer([self._reply(rid, event)], [(stream, eid)], self.board.maxlen)

    def _prompt(self, req: wire.Request) -> tuple[str | None, list[int]]:
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
            if self.bank is not None:
                return str(exc)
            # a backbone file: admitted, its step waits up to KVQ_REPLICA_WAIT_S for workers
        vocab = self.backbone.meta.vocab_size
        if req.prompt_ids is not None and any(not 0 <= t < vocab for t in req.prompt_ids):
            return f"prompt_ids must be in [0, {vocab})"
        if not ids:
            return "empty prompt: give prompt, prompt_ids or messages"
        if any(not 0 <= t < vocab for t in req.sampling.stop_token_ids):
            return f"stop_token_ids must be in [0, {vocab})"
        n = len(ids)  # tokens of this model's vocabulary
        # vLLM's rule: prompt + completion fit the context (the engine ends at it, `context`)
        if n + req.max_tokens > self.backbone.meta.context_length:
            return f"prompt ({n}) + max_tokens exceeds the context length {self.backbone.meta.context_length}"
        return None

    def _emit(self, seqs: list[Sequence]) -> None:
        """One round trip per step: each sequence's new token, `done` for finished ones, then
        the acks of the finished requests."""
        replies: list[tuple[str, Fields, int]] = []
        finished: list[tuple[str, bytes]] = []
        for seq in seqs:
            tok = seq.new_token
            # None: this step ended the sequence at EOS or a stop token; not fresh: an
            # earlier run of the request streamed this token already
            if tok is not None and seq.fresh:
                self.tokens += 1
                token = wire.ReplyEvent(
                    kind="token",
                    index=len(seq.generated) - 1,
                    token_id=tok,
                    text=seq.new_text,
                    logprob=seq.new_logprob,
                    top_logprobs=seq.new_top,
                    attempt=seq.attempt,
                    entry=seq.entry_id.decode(),
                )
                replies.append(self._reply(seq.request_id, token))
                self.times.token(seq.request_id)
            if seq.finish:
                replies.append(self._reply(seq.request_id, self._done(seq)))
                finished.append((seq.source, seq.entry_id))
                self.completed += 1
                self.times.finished(seq.request_id, seq.finish)
        self.requests.answer(replies, finished, self.board.maxlen)

    def _retire(self, seqs: list[Sequence]) -> None:
        """Answer and ack cancelled sequences (their client may be gone; the stream expires)."""
        if seqs:
            self.cancelled += len(seqs)
            for s in seqs:
                self.times.finished(s.request_id, "cancelled")
            replies = [self._reply(s.request_id, self._done(s)) for s in seqs]
            done = [(s.source, s.entry_id) for s in seqs]
            self.requests.answer(replies, done, self.board.maxlen)

    @staticmethod
    def _done(seq: Sequence) -> wire.ReplyEvent:
        n = len(seq.generated)  # tokens streamed: EOS and stop tokens are not among them
        return wire.ReplyEvent(
            kind="done",
            index=n,
            text=seq.completion,
            finish=seq.finish,
            prompt_tokens=len(seq.prompt_ids),
            attempt=seq.attempt,
            entry=seq.entry_id.decode(),
            prompt=seq.prompt_lp or None,
        )

    def _reply(self, request_id: str, event: wire.ReplyEvent) -> tuple[str, Fields, int]:
        key = self.board.keys.request_reply(request_id)
        return key, wire.encode(event), self.board.lifetimes.reply_s()

    def snapshot(self) -> CoordStats:
        """The counters to publish (read on the slot-poll thread: plain values only)."""
        hot, cold = self.bank.hit_rates() if self.bank is not None else (0.0, 0.0)
        counters = msgspec.structs.asdict(self.dispatch.stats)
        return CoordStats(
            **counters,
            hot_hit_rate=round(hot, 4),
            cold_hit_rate=round(cold, 4),
            replans=self.routing.replans,
            rescues=self.routing.rescues,
            completed=self.completed,
            tokens=self.tokens,
            claimed=self.claimed,
            finishes=self.times.finishes_text(),
            job_rtt_s=self.dispatch.job_rtt.to_text(),
            ttft_s=self.times.ttft.to_text(),
            token_gap_s=self.times.gap.to_text(),
            stage_wait_s=self.chain.wait_text() if self.chain is not None else "{}",
        )

    def in_flight(self) -> list[InFlight]:
        """The requests generated now, for the operators' view (read on the slot-poll
        thread: a copy of the active list, plain values only)."""
        return [
            InFlight(
                request=s.request_id,
                model=self.model,
                coordinator=self.id,
                grain=self.info.grain,
                state="decode" if s.generated else "prefill",
                prompt_tokens=len(s.prompt_ids),
                generated=len(s.generated),
                max_tokens=s.max_tokens,
                queued_ms=entry_ms(s.entry_id),
                attempt=s.attempt,
            )
            for s in list(self.engine.active)
        ]

    def _publish_slots(self, busy: int, total: int) -> None:
        """Slot state for the monitor, and the counters (on the slot-poll thread); none once
        the model was removed."""
        if self.removal.check():
            return
        state = SlotState(
            model=self.model,
            busy=busy,
            total=total,
            ts_ms=int(self.board.now_ms()),
            experts=self.dispatch.has_experts,
        )
        inflight = self.in_flight()
        if self.board.publish_slots(self.id, state, self.snapshot(), inflight) and self._published:
            log.warning(
                "redis had lost the slot record of %s (or its place among %s's "
                "coordinators); published it again",
                self.id,
                self.model,
            )
        self._published = True
        routed = self.dispatch.take_routed()
        if routed:
            self.board.add_routed(self.model, routed)
