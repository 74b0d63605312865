"""The dashboard's actions (`POST /api/actions/{action}`): what `kvq cancel`, `kvq deadletter`
and `kvq workers` do, called through the same functions, behind an operator's token.

`KVQ_MONITOR_TOKENS` names the operators: `name=token` pairs, comma-separated. Without it the
dashboard is read-only and every action answers 403; with it, an action needs `Authorization:
Bearer <token>` (compared in constant time with every token), and is logged with the name of
the operator whose token it was and the caller's address.

| action             | body                                        | does                          |
|--------------------|---------------------------------------------|-------------------------------|
| cancel             | {"model", "request"}                        | `kvq.client.cancel`           |
| deadletter-requeue | {"ids": [dead-letter ids]}                  | `deadletters.requeue`         |
| deadletter-drop    | {"ids": [dead-letter ids]}                  | `deadletters.purge`           |
| quarantine         | {"worker", "model"?, "for_s"?, "ban"?}      | `kvq.bus.operator.quarantine` |
| release            | {"worker", "model"?}                        | `kvq.bus.operator.release`    |
| drain              | {"worker", "model"?}                        | `kvq.bus.operator.drain`      |
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from kvq import client
from kvq.bus import operator
from kvq.bus.deadletters import purge, requeue
from kvq.bus.redis_board import RedisBoard
from kvq.errors import ConfigError, HttpError
from kvq.keys import check_id
from kvq.settings_checks import operator_tokens

log = logging.getLogger("kvq.monitor.actions")

_DEAD_ID = re.compile(r"\d{1,20}-\d{1,20}")
MOST_IDS = 100  # dead letters one action names


def parse_tokens(text: str) -> dict[str, str]:
    """`KVQ_MONITOR_TOKENS` as token -> operator name (`kvq.settings_checks`)."""
    try:
        return operator_tokens(text)
    except ValueError as exc:
        raise ConfigError(f"KVQ_MONITOR_TOKENS: {exc}") from None


class Operators:
    """Who may act: the tokens of `KVQ_MONITOR_TOKENS`."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def who(self, authorization: str | None) -> str:
        """The operator whose bearer token this is; 403 without tokens, 401 for a wrong one."""
        if not self.tokens:
            raise HttpError(
                HTTPStatus.FORBIDDEN,
                "Forbidden",
                "the dashboard is read-only: the monitor has no KVQ_MONITOR_TOKENS",
            )
        scheme, _, given = (authorization or "").partition(" ")
        found = ""
        for token, name in self.tokens.items():  # every one compared: no early exit to time
            if hmac.compare_digest(given.strip().encode(), token.encode()):
                found = name
        if scheme.lower() != "bearer" or not found:
            raise HttpError(
                HTTPStatus.UNAUTHORIZED,
                "Unauthorized",
                "send 'Authorization: Bearer <an operator token of KVQ_MONITOR_TOKENS>'",
            )
        return found


def _bad(message: str) -> HttpError:
    return HttpError(HTTPStatus.BAD_REQUEST, "BadRequest", message)


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        d = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _bad("the body is not JSON") from None
    if not isinstance(d, dict):
        raise _bad("want a JSON object")
    return d


def _text(d: dict[str, Any], name: str, most: int = 512) -> str:
    v = d.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= most or not v.isprintable():
        raise _bad(f"{name!r} must be a non-empty printable string of at most {most} characters")
    return v


def _worker(d: dict[str, Any]) -> str:
    try:
        return check_id("'worker'", _text(d, "worker", 64))
    except ConfigError as exc:
        raise _bad(str(exc)) from None


def _models(d: dict[str, Any]) -> list[str] | None:
    return None if d.get("model") in (None, "") else [_text(d, "model")]


def _ids(d: dict[str, Any]) -> list[str]:
    ids = d.get("ids")
    if (
        not isinstance(ids, list)
        or not 0 < len(ids) <= MOST_IDS
        or not all(isinstance(i, str) and _DEAD_ID.fullmatch(i) for i in ids)
    ):
        raise _bad(f"'ids' must list 1 to {MOST_IDS} dead-letter ids (as 1700000000000-0)")
    return ids


def _for_s(d: dict[str, Any]) -> float:
    v = d.get("for_s", operator.QUARANTINE_S)
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 365 * 86400:
        raise _bad("'for_s' must be seconds in (0, 31536000]")
    return float(v)


Action = Callable[[RedisBoard, dict[str, Any], str], tuple[str, Any]]


def _cancel(board: RedisBoard, d: dict[str, Any], by: str) -> tuple[str, Any]:
    model, rid = _text(d, "model"), _text(d, "request")
    client.cancel(board.r, board.keys, model, rid)
    return f"request {rid} of {model}", {"cancelled": rid}


def _requeue(board: RedisBoard, d: dict[str, Any], by: str) -> tuple[str, Any]:
    ids = _ids(d)
    done = requeue(board.r, board.keys, ids, board.maxlen)
    return f"dead letters {', '.join(ids)}", [{"id": a, "requeued_as": b} for a, b in done]


def _drop(board: RedisBoard, d: dict[str, Any], by: str) -> tuple[str, Any]:
    ids = _ids(d)
    return f"dead letters {', '.join(ids)}", {"purged": purge(board.r, board.keys, ids)}


def _quarantine(board: RedisBoard, d: dict[str, Any], by: str) -> tuple[str, Any]:
    w, ban = _worker(d), d.get("ban") is True
    models = operator.quarantine(board, w, by, _models(d), _for_s(d), ban)
    return f"worker {w}", {"models": models}


def _release(board: RedisBoard, d: dict[str, Any], by: str) -> tuple[str, Any]:
    w = _worker(d)
    return f"worker {w}", {"models": operator.release(board, w, by, _models(d))}


def _drain(board: RedisBoard, d: dict[str, Any], by: str) -> tuple[str, Any]:
    w = _worker(d)
    return f"worker {w}", {"models": operator.drain(board, w, by, _models(d))}


ACTIONS: dict[str, Action] = {
    "cancel": _cancel,
    "deadletter-requeue": _requeue,
    "deadletter-drop": _drop,
    "quarantine": _quarantine,
    "release": _release,
    "drain": _drain,
}


def act(board: RedisBoard, name: str, body: bytes, by: str, peer: str) -> dict[str, Any]:
    """Run action `name` for operator `by` (already authenticated); logged with who and from
    where."""
    fn = ACTIONS.get(name)
    if fn is None:
        raise HttpError(HTTPStatus.NOT_FOUND, "NotFound", f"no action {name!r}: {sorted(ACTIONS)}")
    target, result = fn(board, parse_body(body), by)
    log.warning("operator %s (from %s): %s %s", by, peer, name, target)
    return {"action": name, "by": by, "result": result}
