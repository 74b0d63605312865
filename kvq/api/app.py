"""`kvq api`: the OpenAI-compatible HTTP gateway, a Starlette app.

| method | path                   | answer                                                  |
|--------|------------------------|---------------------------------------------------------|
| GET    | /v1/models             | the registered models, with their context length        |
| GET    | /v1/models/{id}        | one of them; 404 for an unknown id                      |
| POST   | /tokenize              | vLLM's: `{model, prompt | messages}` → `{count, tokens}`  |
| POST   | /detokenize            | vLLM's: `{model, tokens}` → `{prompt}`                  |
| POST   | /v1/completions        | a completion; `stream: true` as server-sent events      |
| POST   | /v1/chat/completions   | a chat completion (the model's chat template)           |
| GET    | /health                | 200 while Redis answers PING, else 503                  |
| GET    | /metrics               | Prometheus text: this gateway's calls, tokens, latency  |

Stateless: a call is checked (`params`), admitted and queued (`gate`), then its reply stream is
read until `done`, an `error` event, no live coordinator (503), or `KVQ_API_TIMEOUT_S` without
progress (504: neither the queue ahead of it nor its reply moved; `kvq.api.queue`). A client
that goes away before the end cancels its request. Errors are OpenAI's `{"error": {...}}`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import redis
import redis.asyncio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvq import wire
from kvq.api.gate import Gate, failure_status, not_served
from kvq.api.metrics import ApiMetrics
from kvq.api.params import Call, json_object, parse, parse_messages
from kvq.api.queue import SAMPLE_S, entry_key
from kvq.api.shape import Answer, model_card, models_list
from kvq.api.text import ModelText, Texts
from kvq.asgi import capped_body
from kvq.bus import connect_async
from kvq.bus.connection import close_async
from kvq.bus.redis_board import open_board
from kvq.client import ReplyFilter
from kvq.config import Settings
from kvq.errors import ApiError, WireError
from kvq.keys import request_shard

MAX_BODY = 1 << 20
MAX_TOKEN_ID = 1 << 31  # above every vocabulary; the tokenizer says which ids below it exist
T = TypeVar("T")


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
                raise ApiError(404, f"model {m!r} does not exist; GET /v1/models lists them",
                               param="model", code="model_not_found")  # fmt: skip
        return out

    def text(self, model: str) -> ModelText:
        """The model's tokenizer and template here; 404 unknown, 501 when its file is not on
        this machine."""
        info = self.board.model_info(model)
        if info is None:
            raise ApiError(404, f"model {model!r} does not exist; GET /v1/models lists them",
                           param="model", code="model_not_found")  # fmt: skip
        text = self.texts.get(info)
        if text is None:
            raise ApiError(
                501, f"model {model!r} comes from {info.source}, not a file on this gateway's "
                "machine: it has no tokenizer here", kind="server_error", code="no_tokenizer",
            )  # fmt: skip
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
        room = text.room(text.encode(call.prompt, call.messages))
        if room < 1:
            raise ApiError(400, f"the messages fill the context ({text.context_length} tokens)",
                           param="messages", code="refused")  # fmt: skip
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
        seen, mine = ReplyFilter(entry), entry_key(entry)
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
                    504, f"no progress on request {request_id} in {self.s.timeout_s}s "
                    f"(KVQ_API_TIMEOUT_S): {where} did not move",
                    kind="timeout", code="timeout",
                )  # fmt: skip
            block = min(left_ms, self.block_ms, int(SAMPLE_S * 1000))
            resp = await self.ar.xread({key: last}, count=256, block=block)
            for _, entries in resp or []:
                taken, deadline = True, time.monotonic() + self.s.timeout_s
                for eid, fields in entries:
                    last = eid
                    try:
                        ev = wire.decode(fields, wire.ReplyEvent)
                    except WireError as exc:
                        raise ApiError(500, str(exc), kind="server_error") from None
                    if not seen.accept(ev):
                        continue
                    if ev.kind == "error":
                        raise failure_status(ev.error)
                    yield ev
                    if ev.kind == "done":
                        await self.ar.delete(key)  # this gateway is its only reader
                        return

    async def cancel(self, call: Call, request_id: str) -> None:
        with anyio.CancelScope(shield=True):  # also when the caller's task is being cancelled
            await run_in_threadpool(self.gate.cancel, call.model, request_id)


async def _body(request: Request) -> bytes:
    """The body, at most MAX_BODY bytes (chunked bodies too), else 413."""
    raw = await capped_body(request, MAX_BODY)
    if raw is None:
        raise ApiError(413, f"the body is over {MAX_BODY} bytes")
    return raw


def _json_body(raw: bytes) -> dict[str, Any]:
    return json_object(raw)


def _model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, f"'model' must be a model id, got {model!r}", param="model")
    return model


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Stream(StreamingResponse):
    """An SSE response that cancels its request if it ends before its last event (the client
    went away, the server is stopping)."""

    def __init__(self, body: AsyncIterator[bytes], abort: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.abort, self.finished = abort, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.finished:
                await self.abort()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _or_disconnect(request: Request, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `fn` unless the client disconnects first: (gone, its result)."""
    result: list[T] = []
    errors: list[Exception] = []
    gone = False
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            try:
                result.append(await fn())
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the group
                errors.append(exc)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal gone
            await _until_disconnect(request)
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    if errors:
        raise errors[0]
    return gone and not result, result[0] if result else None


