"""The monitor's HTTP API (K13) and Prometheus endpoint (D7): Starlette, served by uvicorn on a
background thread (`kvq.asgi`).

| method | path                     | answer                                                   |
|--------|--------------------------|----------------------------------------------------------|
| GET    | /api/moe/recruitment     | per model: busy, total, saturated, base vs effective     |
| GET    | /api/expert-demand       | per model and slice: target, coverage, demand, recruiting|
| POST   | /api/expert-volunteer    | `{"worker", "model"?, "held"?, "room"?}` → a slice to    |
|        |                          | fetch, or 204; the                                       |
|        |                          | worker's ACL password as bearer (KVQ_HTTP_VOLUNTEER)     |
| GET    | /api/trust               | per model: quarantined and banned workers                |
| GET    | /metrics                 | Prometheus text, read from Redis on each scrape          |
| GET    | /healthz                 | 200 while Redis answers PING, else 503                   |
| GET    | /                        | the live dashboard (HTML; assets under /static/)         |
| GET    | /api/dashboard           | what the dashboard draws, one JSON snapshot; `?range=`   |
|        |                          | seconds or `all`: how far back its charts look           |
| GET    | /worker/{id}             | one worker's page (HTML); its data: /api/worker/{id}     |
|        |                          | (`?range=` as above)                                     |
| GET    | /api/operator            | whether actions are on; with a bearer token, whose it is |
| POST   | /api/actions/{action}    | an operator's action (`kvq.monitor.actions`): cancel, a  |
|        |                          | dead letter requeued or dropped, a worker quarantined,   |
|        |                          | released or drained; bearer token of KVQ_MONITOR_TOKENS  |

Every answer is read from Redis (`docs/api.md`); errors travel as `{type, message, retryable}`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import msgspec
import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvq.asgi import ThreadedServer, capped_body
from kvq.bus.records import ModelState
from kvq.bus.redis_board import RedisBoard
from kvq.errors import ConfigError, HttpError
from kvq.keys import check_id
from kvq.monitor.actions import Operators, act, parse_tokens
from kvq.monitor.dashboard import Dashboard
from kvq.monitor.history import HISTORY_S, WINDOW_S
from kvq.monitor.metrics import make_registry
from kvq.monitor.worker_page import worker_page
from kvq.security import acl

log = logging.getLogger("kvq.monitor.http")
MAX_BODY = 64 * 1024


class Api:
    """What the endpoints answer, as plain data; the handler only moves bytes."""

    def __init__(
        self,
        board: RedisBoard,
        volunteer: str = "acl",
        operators: Operators | None = None,
        history_s: float = HISTORY_S,
    ) -> None:
        self.board = board
        self.operators = operators if operators is not None else Operators({})
        self.registry = make_registry(board)
        self.volunteer_mode = volunteer  # KVQ_HTTP_VOLUNTEER
        self.dashboard = Dashboard(board, self.registry, history_s)  # KVQ_MONITOR_HISTORY_S

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
                {
                    "slice": sid,
                    "target": d.target,
                    "coverage": d.coverage,
                    "demand": d.demand,
                    "recruiting": d.recruiting,
                }
                for sid, d in self.board.slice_demand(m).items()
            ]
            recruiting = any(s["recruiting"] for s in slices)
            out.append({"model": m, "recruiting": recruiting, "slices": slices})
        return {"models": out}

    def trust(self) -> dict[str, Any]:
        """Coordinators' verdicts on workers caught with wrong results; `quarantined` while
        its quarantine runs (or banned)."""
        now_ms = self.board.now_ms()
        out = []
        for m in self.board.models():
            workers = [
                {"worker": w, "quarantined": q.active(now_ms)} | msgspec.structs.asdict(q)
                for w, q in self.board.quarantined(m).items()
            ]
            out.append({"model": m, "workers": workers})
        return {"models": out}

    def volunteer(self, body: bytes, authorization: str | None = None) -> dict[str, Any] | None:
        """Hand `worker` a slice through the workers' own atomic script; None: no demand.
        Bound to the worker's identity unless KVQ_HTTP_VOLUNTEER=open (`check_caller`)."""
        ask = _parse_volunteer(body)
        worker, model = ask.worker, ask.model
        self.check_caller(worker, authorization)
        models = self.board.models()
        if model is not None and model not in models:
            raise HttpError(HTTPStatus.NOT_FOUND, "UnknownModel", f"model {model!r} not registered")
        for m in [model] if model is not None else models:
            sid = self.board.volunteer(m, worker, ask.room, ask.held.get(m, ()))
            info = self.board.model_info(m) if sid is not None else None
            if sid is None or info is None:
                continue
            spec = info.slices[sid].to_dict()
            return {
                "model": m,
                "slice": sid,
                "source": info.source,
                "bytes": spec["bytes"],
                "ranges": spec["ranges"],
            }
        return None

    def check_caller(self, worker: str, authorization: str | None) -> None:
        """In `acl` mode the caller must hold `worker`'s `kvq acl` user: its password as a
        bearer token, proven by an AUTH as that user (no secret is kept here)."""
        if self.volunteer_mode == "open":
            return
        if self.volunteer_mode == "off":
            raise HttpError(
                HTTPStatus.FORBIDDEN,
                "Forbidden",
                "volunteering over HTTP is off (KVQ_HTTP_VOLUNTEER=off)",
            )
        scheme, _, token = (authorization or "").partition(" ")
        user = acl.user_name(self.board.keys.prefix, "worker", worker)
        pool = acl.node_pool(self.board.r)  # on a cluster: any node (users are on all)
        kwargs = pool.connection_kwargs | {"username": user, "password": token.strip()}
        probe = pool.connection_class(**kwargs)  # connecting logs in as `user`
        try:
            if scheme.lower() != "bearer" or not token.strip():
                raise redis.AuthenticationError("no bearer token")
            probe.connect()
        except (redis.AuthenticationError, redis.ResponseError):
            raise HttpError(
                HTTPStatus.UNAUTHORIZED,
                "Unauthorized",
                f"send 'Authorization: Bearer <password of ACL user {user}>' (kvq acl)",
            ) from None
        finally:
            probe.disconnect()

    def healthy(self) -> bool:
        try:
            return bool(self.board.r.ping())
        except redis.RedisError:
            return False

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class _Ask:
    """A `POST /api/expert-volunteer` body: who asks, for which model (None: any), what it
    already holds (model -> slice ids) and how many bytes it can still take (None: any)."""

    worker: str
    model: str | None
    held: dict[str, tuple[str, ...]]
    room: int | None


