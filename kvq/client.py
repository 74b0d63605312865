"""Client side: submit a generation request and stream its reply events (Redis only)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import redis

from kvq import wire
from kvq.bus import xadd
from kvq.bus.redis_board import request_shards
from kvq.errors import KvqError
from kvq.keys import Keys, request_shard


class RequestFailed(KvqError):
    """The coordinator answered the request with an error event (`failure`, when it did)."""

    def __init__(self, message: str, failure: wire.Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class Submitted(NamedTuple):
    """A queued request: its id (which keys its reply stream) and its request stream entry."""

    request_id: str
    entry: str


class ReplyFilter:
    """Which reply events of a request its reader should see, so that it sees each token
    once, in order, from one request:

    - an event for another request entry that reuses the id (`entry` differs) is not ours;
    - an event of an earlier run (`attempt` lower than one seen) comes from a coordinator
      that lost the request to another and has not noticed yet;
    - a token at an index already delivered is a replay.
    """

    def __init__(self, entry: str | None = None) -> None:
        self.entry, self.attempt, self.next_index = entry, 0, 0

    def accept(self, ev: wire.ReplyEvent) -> bool:
        if self.entry and ev.entry and ev.entry != self.entry:
            return False
        if ev.attempt < self.attempt:
            return False
        self.attempt = ev.attempt
        if ev.kind == "token":
            if ev.index < self.next_index:
                return False
            self.next_index = ev.index + 1
        return True


def send(
    r: redis.Redis, keys: Keys, model: str, *, prompt: str | None = None,
    prompt_ids: list[int] | None = None, max_tokens: int = 16, maxlen: int = 10_000,
    sampling: wire.SamplingParams | None = None, messages: list[wire.ChatMessage] | None = None,
    request_id: str | None = None,
) -> str:  # fmt: skip
    """Queue a request; returns its id (see `submit`)."""
    return submit(
        r, keys, model, prompt=prompt, prompt_ids=prompt_ids, max_tokens=max_tokens,
        maxlen=maxlen, sampling=sampling, messages=messages, request_id=request_id,
    ).request_id  # fmt: skip


def submit(
    r: redis.Redis, keys: Keys, model: str, *, prompt: str | None = None,
    prompt_ids: list[int] | None = None, max_tokens: int = 16, maxlen: int = 10_000,
    sampling: wire.SamplingParams | None = None, messages: list[wire.ChatMessage] | None = None,
    request_id: str | None = None,
) -> Submitted:  # fmt: skip
    """Queue a request (a fresh id unless `request_id` is given; ids must be unique: a reused
    one is refused with an error event). RequestFailed at once, before anything is queued, for
    `max_tokens < 1`, a model nobody registered, or `maxlen` requests already queued. `messages`: a chat, rendered by the model's
    chat template (instead of `prompt`)."""
    if max_tokens < 1:
        raise RequestFailed(f"max_tokens must be at least 1, got {max_tokens}")
    shards = request_shards(r, keys, model)
    if shards is None:
        raise RequestFailed(
            f"model {model!r} is not registered here (prefix {keys.prefix!r}); "
            "start a monitor with --model, or check KVQ_PREFIX"
        )
    request_id = request_id or uuid.uuid4().hex
    req = wire.Request(
        request_id=request_id, model=model, prompt=prompt, prompt_ids=prompt_ids,
        messages=messages, max_tokens=max_tokens, sampling=sampling or wire.SamplingParams(),
    )  # fmt: skip
    stream = keys.model_requests(model, request_shard(request_id, shards))
    queued = r.xlen(stream)
    if queued >= maxlen:
        raise RequestFailed(
            f"model {model!r} has {queued} requests queued on {stream}, the cap ({maxlen}, "
            "KVQ_STREAM_MAXLEN per request stream); retry later"
        )
    # never trimmed: trimming would drop queued requests without an answer
    entry = xadd(r, stream, wire.encode(req), None)
    return Submitted(request_id, entry.decode() if isinstance(entry, bytes) else str(entry))


def cancel(r: redis.Redis, keys: Keys, model: str, request_id: str, maxlen: int = 1000) -> None:
    """Give up on a request: its coordinator drops it at its next step (or when it would
    admit it, if it is still queued)."""
    xadd(r, keys.model_cancels(model), wire.encode(wire.Cancel(request_id=request_id)), maxlen)


def events(
    r: redis.Redis, keys: Keys, request_id: str, timeout_s: float = 60.0,
    entry: str | None = None,
) -> Iterator[wire.ReplyEvent]:  # fmt: skip
    """Reply events of one request, in order, until `done` (or RequestFailed / TimeoutError):
    each token once, also across a coordinator restart or takeover (`ReplyFilter`). `entry`
    (from `submit`) ignores events of another request that reused the id."""
    key = keys.request_reply(request_id)
    seen = ReplyFilter(entry)
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
                if not seen.accept(ev):
                    continue
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
    rid, entry = submit(r, keys, model, prompt=prompt, prompt_ids=prompt_ids, max_tokens=max_tokens)
    got = events(r, keys, rid, timeout_s, entry)
    return [ev.token_id for ev in got if ev.token_id is not None]