def create_app(settings: Settings) -> Starlette:
    """The gateway's app; every answer is read from Redis at call time."""
    gw = Gateway(settings)

    async def health(request: Request) -> Response:
        ok = await run_in_threadpool(gw.gate.healthy)
        return JSONResponse({"ok": ok}, 200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request) -> Response:
        await authorize(request)
        return JSONResponse(models_list(await run_in_threadpool(gw.cards)))

    async def model(request: Request) -> Response:
        await authorize(request)
        cards = await run_in_threadpool(gw.cards, request.path_params["model"])
        return JSONResponse(cards[0])

    async def tokenize(request: Request) -> Response:
        await authorize(request)
        body = _json_body(await _body(request))
        model = _model_of(body)
        text = await run_in_threadpool(gw.text, model)
        add_special = body.get("add_special_tokens", True)
        if body.get("messages") is not None:
            messages = parse_messages(body["messages"])
            ids = await run_in_threadpool(text.encode, None, messages, add_special is not False)
        elif isinstance(body.get("prompt"), str):
            ids = await run_in_threadpool(
                text.encode, body["prompt"], None, add_special is not False
            )
        else:
            raise ApiError(400, "'prompt' must be a string (or give 'messages')", param="prompt")
        return JSONResponse({"count": len(ids), "max_model_len": text.context_length,
                             "tokens": ids, "token_strs": None})  # fmt: skip

    async def detokenize(request: Request) -> Response:
        await authorize(request)
        body = _json_body(await _body(request))
        text = await run_in_threadpool(gw.text, _model_of(body))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_TOKEN_ID for i in ids
        ):
            raise ApiError(400, f"'tokens' must be a list of token ids (integers in [0, "
                           f"{MAX_TOKEN_ID}))", param="tokens")  # fmt: skip
        try:
            prompt = await run_in_threadpool(text.tokenizer.decode, ids)
        except (IndexError, KeyError, ValueError, OverflowError) as exc:
            raise ApiError(400, f"'tokens' holds an id outside the vocabulary: {exc}",
                           param="tokens") from None  # fmt: skip
        return JSONResponse({"prompt": prompt})

    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def authorize(request: Request) -> None:
        if gw.s.keys:  # no thread hop when auth is off
            await run_in_threadpool(gw.gate.authorize, request.headers.get("authorization"))

    async def _complete(request: Request, chat: bool) -> Response:
        t0 = time.monotonic()
        await authorize(request)
        call = parse(
            await _body(request), chat=chat, max_tokens_default=gw.s.max_tokens_default,
            max_tokens_limit=gw.max_tokens_limit,
        )  # fmt: skip
        call = await run_in_threadpool(gw.fill_max_tokens, call)
        rid, entry = await run_in_threadpool(gw.gate.admit, call)
        answer = Answer(rid, call.model, chat, call.sampling.logprobs is not None)
        events = gw.events(call.model, rid, entry)
        try:
            first = await _first(request, events)  # errors before any byte: a real status
        except BaseException:
            await gw.cancel(call, rid)
            raise
        gw.metrics.first_token(time.monotonic() - t0)
        if call.stream:
            return _stream(call, answer, rid, first, events)
        return await _whole(request, call, answer, rid, first, events)

    async def _first(request: Request, events: AsyncIterator[wire.ReplyEvent]) -> wire.ReplyEvent:
        gone, ev = await _or_disconnect(request, lambda: anext(events))
        if gone or ev is None:
            raise ApiError(499, "the client went away", code="client_closed")
        return ev

    async def _whole(
        request: Request, call: Call, answer: Answer, rid: str, first: wire.ReplyEvent,
        events: AsyncIterator[wire.ReplyEvent],
    ) -> Response:  # fmt: skip
        answer.add(first)

        async def rest() -> bool:
            async for ev in events:
                answer.add(ev)
            return True

        done = first.kind == "done"
        try:
            if not done:
                _, got = await _or_disconnect(request, rest)
                done = bool(got)
        finally:
            if not done:
                await gw.cancel(call, rid)
        if not done:
            raise ApiError(499, "the client went away", code="client_closed")
        gw.metrics.finished(call, answer.tokens)
        return JSONResponse(answer.whole())

    def _stream(
        call: Call, answer: Answer, rid: str, first: wire.ReplyEvent,
        events: AsyncIterator[wire.ReplyEvent],
    ) -> Response:  # fmt: skip
        lp = call.sampling.logprobs is not None

        async def body() -> AsyncIterator[bytes]:
            if call.chat:
                yield _sse(answer.chunk("", [], first=True))
            try:
                ev: wire.ReplyEvent | None = first
                while ev is not None:
                    text = answer.add(ev)
                    if ev.kind == "token" and (text or lp):
                        yield _sse(answer.chunk(text, [ev] if lp else []))
                    elif ev.kind == "done":
                        if text:
                            yield _sse(answer.chunk(text, []))
                        yield _sse(answer.chunk("", [], finish=answer.finish))
                        if call.include_usage:
                            yield _sse(answer.usage_chunk())
                        break
                    ev = await anext(events, None)
                resp.finished = True
                gw.metrics.finished(call, answer.tokens)
            except ApiError as exc:  # headers are sent: the error travels as an event
                gw.metrics.failed(exc.status)
                yield _sse(exc.body())
            yield b"data: [DONE]\n\n"

        async def abort() -> None:
            await gw.cancel(call, rid)
            gw.metrics.cancelled()

        resp = _Stream(body(), abort)
        return resp

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        gw.metrics.failed(exc.status)
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return JSONResponse(exc.body(), exc.status, headers=headers)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        msg = f"no endpoint {request.method} {request.url.path}"
        return JSONResponse(ApiError(status, msg, code="not_found").body(), status)

    async def bus_error(request: Request, exc: Exception) -> Response:
        gw.metrics.failed(503)
        err = ApiError(503, f"redis: {exc}", kind="server_error", code="bus_error")
        return JSONResponse(err.body(), 503, headers={"Retry-After": str(gw.s.retry_after_s)})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await close_async(gw.ar)  # its sockets go with the loop that opened them
        gw.board.r.close()

    cors = gw.s.cors_origins
    middleware = [Middleware(
        CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
        allow_headers=["authorization", "content-type"], max_age=600,
    )] if cors else []  # fmt: skip
    app = Starlette(
        lifespan=lifespan,
        middleware=middleware,
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={
            ApiError: api_error, 404: not_found, 405: not_found, redis.RedisError: bus_error,
        },
    )  # fmt: skip
    app.state.gateway = gw
    return app
