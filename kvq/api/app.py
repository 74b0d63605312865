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
from collections.abc import AsyncIterator

import redis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvq.api.gateway import Gateway
from kvq.api.routes import CompletionRoutes, InfoRoutes, TokenRoutes
from kvq.bus.connection import close_async
from kvq.bus.outage import refusal
from kvq.config import Settings
from kvq.errors import ApiError


def create_app(settings: Settings) -> Starlette:
    """The gateway's app; every answer is read from Redis at call time."""
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await close_async(gw.ar)  # its sockets go with the loop that opened them
        gw.board.r.close()

    cors = gw.s.cors_origins
    middleware = (
        [
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
                max_age=600,
            )
        ]
        if cors
        else []
    )
    errors = Errors(gw)
    app = Starlette(
        lifespan=lifespan,
        middleware=middleware,
        routes=[
            *InfoRoutes(gw).routes(),
            *TokenRoutes(gw).routes(),
            *CompletionRoutes(gw).routes(),
        ],
        exception_handlers={
            ApiError: errors.api_error,
            404: errors.not_found,
            405: errors.not_found,
            redis.RedisError: errors.bus_error,
        },
    )
    app.state.gateway = gw
    return app


class Errors:
    """Every error answer in OpenAI's shape, counted in the gateway's metrics."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        self.gw.metrics.failed(exc.status, getattr(request.state, "model", ""))
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return JSONResponse(exc.body(), exc.status, headers=headers)

    async def not_found(self, request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        msg = f"no endpoint {request.method} {request.url.path}"
        return JSONResponse(ApiError(status, msg, code="not_found").body(), status)

    async def bus_error(self, request: Request, exc: Exception) -> Response:
        self.gw.metrics.failed(503, getattr(request.state, "model", ""))
        code = refusal(exc)
        err = ApiError(503, f"redis: {exc}", kind="server_error", code="bus_error")
        if code is not None:  # the operator frees memory or disk (docs/faults.md)
            err = ApiError(
                503,
                f"redis refuses writes ({code}: {exc}); retry later",
                kind="server_error",
                code="WritesRefused",
            )
        return JSONResponse(err.body(), 503, headers={"Retry-After": str(self.gw.s.retry_after_s)})
