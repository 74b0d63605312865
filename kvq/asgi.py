"""Serving an ASGI app (Starlette) with uvicorn: in the foreground, or on a background thread.

`kvq api` runs in the foreground; the monitor runs its HTTP API on a thread next to its loop.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import uvicorn
from starlette.requests import Request

from kvq.errors import ServerError


async def capped_body(request: Request, limit: int, within_s: float | None = None) -> bytes | None:
    """The request's body, or None once it is over `limit` bytes: a declared Content-Length
    over it is refused before reading, and a chunked body (no length) is read only up to it.
    TimeoutError when it has not arrived whole within `within_s` (a chunk that declares more
    bytes than ever come, such as 2^64 - 1, would hold the connection otherwise)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                return None
        except ValueError:
            return None
    parts, size = [], 0
    with anyio.fail_after(within_s):
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            parts.append(chunk)
    return b"".join(parts)


def config(app: Any, host: str, port: int, loop: str = "asyncio") -> uvicorn.Config:
    # no uvicorn log config: kvq's logging (kvq.cli) decides what is printed; the lifespan
    # lets an app close its clients when the server stops. Plain asyncio: with uvloop,
    # `kvq bench api` measured 0.75-0.81 of direct tokens/s against 0.94-0.96 without
    # (8 streams, same machine, minutes apart)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
        loop=loop,
    )


class ThreadedServer:
    """uvicorn on a daemon thread; `server_address` once started, `shutdown()` to stop."""

    def __init__(self, app: Any, host: str, port: int, start_timeout_s: float = 10.0) -> None:
        self.server = uvicorn.Server(config(app, host, port))
        self.stopped = threading.Event()  # set by `shutdown`: companions of the server stop
        self.thread = threading.Thread(target=self.server.run, name="kvq-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ServerError(f"the HTTP server did not start on {host}:{port}")
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.server_address: tuple[str, int] = sock.getsockname()[:2]

    def shutdown(self) -> None:
        self.stopped.set()
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def server_close(self) -> None:
        """Kept for the callers of the former http.server API: `shutdown` closed it."""