def _bad(message: str) -> HttpError:
    return HttpError(HTTPStatus.BAD_REQUEST, "BadRequest", message)


def _parse_volunteer(body: bytes) -> _Ask:
    try:
        d = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, "BadRequest", f"body is not JSON: {exc}") from None
    except RecursionError:
        raise _bad("the body is nested too deeply") from None
    if not isinstance(d, dict):
        raise HttpError(HTTPStatus.BAD_REQUEST, "BadRequest", 'want a JSON object {"worker": id}')
    worker, model = d.get("worker"), d.get("model")
    if not isinstance(worker, str):
        raise _bad(f"'worker' must be a worker id, got {_short(worker)}")
    try:
        check_id("'worker'", worker)
    except ConfigError as exc:
        raise _bad(str(exc)) from None
    if model is not None and (not isinstance(model, str) or not _printable(model, 512)):
        raise _bad(f"'model' must be an id, got {_short(model)}")
    held, room = d.get("held") or {}, d.get("room")
    if (
        not isinstance(held, dict)
        or len(held) > 64
        or not all(
            _printable(m, 512)
            and isinstance(sids, list)
            and len(sids) <= 4096
            and all(isinstance(x, str) and _printable(x, 64) for x in sids)
            for m, sids in held.items()
        )
    ):
        raise _bad(f"'held' must map model ids to lists of slice ids, got {_short(held)}")
    if room is not None and (
        isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63
    ):
        raise _bad(f"'room' must be a number of bytes >= 0 or null, got {room!r}")
    return _Ask(worker, model, {m: tuple(sids) for m, sids in held.items()}, room)


