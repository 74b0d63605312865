"""The state of one `kvq api` process (`Gateway`): its Redis clients, settings and metrics, and
the calls every route makes of them: model cards, a model's tokenizer, a chat's room, a
request's reply events, cancelling."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from kvq import wire
from kvq.api.gate import Gate, failure_status, not_served
from kvq.api.metrics import ApiMetrics
from kvq.api.params import Call
from kvq.api.queue import SAMPLE_S, entry_key
from kvq.api.shape import model_card
from kvq.api.structured import compile_constraint
from kvq.api.text import ModelText, Texts
from kvq.bus import connect_async
from kvq.bus.redis_board import open_board
from kvq.client import ReplyReader, RequestFailed
from kvq.config import Settings
from kvq.errors import ApiError, WireError
from kvq.keys import request_shard
from kvq.text import tool_calls


class Gateway:
    """The state one gateway process holds: clients, settings, its own metrics."""

    def __init__(self, settings: Settings) -> None:
        self.board = open_board(settings.bus, settings.lifetimes)
        self.gate = Gate(self.board, settings.api)
        self.ar = connect_async(settings.bus)
        self.s, self.block_ms = settings.api, settings.block_ms
        self.max_tokens_limit = settings.max_tokens_limit
        self.started = int(time.time())
        self.registry = CollectorRegistry()
        self.metrics = ApiMetrics(self.registry)
        self.texts = Texts()

    def cards(self, only: str | None = None) -> list[dict[str, Any]]:
        """The model objects of `/v1/models` (one model's, with `only`; 404 if unknown)."""
        names = self.gate.models() if only is None else [only]
        out = []
        for m in names:
            info = self.board.model_info(m)
            if info is not None:
                out.append(model_card(m, self.started, info.meta.context_length))
            elif only is not None:
                raise ApiError(
                    404,
                    f"model {m!r} does not exist; GET /v1/models lists them",
                    param="model",
                    code="model_not_found",
                )
        return out

    def text(self, model: str) -> ModelText:
        """The model's tokenizer and template here; 404 unknown, 501 when its file is not on
        this machine."""
        info = self.board.model_info(model)
        if info is None:
            raise ApiError(
                404,
                f"model {model!r} does not exist; GET /v1/models lists them",
                param="model",
                code="model_not_found",
            )
        text = self.texts.get(info)
        if text is None:
            raise ApiError(
                501,
                f"model {model!r} comes from {info.source}, not a file on this gateway's "
                "machine: it has no tokenizer here",
                kind="server_error",
                code="no_tokenizer",
            )
        return text

    def fill_max_tokens(self, call: Call) -> Call:
        """A chat without `max_tokens` gets the room left in the context (vLLM's rule), at
        most KVQ_MAX_TOKENS_LIMIT; KVQ_API_MAX_TOKENS_DEFAULT when the model's file is not
        here."""
        if not call.chat or call.max_tokens_given:
            return call
        try:
            text = self.text(call.model)
        except ApiError as exc:
            if exc.status == 501:
                return call
            raise
        room = text.room(text.encode(call.prompt, call.messages, tools=call.tools_json))
        if room < 1:
            raise ApiError(
                400,
                f"the messages fill the context ({text.context_length} tokens)",
                param="messages",
                code="refused",
            )
        return dataclasses.replace(call, max_tokens=min(room, self.max_tokens_limit))

    async def events(
        self, model: str, request_id: str, entry: str
    ) -> AsyncIterator[wire.ReplyEvent]:
        """The reply events of a request until `done`, each token once (`ReplyFilter`).

        ApiError for an `error` event; 503 once no coordinator of `model` is alive; 504 only
        when nothing moved for `KVQ_API_TIMEOUT_S`: while queued, the deadline moves with
        the queue (entries taken, tokens generated); once taken, with each reply event."""
        key = self.board.keys.request_reply(request_id)
        watch = self.gate.watch(model)
        shard = request_shard(request_id, len(watch.streams))
        reader, mine = ReplyReader(request_id, entry), entry_key(entry)
        last, deadline = b"0-0", time.monotonic() + self.s.timeout_s
        taken, moved = False, -1
        while True:
            q = await run_in_threadpool(watch.sample)
            if not q.alive:
                raise not_served(model, self.s.retry_after_s)
            if not taken and (watch.progress(q) != moved or q.last[shard] >= mine):
                taken, moved = q.last[shard] >= mine, watch.progress(q)
                deadline = time.monotonic() + self.s.timeout_s
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                where = "its coordinator" if taken else f"the queue of {model!r}"
                raise ApiError(
                    504,
                    f"no progress on request {request_id} in {self.s.timeout_s}s "
                    f"(KVQ_API_TIMEOUT_S): {where} did not move",
                    kind="timeout",
                    code="timeout",
                )
            block = min(left_ms, self.block_ms, int(SAMPLE_S * 1000))
            resp = await self.ar.xread({key: last}, count=256, block=block)
            for _, entries in resp or []:
                taken, deadline = True, time.monotonic() + self.s.timeout_s
                for eid, fields in entries:
                    last = eid
                    try:
                        ev = reader.take(fields)
                    except WireError as exc:
                        raise ApiError(500, str(exc), kind="server_error") from None
                    except RequestFailed as exc:
                        raise failure_status(exc.failure) from None
                    if ev is None:
                        continue
                    yield ev
                    if ev.kind == "done":
                        await self.ar.delete(key)  # this gateway is its only reader
                        return

    def tool_format(self, model: str) -> str:
        """The tool-call format of the model's chat template (`hermes` when its file is not
        on this machine)."""
        try:
            return tool_calls.tool_format(self.text(model).chat.source)
        except ApiError as exc:
            if exc.status == 501:
                return "hermes"
            raise

    def prepare(self, call: Call) -> Call:
        """The call as it is queued: a chat's default `max_tokens`; with tools that must be
        called, the grammar of a call in the model's own format."""
        call = self.fill_max_tokens(call)
        t = call.tools
        if t is None or t.choice == "auto":
            return call
        if call.sampling.grammar is not None:
            raise ApiError(
                400,
                "'tool_choice' required or named constrains the answer, and "
                "so does 'response_format': give one",
                param="tool_choice",
            )
        functions = (
            [t.function(t.choice)] if t.choice != "required" else [x["function"] for x in t.spec]
        )
        lark = tool_calls.call_grammar(self.tool_format(call.model), functions, t.parallel)
        grammar = compile_constraint(("tool_choice", "lark", lark))
        return dataclasses.replace(
            call, sampling=msgspec.structs.replace(call.sampling, grammar=grammar)
        )

    async def cancel(self, call: Call, request_id: str) -> None:
        with anyio.CancelScope(shield=True):  # also when the caller's task is being cancelled
            await run_in_threadpool(self.gate.cancel, call.model, request_id)
