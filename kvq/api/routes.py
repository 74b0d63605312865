"""The endpoints of `kvq api`, one class per concern, each over the process's `Gateway`:

- `InfoRoutes`: `/health`, `/metrics`, `/v1/models`, `/v1/models/{id}`;
- `TokenRoutes`: vLLM's `/tokenize` and `/detokenize`;
- `CompletionRoutes`: `/v1/completions` and `/v1/chat/completions`, whole or streamed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvq import wire
from kvq.api import merged
from kvq.api.choices import Choices, fan_out, stream_chunks
from kvq.api.gateway import Gateway
from kvq.api.io import SseResponse, json_body, model_of, or_disconnect, read_body, sse
from kvq.api.metrics import Tracked
from kvq.api.params import Call, parse, parse_messages
from kvq.api.shape import Answer, models_list
from kvq.errors import ApiError

MAX_TOKEN_ID = 1 << 31  # above every vocabulary; the tokenizer says which ids below it exist


async def authorize(gw: Gateway, request: Request) -> None:
    """401/403 unless the call carries one of `KVQ_API_KEYS` (none set: every call passes)."""
    if gw.s.keys:  # no thread hop when auth is off
        await run_in_threadpool(gw.gate.authorize, request.headers.get("authorization"))


class InfoRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        ]

    async def health(self, request: Request) -> Response:
        ok = await run_in_threadpool(self.gw.gate.healthy)
        return JSONResponse({"ok": ok}, 200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.gw.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        await authorize(self.gw, request)
        return JSONResponse(models_list(await run_in_threadpool(self.gw.cards)))

    async def model(self, request: Request) -> Response:
        await authorize(self.gw, request)
        cards = await run_in_threadpool(self.gw.cards, request.path_params["model"])
        return JSONResponse(cards[0])


class TokenRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
        ]

    async def model(self, request: Request, body: dict[str, Any]) -> str:
        """The call's model; without one, the only model registered (as vLLM serves one:
        lm-eval's remote tokenizer names none)."""
        if body.get("model") is not None or request.query_params.get("model"):
            return model_of(body | {"model": body.get("model") or request.query_params["model"]})
        names = await run_in_threadpool(self.gw.gate.models)
        if len(names) != 1:
            raise ApiError(
                400, f"'model' is needed: {len(names)} models are registered", param="model"
            )
        return names[0]

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's `GET /tokenizer_info`: the tokenizer's special tokens, template and limits."""
        await authorize(self.gw, request)
        text = await run_in_threadpool(self.gw.text, await self.model(request, {}))
        tok = text.tokenizer
        return JSONResponse(
            {
                "tokenizer_class": type(tok).__name__,
                "bos_token": text.chat.bos_token or None,
                "eos_token": text.chat.eos_token or None,
                "pad_token": None,
                "bos_token_id": tok.bos_id,
                "eos_token_id": tok.eos_id,
                "add_bos_token": bool(getattr(tok, "add_bos", True)),
                "chat_template": text.chat.source,
                "model_max_length": text.context_length,
            }
        )

    async def tokenize(self, request: Request) -> Response:
        await authorize(self.gw, request)
        body = json_body(await read_body(request))
        text = await run_in_threadpool(self.gw.text, await self.model(request, body))
        special = body.get("add_special_tokens", True) is not False
        if body.get("messages") is not None:
            messages = parse_messages(body["messages"])
            ids = await run_in_threadpool(text.encode, None, messages, special)
        elif isinstance(body.get("prompt"), str):
            ids = await run_in_threadpool(text.encode, body["prompt"], None, special)
        else:
            raise ApiError(400, "'prompt' must be a string (or give 'messages')", param="prompt")
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": text.context_length,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        await authorize(self.gw, request)
        body = json_body(await read_body(request))
        text = await run_in_threadpool(self.gw.text, await self.model(request, body))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_TOKEN_ID for i in ids
        ):
            raise ApiError(
                400,
                f"'tokens' must be a list of token ids (integers in [0, {MAX_TOKEN_ID}))",
                param="tokens",
            )
        try:
            prompt = await run_in_threadpool(text.tokenizer.decode, ids)
        except (IndexError, KeyError, ValueError, OverflowError) as exc:
            raise ApiError(
                400, f"'tokens' holds an id outside the vocabulary: {exc}", param="tokens"
            ) from None
        return JSONResponse({"prompt": prompt})


class CompletionRoutes:
    """A call is checked, admitted and queued, then its reply events are read: the first one
    before any byte is sent (so an error still has a real status), the rest whole or as
    server-sent events. A client that goes away cancels its request."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, chat=True)

    async def complete(self, request: Request, chat: bool) -> Response:
        gw, t0 = self.gw, time.monotonic()
        await authorize(gw, request)
        call = parse(
            await read_body(request),
            chat=chat,
            max_tokens_default=gw.s.max_tokens_default,
            max_tokens_limit=gw.max_tokens_limit,
        )
        await run_in_threadpool(gw.gate.watch, call.model)  # 404 for an unknown model
        request.state.model = call.model  # known: errors are counted under it (`app.Errors`)
        track = gw.metrics.track(call.model, t0)
        try:
            call = await run_in_threadpool(gw.prepare, call)
            if not call.simple:
                return await self.several(request, call, t0, track)
            rid, entry = await run_in_threadpool(gw.gate.admit, call)
            answer = Answer(rid, call.model, chat, call.sampling.logprobs is not None)
            events = gw.events(call.model, rid, entry)
            try:
                first = await self.first(request, events)  # errors before any byte: a status
            except BaseException:
                await gw.cancel(call, rid)
                raise
            track.running()
            gw.metrics.first_token(time.monotonic() - t0)
            if call.stream:
                return self.stream(call, answer, rid, first, events, track)
            return await self.whole(request, call, answer, rid, first, events)
        finally:
            if not track.streaming:
                track.end()

    async def several(self, request: Request, call: Call, t0: float, track: Tracked) -> Response:
        """A call of several sequences (or whose text is read back at the end): all queued
        at once, answered when all are done; streamed, as chunks of the finished answer."""
        gw, calls = self.gw, fan_out(call)
        fmt = await run_in_threadpool(gw.tool_format, call.model) if call.tools else "hermes"
        admitted: list[tuple[Call, str, str]] = []
        answers: list[Answer] = []
        try:
            for c in calls:
                rid, entry = await run_in_threadpool(gw.gate.admit, c)
                admitted.append((c, rid, entry))
                answers.append(Answer(rid, c.model, c.chat, c.sampling.logprobs is not None))
            if merged.live(call):  # each choice's tokens as they come
                return await self.stream_several(request, call, admitted, answers, t0, track)

            async def run_all() -> bool:
                try:
                    async with anyio.create_task_group() as tg:
                        for (c, rid, entry), a in zip(admitted, answers, strict=True):
                            tg.start_soon(self._collect, c, rid, entry, a, track)
                except BaseExceptionGroup as group:  # the first failure is the answer
                    raise group.exceptions[0] from None
                return True

            gone, _ = await or_disconnect(request, run_all)
            if gone:
                raise ApiError(499, "the client went away", code="client_closed")
        except BaseException:
            for c, rid, _ in admitted:
                await gw.cancel(c, rid)
            raise
        gw.metrics.first_token(time.monotonic() - t0)
        choices = Choices(call, answers, fmt)
        gw.metrics.finished(call, choices.tokens, choices.prompt_tokens)
        whole = choices.whole()
        if not call.stream:
            return JSONResponse(whole)
        events = [sse(c) for c in stream_chunks(whole, call.chat, call.include_usage)]
        return Response(b"".join(events) + b"data: [DONE]\n\n", media_type="text/event-stream")

    async def stream_several(
        self,
        request: Request,
        call: Call,
        admitted: list[tuple[Call, str, str]],
        answers: list[Answer],
        t0: float,
        track: Tracked,
    ) -> Response:
        """Several choices streamed token by token (`merged`), once each has its first
        event (a refusal is still a real status)."""
        gw = self.gw
        events = [gw.events(c.model, rid, entry) for c, rid, entry in admitted]
        firsts = [await self.first(request, e) for e in events]
        track.running()
        gw.metrics.first_token(time.monotonic() - t0)
        track.streaming = True

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in merged.chunks(call, answers, firsts, events):
                    yield sse(chunk)
                resp.finished = True
                done = Choices(call, answers)
                gw.metrics.finished(call, done.tokens, done.prompt_tokens)
            except ApiError as exc:  # headers are sent: the error travels as an event
                gw.metrics.failed(exc.status, call.model)
                yield sse(exc.body())
            finally:
                track.end()
            yield b"data: [DONE]\n\n"

        async def abort() -> None:
            track.end()
            for c, rid, _ in admitted:
                await gw.cancel(c, rid)
            gw.metrics.cancelled()

        resp = SseResponse(body(), abort)
        return resp

    async def _collect(
        self, call: Call, rid: str, entry: str, answer: Answer, track: Tracked
    ) -> None:
        async for ev in self.gw.events(call.model, rid, entry):
            track.running()
            answer.add(ev)

    async def first(
        self, request: Request, events: AsyncIterator[wire.ReplyEvent]
    ) -> wire.ReplyEvent:
        gone, ev = await or_disconnect(request, lambda: anext(events))
        if gone or ev is None:
            raise ApiError(499, "the client went away", code="client_closed")
        return ev

    async def whole(
        self,
        request: Request,
        call: Call,
        answer: Answer,
        rid: str,
        first: wire.ReplyEvent,
        events: AsyncIterator[wire.ReplyEvent],
    ) -> Response:
        answer.add(first)

        async def rest() -> bool:
            async for ev in events:
                answer.add(ev)
            return True

        done = first.kind == "done"
        try:
            if not done:
                _, got = await or_disconnect(request, rest)
                done = bool(got)
        finally:
            if not done:
                await self.gw.cancel(call, rid)
        if not done:
            raise ApiError(499, "the client went away", code="client_closed")
        self.gw.metrics.finished(call, answer.tokens, answer.prompt_tokens)
        return JSONResponse(answer.whole())

    def stream(
        self,
        call: Call,
        answer: Answer,
        rid: str,
        first: wire.ReplyEvent,
        events: AsyncIterator[wire.ReplyEvent],
        track: Tracked,
    ) -> Response:
        gw, lp = self.gw, call.sampling.logprobs is not None
        track.streaming = True

        async def body() -> AsyncIterator[bytes]:
            if call.chat:
                yield sse(answer.chunk("", [], first=True))
            try:
                ev: wire.ReplyEvent | None = first
                while ev is not None:
                    text = answer.add(ev)
                    if ev.kind == "token" and (text or lp):
                        yield sse(answer.chunk(text, [ev] if lp else []))
                    elif ev.kind == "done":
                        if text:
                            yield sse(answer.chunk(text, []))
                        yield sse(answer.chunk("", [], finish=answer.finish))
                        if call.include_usage:
                            yield sse(answer.usage_chunk())
                        break
                    ev = await anext(events, None)
                resp.finished = True
                gw.metrics.finished(call, answer.tokens, answer.prompt_tokens)
            except ApiError as exc:  # headers are sent: the error travels as an event
                gw.metrics.failed(exc.status, call.model)
                yield sse(exc.body())
            finally:
                track.end()
            yield b"data: [DONE]\n\n"

        async def abort() -> None:
            track.end()
            await gw.cancel(call, rid)
            gw.metrics.cancelled()

        resp = SseResponse(body(), abort)
        return resp
