"""Client side: submit a generation request and stream its reply events (Redis only)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import redis

from kvq import wire
from kvq.bus import xadd
from kvq.bus.redis_board import is_registered
from kvq.errors import KvqError
from kvq.keys import Keys


class RequestFailed(KvqError):
    """The coordinator answered the request with an error event (`failure`, when it did)."""

    def __init__(self, message: str, failure: wire.Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


def send(
    r: redis.Redis, keys: Keys, model: str, *, prompt: str | None = None,
    prompt_ids: list[int] | None = None, max_tokens: int = 16, maxlen: int = 10_000,
    sampling: wire.SamplingParams | None = None, messages: list[wire.ChatMessage] | None = None,
    request_id: str | None = None,
) -> str:  # fmt: skip
    """Queue a request; returns its id (the reply stream is keyed by it). RequestFailed at
    once, before anything is queued, for `max_tokens < 1` or a model nobody registered.
    `messages`: a chat, rendered by the model's chat template (instead of `prompt`)."""
    if max_tokens < 1:
        raise RequestFailed(f"max_tokens must be at least 1, got {max_tokens}")
    if not is_registered(r, keys, model):
        raise RequestFailed(
            f"model {model!r} is not registered here (prefix {keys.prefix!r}); "
            "start a monitor with --model, or check KVQ_PREFIX"
        )
    request_id = request_id or uuid.uuid4().hex
    req = wire.Request(
        request_id=request_id, model=model, prompt=prompt, prompt_ids=prompt_ids,
        messages=messages, max_tokens=max_tokens, sampling=sampling or wire.SamplingParams(),
    )  # fmt: skip
    xadd(r, keys.model_requests(model), wire.encode(req), maxlen)
    return request_id


def cancel(r: redis.Redis, keys: Keys, model: str, request_id: str, maxlen: int = 1000) -> None:
    """Give up on a request: its coordinator drops it at its next step (or when it would
    admit it, if it is still queued)."""
    xadd(r, keys.model_cancels(model), wire.encode(wire.Cancel(request_id=request_id)), maxlen)


def events(
    r: redis.Redis, keys: Keys, request_id: str, timeout_s: float = 60.0
) -> Iterator[wire.ReplyEvent]:
    """Reply events of one request, in order, until `done` (or RequestFailed / TimeoutError)."""
    key = keys.request_reply(request_id)
    last = b"0-0"
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            raise TimeoutError(f"no complete reply for request {request_id} in {timeout_s}s")
        resp = r.xread({key: last}, count=256, block=min(left_ms, 1000))
        for _, entries in resp or []:
            for eid, fields in entries:
                last = eid
                ev = wire.decode(fields, wire.ReplyEvent)
                if ev.kind == "error":
                    msg = ev.error.message if ev.error else "unknown error"
                    raise RequestFailed(f"request {request_id} failed: {msg}", ev.error)
                yield ev
                if ev.kind == "done":
                    return


def generate(
    r: redis.Redis, keys: Keys, model: str, *, prompt: str | None = None,
    prompt_ids: list[int] | None = None, max_tokens: int = 16, timeout_s: float = 60.0,
) -> list[int]:  # fmt: skip
    """Submit and wait; the generated token ids."""
    rid = send(r, keys, model, prompt=prompt, prompt_ids=prompt_ids, max_tokens=max_tokens)
    return [ev.token_id for ev in events(r, keys, rid, timeout_s) if ev.token_id is not None]