def _printable(v: object, most: int) -> bool:
    """A non-empty printable string of at most `most` characters, valid Unicode (no lone
    surrogate)."""
    if not isinstance(v, str) or not 0 < len(v) <= most or not v.isprintable():
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(v: object) -> str:
    """`v` as an error message may quote it: at most 80 characters of its repr."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _error(status: int, kind: str, message: str, retryable: bool) -> JSONResponse:
    return JSONResponse({"type": kind, "message": message, "retryable": retryable}, int(status))


STATIC = Path(__file__).with_name("static")
STATIC_TYPES = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "worker.html": "text/html",
    "worker.js": "text/javascript",
    "charts.js": "text/javascript",
}


def _static(name: str) -> Response:
    """A dashboard file shipped in the package (no CDN: the page works offline)."""
    body = (STATIC / name).read_bytes()
    return Response(body, media_type=STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})


def create_app(api: Api) -> Starlette:
    """The monitor's endpoints as a Starlette app (sync handlers: they run in a thread pool)."""
    return Starlette(
        routes=[
            *_api_routes(api),
            *_dashboard_routes(api),
            _volunteer_route(api),
            *_action_routes(api),
        ],
        exception_handlers={
            HttpError: _api_error,
            404: _not_found,
            405: _not_found,
            redis.RedisError: _bus_error,
            Exception: _other,
        },
    )


def _api_routes(api: Api) -> list[Route]:
    """The read-only JSON and Prometheus endpoints."""

    def metrics(request: Request) -> Response:
        return Response(api.metrics(), media_type=CONTENT_TYPE_LATEST)

    def healthz(request: Request) -> Response:
        ok = api.healthy()
        return JSONResponse({"ok": ok}, 200 if ok else 503)

    def recruitment(request: Request) -> Response:
        return JSONResponse(api.recruitment())

    def demand(request: Request) -> Response:
        return JSONResponse(api.demand())

    def trust(request: Request) -> Response:
        return JSONResponse(api.trust())

    return [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/api/moe/recruitment", recruitment, methods=["GET"]),
        Route("/api/expert-demand", demand, methods=["GET"]),
        Route("/api/trust", trust, methods=["GET"]),
    ]


def _open_spans(text: str) -> dict[str, set[int]]:
    """`?open=M:L,M:L`: the layer spans (by first layer) of each model whose cells the page
    shows; anything else in it is ignored (at most 64 spans)."""
    out: dict[str, set[int]] = {}
    for part in text.split(",")[:64]:
        model, _, layer = part.rpartition(":")
        if model and layer.isdigit():
            out.setdefault(model, set()).add(int(layer))
    return out


def _range_s(request: Request, kept_s: float) -> float:
    """`?range=`: seconds of history the charts show, `all` (everything kept), or absent
    (the last WINDOW_S); more than is kept shows what is kept."""
    text = request.query_params.get("range", "").strip()
    if text == "all":
        return kept_s
    if not text:
        return WINDOW_S
    try:
        got = float(text)
    except ValueError:
        got = math.nan
    if not math.isfinite(got) or got <= 0:
        raise _bad(f"'range' must be a number of seconds > 0 or 'all', got {_short(text)}")
    return min(got, kept_s)


