"""The monitor's HTTP API (K13) and Prometheus endpoint (D7), on a background thread.

| method | path                     | answer                                                   |
|--------|--------------------------|----------------------------------------------------------|
| GET    | /api/moe/recruitment     | per model: busy, total, saturated, base vs effective     |
| GET    | /api/expert-demand       | per model and slice: target, coverage, demand, recruiting|
| POST   | /api/expert-volunteer    | `{"worker", "model"?}` → a slice to fetch, or 204        |
| GET    | /metrics                 | Prometheus text, read from Redis on each scrape          |
| GET    | /healthz                 | 200 while Redis answers PING, else 503                   |

Every answer is read from Redis (`docs/api.md`); errors travel as `{type, message, retryable}`.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvq.bus.records import ModelState
from kvq.bus.redis_board import RedisBoard
from kvq.monitor.metrics import make_registry

log = logging.getLogger("kvq.monitor.http")
MAX_BODY = 64 * 1024


class ApiError(Exception):
    """An answer other than 2xx, sent as `{type, message, retryable}`."""

    def __init__(
        self, status: HTTPStatus, kind: str, message: str, retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.retryable = status, kind, retryable


class Api:
    """What the endpoints answer, as plain data; the handler only moves bytes."""

    def __init__(self, board: RedisBoard) -> None:
        self.board = board
        self.registry = make_registry(board)

    def recruitment(self) -> dict[str, Any]:
        out = []
        for m in self.board.models():
            st = self.board.model_state(m) or ModelState()
            out.append({"model": m} | st.public())
        return {"models": out}

    def demand(self) -> dict[str, Any]:
        out = []
        for m in self.board.models():
            slices = [
                {"slice": sid, "target": d.target, "coverage": d.coverage, "demand": d.demand,
                 "recruiting": d.recruiting}
                for sid, d in self.board.slice_demand(m).items()
            ]  # fmt: skip
            recruiting = any(s["recruiting"] for s in slices)
            out.append({"model": m, "recruiting": recruiting, "slices": slices})
        return {"models": out}

    def volunteer(self, body: bytes) -> dict[str, Any] | None:
        """Hand `worker` a slice through the workers' own atomic script; None: no demand."""
        worker, model = _parse_volunteer(body)
        models = self.board.models()
        if model is not None and model not in models:
            raise ApiError(HTTPStatus.NOT_FOUND, "UnknownModel", f"model {model!r} not registered")
        for m in [model] if model is not None else models:
            sid = self.board.volunteer(m, worker)
            info = self.board.model_info(m) if sid is not None else None
            if sid is None or info is None:
                continue
            spec = info.slices[sid].to_dict()
            return {
                "model": m, "slice": sid, "source": info.source,
                "bytes": spec["bytes"], "ranges": spec["ranges"],
            }  # fmt: skip
        return None

    def healthy(self) -> bool:
        try:
            return bool(self.board.r.ping())
        except redis.RedisError:
            return False

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


def _parse_volunteer(body: bytes) -> tuple[str, str | None]:
    try:
        d = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, "BadRequest", f"body is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "BadRequest", 'want a JSON object {"worker": id}')
    worker, model = d.get("worker"), d.get("model")
    if not isinstance(worker, str) or not 0 < len(worker) <= 200 or worker.strip() != worker:
        raise ApiError(
            HTTPStatus.BAD_REQUEST, "BadRequest",
            f"'worker' must be a non-empty id of at most 200 characters, got {worker!r}",
        )  # fmt: skip
    if model is not None and (not isinstance(model, str) or not model):
        raise ApiError(
            HTTPStatus.BAD_REQUEST, "BadRequest", f"'model' must be an id, got {model!r}"
        )
    return worker, model


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], api: Api) -> None:
        super().__init__(address, _Handler)
        self.api = api


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "kvq-monitor"

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        api = self.server.api
        path = self.path.split("?", 1)[0]
        try:
            if (method, path) == ("GET", "/metrics"):
                self._send(HTTPStatus.OK, api.metrics(), CONTENT_TYPE_LATEST)
            elif (method, path) == ("GET", "/healthz"):
                ok = api.healthy()
                self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, {"ok": ok})
            elif (method, path) == ("GET", "/api/moe/recruitment"):
                self._json(HTTPStatus.OK, api.recruitment())
            elif (method, path) == ("GET", "/api/expert-demand"):
                self._json(HTTPStatus.OK, api.demand())
            elif (method, path) == ("POST", "/api/expert-volunteer"):
                got = api.volunteer(self._body())
                if got is None:
                    self._send(HTTPStatus.NO_CONTENT, b"", "application/json")
                else:
                    self._json(HTTPStatus.OK, got)
            else:
                raise ApiError(HTTPStatus.NOT_FOUND, "NotFound", f"no endpoint {method} {path}")
        except ApiError as exc:
            self._error(exc.status, exc.kind, str(exc), exc.retryable)
        except redis.RedisError as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "BusError", f"redis: {exc}", True)
        except Exception as exc:  # one bad request must not take the monitor down
            log.exception("%s %s failed", method, path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, type(exc).__name__, str(exc), False)

    def _body(self) -> bytes:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY:
            raise ApiError(
                HTTPStatus.BAD_REQUEST, "BadRequest", f"body length must be 0..{MAX_BODY}"
            )
        return self.rfile.read(n)

    def _json(self, status: HTTPStatus, obj: object) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: HTTPStatus, kind: str, message: str, retryable: bool) -> None:
        self._json(status, {"type": kind, "message": message, "retryable": retryable})

    def _send(self, status: HTTPStatus, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def serve_api(
    board: RedisBoard, host: str, port: int
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve the API on `host:port` (0 = an ephemeral port; read `server.server_address`).

    Stop with `server.shutdown(); server.server_close()`.
    """
    server = _Server((host, port), Api(board))
    thread = threading.Thread(target=server.serve_forever, name="kvq-http", daemon=True)
    thread.start()
    return server, thread
