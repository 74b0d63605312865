"""What every route of `kvq api` does with a request and a response: the capped body, its JSON,
server-sent events that cancel their request when cut short, and waiting on something unless
the client goes away first."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvq.api.params import json_object
from kvq.asgi import capped_body
from kvq.errors import ApiError

MAX_BODY = 1 << 20
BODY_WITHIN_S = 30.0  # a body not whole by then is answered 408 (its connection freed)
T = TypeVar("T")


async def read_body(request: Request) -> bytes:
    """The body, at most MAX_BODY bytes (chunked bodies too), else 413; 408 when it has not
    arrived whole within BODY_WITHIN_S."""
    try:
        raw = await capped_body(request, MAX_BODY, BODY_WITHIN_S)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive whole within {BODY_WITHIN_S:g}s") from None
    if raw is None:
        raise ApiError(413, f"the body is over {MAX_BODY} bytes")
    return raw


def json_body(raw: bytes) -> dict[str, Any]:
    return json_object(raw)


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, f"'model' must be a model id, got {model!r}", param="model")
    return model


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SseResponse(StreamingResponse):
    """An SSE response that cancels its request if it ends before its last event (the client
    went away, the server is stopping)."""

    def __init__(self, body: AsyncIterator[bytes], abort: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.abort, self.finished = abort, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Streams the body while watching for the client's disconnect: a client gone while
        no event is due (a queued request, a long prefill) cancels its request at once, and
        one gone before its last event never goes unnoticed (a server may drop the writes to
        a closed connection without failing them)."""
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    await super(SseResponse, self).__call__(scope, receive, send)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            if not self.finished:
                await self.abort()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def or_disconnect(request: Request, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
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