def _dashboard_routes(api: Api) -> list[Route]:
    """The dashboard's snapshot, its page and the page's assets."""
    kept_s = api.dashboard.history.keep_s

    def dashboard(request: Request) -> Response:
        snap = api.dashboard.snapshot(
            _open_spans(request.query_params.get("open", "")), _range_s(request, kept_s)
        )
        return JSONResponse(snap, headers={"Cache-Control": "no-store"})

    def page(request: Request) -> Response:
        return _static("index.html")

    def worker_html(request: Request) -> Response:
        return _static("worker.html")

    def worker(request: Request) -> Response:
        w = request.path_params["worker"]
        range_s = _range_s(request, kept_s)
        got = None
        try:
            got = worker_page(api.board, api.dashboard.history, check_id("worker", w), range_s)
        except ConfigError:
            pass  # no such id can exist
        if got is None:
            raise HttpError(HTTPStatus.NOT_FOUND, "NotFound", f"no worker {w!r}")
        return JSONResponse(got, headers={"Cache-Control": "no-store"})

    def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC_TYPES:  # only the package's own files, by name
            raise HttpError(HTTPStatus.NOT_FOUND, "NotFound", f"no asset {name!r}")
        return _static(name)

    return [
        Route("/api/dashboard", dashboard, methods=["GET"]),
        Route("/", page, methods=["GET"]),
        Route("/worker/{worker}", worker_html, methods=["GET"]),
        Route("/api/worker/{worker}", worker, methods=["GET"]),
        Route("/static/{name}", asset, methods=["GET"]),
    ]


def _volunteer_route(api: Api) -> Route:
    """`POST /api/expert-volunteer`: the body capped, then handed to `Api.volunteer`."""

    async def volunteer(request: Request) -> Response:
        body = await capped_body(request, MAX_BODY)
        if body is None:  # a declared length over the cap, or a chunked body that ran past it
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "BadRequest",
                f"the body is over {MAX_BODY} bytes",
            )
        got = await run_in_threadpool(api.volunteer, body, request.headers.get("authorization"))
        if got is None:
            return Response(b"", 204, media_type="application/json")
        return JSONResponse(got)

    return Route("/api/expert-volunteer", volunteer, methods=["POST"])


def _action_routes(api: Api) -> list[Route]:
    """`GET /api/operator` (the page's login check) and `POST /api/actions/{action}`."""

    def whoami(request: Request) -> Response:
        auth = request.headers.get("authorization")
        who = api.operators.who(auth) if auth and api.operators.enabled else None
        return JSONResponse({"actions": api.operators.enabled, "who": who})

    async def action(request: Request) -> Response:
        who = api.operators.who(request.headers.get("authorization"))  # before the body
        body = await capped_body(request, MAX_BODY)
        if body is None:
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "BadRequest",
                f"the body is over {MAX_BODY} bytes",
            )
        peer = request.client.host if request.client else "?"
        name = request.path_params["action"]
        return JSONResponse(await run_in_threadpool(act, api.board, name, body, who, peer))

    return [
        Route("/api/operator", whoami, methods=["GET"]),
        Route("/api/actions/{action}", action, methods=["POST"]),
    ]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    return _error(exc.status, exc.kind, str(exc), exc.retryable)


async def _not_found(request: Request, exc: Exception) -> Response:
    msg = f"no endpoint {request.method} {request.url.path}"
    return _error(HTTPStatus.NOT_FOUND, "NotFound", msg, False)


async def _bus_error(request: Request, exc: Exception) -> Response:
    return _error(HTTPStatus.SERVICE_UNAVAILABLE, "BusError", f"redis: {exc}", True)


async def _other(request: Request, exc: Exception) -> Response:
    # one bad request must not take the monitor down
    log.error("%s %s failed: %r", request.method, request.url.path, exc)
    return _error(HTTPStatus.INTERNAL_SERVER_ERROR, type(exc).__name__, str(exc), False)


def serve_api(
    board: RedisBoard,
    host: str,
    port: int,
    volunteer: str = "acl",
    tokens: str = "",
    history_s: float = HISTORY_S,
) -> tuple[ThreadedServer, threading.Thread]:
    """Serve the API on `host:port` (0 = an ephemeral port; read `server.server_address`);
    `tokens`: `KVQ_MONITOR_TOKENS` (empty: a read-only dashboard); `history_s`:
    `KVQ_MONITOR_HISTORY_S` (how far back the charts can look).

    Stop with `server.shutdown()`.
    """
    api = Api(board, volunteer, Operators(parse_tokens(tokens)), history_s)
    server = ThreadedServer(create_app(api), host, port)
    sampler = threading.Thread(
        target=api.dashboard.history.run, args=(server.stopped,), name="kvq-dashboard", daemon=True
    )
    sampler.start()
    return server, server.thread
