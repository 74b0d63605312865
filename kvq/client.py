"""Client side: submit a generation request and stream its reply events (Redis only)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

import redis

from kvq import wire
from kvq.bus import cancel_keys, is_connection_error, xadd
from kvq.bus.outage import refusal
from kvq.bus.redis_board import request_shards
from kvq.bus.streams import is_lost_key
from kvq.errors import KvqError
from kvq.keys import COORDINATOR_GROUP, Keys, request_shard


class RequestFailed(KvqError):
    """The coordinator answered the request with an error event (`failure`, when it did)."""

    def __init__(self, message: str, failure: wire.Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


LOST_AFTER_S = 5.0  # silence after which `events` asks whether its request still exists


class RequestId(str):
    """A request id as `send` and `submit` return it: the id itself (a `str`), carrying where
    the request was queued, its request stream and entry. `events` reads both from it: the
    entry tells this request's events, and its refusal, from those of another request that
    reused the id; the stream tells a request Redis lost from one still waiting. The wire
    codec encodes no `str` subclass: `str(rid)` is the plain id (`cancel` and `submit` take
    either)."""

    entry: str
    stream: str

    def __new__(cls, request_id: str, entry: str = "", stream: str = "") -> RequestId:
        self = super().__new__(cls, request_id)
        self.entry, self.stream = entry, stream
        return self


class Submitted(NamedTuple):
    """A queued request: its id (which keys its reply stream; a `RequestId` from `submit`)
    and its request stream entry."""

    request_id: str
    entry: str


class ReplyFilter:
    """Which reply events of a request its reader should see, so that it sees each token
    once, in order, from one request:

    - an event for another request entry that reuses the id (`entry` differs) is not ours;
    - an event of an earlier run (`attempt` lower than one seen) comes from a coordinator
      that lost the request to another and has not noticed yet;
    - a token at an index already delivered is a replay.

    Without `entry` it takes the entry of the first token or `done` it sees (only the entry
    that owns the id is served), so a refusal of a later duplicate is not taken for its own.
    """

    def __init__(self, entry: str | None = None) -> None:
        self.entry, self.attempt, self.next_index = entry, 0, 0

    def accept(self, ev: wire.ReplyEvent) -> bool:
        if self.entry and ev.entry and ev.entry != self.entry:
            return False
        if not self.entry and ev.entry and ev.kind != "error":
            self.entry = ev.entry
        if ev.attempt < self.attempt:
            return False
        self.attempt = ev.attempt
        if ev.kind == "token":
            if ev.index < self.next_index:
                return False
            self.next_index = ev.index + 1
        return True


class ReplyReader:
    """A request's reply events as its reader must see them, without I/O (the blocking
    `events` and the API's async gateway both feed it the entries they read): `take` gives
    each token once, in order (`ReplyFilter`), None for an event that is not the reader's,
    and raises RequestFailed for an error event, or for tokens that vanished from the
    stream before a later one (a gap: Redis lost them; failure type `Lost`, retryable)."""

    def __init__(self, request_id: str, entry: str | None = None) -> None:
        self.request_id, self.seen = request_id, ReplyFilter(entry)

    def take(self, fields: dict[bytes, bytes]) -> wire.ReplyEvent | None:
        """The event of one reply stream entry (WireError if it does not decode)."""
        ev = wire.decode(fields, wire.ReplyEvent)
        expected = self.seen.next_index
        if not self.seen.accept(ev):
            return None
        if ev.kind == "error":
            msg = ev.error.message if ev.error else "unknown error"
            raise RequestFailed(f"request {self.request_id} failed: {msg}", ev.error)
        if (ev.kind == "token" and ev.index > expected) or (
            ev.kind == "done" and ev.index > self.seen.next_index
        ):
            raise RequestFailed(
                f"request {self.request_id} was lost in part: tokens {expected} to "
                f"{ev.index - 1} vanished from its reply stream (Redis lost it)",
                wire.Failure(type="Lost", message="reply tokens lost by Redis", retryable=True),
            )
        return ev


def send(
    r: redis.Redis,
    keys: Keys,
    model: str,
    *,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_tokens: int = 16,
    maxlen: int = 10_000,
    sampling: wire.SamplingParams | None = None,
    messages: list[wire.ChatMessage] | None = None,
    request_id: str | None = None,
) -> RequestId:
    """Queue a request; returns its id, a `RequestId` that `events` reads its entry and
    stream from (see `submit`)."""
    rid = submit(
        r,
        keys,
        model,
        prompt=prompt,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        maxlen=maxlen,
        sampling=sampling,
        messages=messages,
        request_id=request_id,
    ).request_id
    assert isinstance(rid, RequestId)
    return rid


def submit(
    r: redis.Redis,
    keys: Keys,
    model: str,
    *,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_tokens: int = 16,
    maxlen: int = 10_000,
    sampling: wire.SamplingParams | None = None,
    messages: list[wire.ChatMessage] | None = None,
    request_id: str | None = None,
) -> Submitted:
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
    req = new_request(
        model,
        prompt=prompt,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        messages=messages,
        request_id=request_id,
    )
    stream = keys.model_requests(model, request_shard(req.request_id, shards))
    queued = r.xlen(stream)
    if queued >= maxlen:
        raise RequestFailed(
            f"model {model!r} has {queued} requests queued on {stream}, the cap ({maxlen}, "
            "KVQ_STREAM_MAXLEN per request stream); retry later"
        )
    return enqueue(r, stream, req)


def new_request(
    model: str,
    *,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_tokens: int = 16,
    sampling: wire.SamplingParams | None = None,
    messages: list[wire.ChatMessage] | None = None,
    request_id: str | None = None,
    tools: str | None = None,
) -> wire.Request:
    """A request (a fresh id unless `request_id` is given), not queued yet; `tools`: a chat's
    tools as JSON text, for its template."""
    return wire.Request(
        request_id=str(request_id or uuid.uuid4().hex),  # a plain str: the codec's rule
        model=model,
        prompt=prompt,
        prompt_ids=prompt_ids,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling or wire.SamplingParams(),
        tools=tools,
    )


def enqueue(r: redis.Redis, stream: str, req: wire.Request) -> Submitted:
    """Append `req` to its request stream (the caller checked the queue's room), never trimmed:
    trimming would drop queued requests without an answer. RequestFailed at once (failure
    type `WritesRefused`, retryable) when Redis refuses writes (`MISCONF`, `OOM`, ...)."""
    try:
        got = xadd(r, stream, wire.encode(req), None)
    except redis.ResponseError as exc:
        code = refusal(exc)
        if code is None:
            raise
        raise RequestFailed(
            f"request {req.request_id} was not queued: redis refuses writes ({code}: "
            f"{' '.join(str(exc).split())[:200]}); its operator must free memory or disk "
            "(docs/faults.md); retry later",
            wire.Failure(
                type="WritesRefused", message=f"redis refuses writes ({code})", retryable=True
            ),
        ) from None
    entry = got.decode() if isinstance(got, bytes) else str(got)
    return Submitted(RequestId(req.request_id, entry, stream), entry)


CANCEL_MAXLEN = 200_000  # a storm of junk cancels between two polls must not trim real ones


def cancel(
    r: redis.Redis, keys: Keys, model: str, request_id: str, maxlen: int = CANCEL_MAXLEN
) -> None:
    """Give up on a request: its coordinator drops it at its next step (or when it would
    admit it, if it is still queued). The request's own key says so for certain (no other
    client's cancels can trim it away); the model's cancel stream tells its coordinators at
    once."""
    cancel_keys.mark(r, keys, str(request_id))
    cancel = wire.Cancel(request_id=str(request_id))  # a plain str: the codec takes no subclass
    xadd(r, keys.model_cancels(model), wire.encode(cancel), maxlen)


def events(
    r: redis.Redis,
    keys: Keys,
    request_id: str,
    timeout_s: float = 60.0,
    entry: str | None = None,
    *,
    stream: str | None = None,
    lost_after_s: float = LOST_AFTER_S,
) -> Iterator[wire.ReplyEvent]:
    """Reply events of one request, in order, until `done` (or RequestFailed / TimeoutError):
    each token once, also across a coordinator restart or takeover (`ReplyFilter`).

    `entry` and `stream` (read from a `RequestId`, as `send` and `submit` return it, when not
    given): events of another request that reused the id are ignored, and a request that
    Redis lost ends in RequestFailed (failure type `Lost`, retryable) instead of a wait until
    `timeout_s`: once `lost_after_s` pass without an event, its entry is looked up on its
    stream, and gone without an answer (a restart without persistence, `FLUSHALL`, a `DEL`)
    the request is lost; so is one whose tokens vanished from its reply stream (a gap). A
    Redis outage is waited out until `timeout_s`."""
    entry = entry or getattr(request_id, "entry", "") or None
    stream = stream or getattr(request_id, "stream", "") or None
    key = keys.request_reply(request_id)
    reader = ReplyReader(request_id, entry)
    last = b"0-0"
    now = time.monotonic()
    deadline, quiet_since = now + timeout_s, now
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            raise TimeoutError(f"no complete reply for request {request_id} in {timeout_s}s")
        resp = _read_replies(r, key, last, left_ms)
        if resp is None:  # an outage: wait it out, until the deadline
            continue
        gone = False
        if not resp and entry and stream and time.monotonic() - quiet_since >= lost_after_s:
            quiet_since = time.monotonic()
            # its answer is written before its entry is deleted: with the entry gone, what
            # the reply stream holds now is all that can come
            gone = entry_gone(r, stream, entry)
            resp = r.xread({key: last}, count=256) if gone else resp
        for _, entries in resp or []:
            quiet_since = time.monotonic()
            for eid, fields in entries:
                last = eid
                ev = reader.take(fields)
                if ev is None:
                    continue
                yield ev
                if ev.kind == "done":
                    return
        if gone:
            raise RequestFailed(
                f"request {request_id} was lost: its entry {entry} vanished from {stream} "
                "before it was answered (Redis lost it: a restart without persistence, "
                "FLUSHALL or a DEL); send it again",
                wire.Failure(type="Lost", message="request lost by Redis", retryable=True),
            )


def _read_replies(r: redis.Redis, key: str, last: bytes, left_ms: int) -> Any:
    """One blocking read of a reply stream after `last`: None in a Redis outage, after a short
    pause."""
    try:
        return r.xread({key: last}, count=256, block=min(left_ms, 1000))
    except redis.RedisError as exc:
        if not is_connection_error(exc):
            raise
        time.sleep(min(0.5, left_ms / 1000))
        return None


def entry_gone(r: redis.Redis, stream: str, entry: str) -> bool:
    """Whether request `entry` has left `stream` (answered, or lost by Redis), told without
    reading a request (the client's ACL user may not: `XRANGE` would read everyone's): once
    delivered to the coordinators' group, it is there while pending; before, while the group
    still has entries to deliver. The group first: an entry delivered after that read is
    still undelivered to this check, never taken for gone."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if not is_lost_key(exc):
            raise
        return True  # the stream is gone
    group = next((g for g in groups if _text(g.get("name")) == COORDINATOR_GROUP), None)
    if group is None:  # no coordinator has read it yet
        return not r.xlen(stream)
    if _stream_id(entry) > _stream_id(_text(group.get("last-delivered-id"))):
        return group.get("lag") == 0 or not r.xlen(stream)
    return not r.xpending_range(stream, COORDINATOR_GROUP, min=entry, max=entry, count=1)


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _stream_id(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms or 0), int(seq or 0)


def generate(
    r: redis.Redis,
    keys: Keys,
    model: str,
    *,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_tokens: int = 16,
    timeout_s: float = 60.0,
) -> list[int]:
    """Submit and wait; the generated token ids."""
    rid, entry = submit(r, keys, model, prompt=prompt, prompt_ids=prompt_ids, max_tokens=max_tokens)
    got = events(r, keys, rid, timeout_s, entry)
    return [ev.token_id for ev in got if ev.token_id is not None]
