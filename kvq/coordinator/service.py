"""The coordinator process: requests in, tokens out, expert slices local or remote.

Requests come from the model's request stream through a consumer group (several coordinators
share them; a restarted coordinator re-reads its own pending requests): `kvq.coordinator.intake`.
Each request's tokens stream back on its own reply stream: `kvq.coordinator.replies`. Slot state
(busy, total, ts_ms) is published every tick for the monitor.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

import msgspec
import redis
import torch

from kvq.bank import Bank, BankOptions
from kvq.bank.server import ExpertServer
from kvq.bus.board import wait_for_model
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
from kvq.coordinator.engine import Engine
from kvq.coordinator.intake import Intake
from kvq.coordinator.own_bytes import OwnBytes
from kvq.coordinator.removal import Removal
from kvq.coordinator.replies import Replies
from kvq.coordinator.routing import SliceRouter
from kvq.coordinator.slots import SlotPoller
from kvq.coordinator.stage_check import Referee
from kvq.coordinator.telemetry import RequestTimes
from kvq.coordinator.trust import Trust, trust_policy
from kvq.device import compute_dtype
from kvq.errors import ConfigError, ModelCorrupt, ModelRemoved, NoReplica
from kvq.gguf import read_meta
from kvq.gguf.registry import check_backbone_file, check_model_file
from kvq.gguf.split import backbone_source
from kvq.keys import COORDINATOR_GROUP, request_streams
from kvq.model import Backbone
from kvq.text import load_tokenizer
from kvq.text.chat import load_chat_template

log = logging.getLogger("kvq.coordinator")


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
        self.requests, self.cancels, self.slots = self._feeds(settings)
        self.times = RequestTimes()
        self.replies = Replies(board, self.requests, self.times)
        self.intake = self._intake(settings)
        self.stop = threading.Event()
        # the registered checksums of this coordinator's own expert ranges, before any blame
        self.own = OwnBytes(model_path, self.info) if backbone_source(model_path) is None else None
        if self.own is not None:
            self.dispatch.verifier.own_bytes = self.own.refuse
            if self.chain is not None:
                self.chain.referee.own_bytes = self.own.refuse
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

    def _feeds(
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

    def _intake(self, settings: CoordinatorSettings) -> Intake:
        """The admission of the request entries into the engine."""
        return Intake(
            self.board,
            settings,
            self.id,
            self.model,
            self.engine,
            (self.requests, self.cancels),
            self.replies,
            (self.tokenizer, self.chat),
            self.routing,
            self.bank is not None,
        )

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
        self.intake.claim_orphans()
        gone = self.cancels.poll() | self.cancels.due(s.request_id for s in self.engine.active)
        if gone:
            self.replies.retire(self.engine.cancel(gone))
        self.intake.take()
        self.slots.note(self.engine.busy)
        if self.engine.busy:
            moe = None if self.chain is not None else self.dispatch.for_step(*self.slots.current())
            try:
                self.engine.step(moe, self.replies.emit)
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
            self.replies.refuse(
                seq.request_id, seq.source, seq.entry_id, seq.attempt, "NoReplica", str(exc)
            )

    def _end_all(self, exc: ModelRemoved) -> None:
        """End every request held with `exc` as its error event, then stop with it."""
        log.error("%s; %d request(s) end with an error", exc, self.engine.busy)
        for seq in self.engine.drop_all():
            self.replies.refuse(
                seq.request_id, seq.source, seq.entry_id, seq.attempt, "ModelRemoved", str(exc)
            )
        raise exc

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
            completed=self.replies.completed,
            tokens=self.replies.tokens,
            claimed=self.intake.claimed,
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
