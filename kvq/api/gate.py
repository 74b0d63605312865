"""What a call must pass before it is queued: its API key, its key's request limit, a model
that is registered and served, and room in the model's queue: no more than `KVQ_API_MAX_QUEUE`
waiting, and, once the queue's drain rate is measured (`kvq.api.queue`), a start within
`KVQ_API_TIMEOUT_S`. Then it is queued.

Everything is read from Redis at call time (through the board), so any number of gateways
agree; the per-key counter lives in Redis for the same reason. Blocking redis-py calls: the
app runs them on its thread pool.
"""

from __future__ import annotations

import hashlib
import hmac
import math

import redis

from kvq import client, wire
from kvq.api.params import Call
from kvq.api.queue import QueueSample, QueueWatch
from kvq.bus.redis_board import RedisBoard, request_shards
from kvq.errors import ApiError, ConfigError
from kvq.keys import request_shard, request_streams
from kvq.settings_parts import ApiSettings

WINDOW_S = 60  # the per-key limit counts requests per minute
_NO_COUNTING = (
    "KVQ_API_KEY_RPM needs a Redis user that may count API calls ({exc}); run kvq api as the "
    "api role's user (kvq acl --role api), not the client's"
)


class Gate:
    """Auth and admission of `kvq api`."""

    def __init__(self, board: RedisBoard, s: ApiSettings) -> None:
        self.board, self.s = board, s
        self.keys = [k.encode() for k in s.keys]
        self._registered: dict[str, int] = {}  # model → request shards; registered stays so
        self._watches: dict[str, QueueWatch] = {}

    def authorize(self, header: str | None) -> str | None:
        """The caller's key (None when auth is off); 401 without a valid one, 429 over its
        per-minute limit."""
        if not self.keys:
            return None
        scheme, _, token = (header or "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k) for k in self.keys):
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                kind="invalid_request_error",
                code="invalid_api_key",
            )
        key = given.decode()
        if self.s.key_rpm:
            self._count(key)
        return key

    def check_counting(self) -> None:
        """ConfigError at start when API keys have a per-key limit and this gateway's Redis user
        may not count calls (the client role's: `kvq api` runs as the api role's user). The
        probe counts a call of no key (a hash no key has) in a window that expires."""
        if not (self.keys and self.s.key_rpm):
            return
        try:
            self.board.count_api_call("0" * 16, WINDOW_S)
        except redis.exceptions.NoPermissionError as exc:
            raise ConfigError(_NO_COUNTING.format(exc=exc)) from None

    def _count(self, key: str) -> None:
        sha = hashlib.sha256(key.encode()).hexdigest()[:16]
        try:
            n, left_s = self.board.count_api_call(sha, WINDOW_S)
        except redis.exceptions.NoPermissionError as exc:  # its user changed since the start
            raise ApiError(
                503,
                "this gateway cannot count API calls; its operator must fix its Redis user",
                kind="server_error",
                code="misconfigured",
                retry_after_s=self.s.retry_after_s,
            ) from exc
        if n > self.s.key_rpm:
            raise ApiError(
                429,
                f"this API key is over its limit of {self.s.key_rpm} requests per minute "
                "(KVQ_API_KEY_RPM)",
                kind="rate_limit_error",
                code="rate_limit_exceeded",
                retry_after_s=max(1, math.ceil(left_s)),
            )

    def check_model(self, model: str) -> int:
        """The model's request shard count; 404 for a model nobody registered (creates no
        key). Kept once seen: a model's shard count changes only when everything restarts."""
        shards = self._registered.get(model)
        if shards is not None:
            return shards
        shards = request_shards(self.board.r, self.board.keys, model)
        if shards is None:
            raise ApiError(
                404,
                f"model {model!r} does not exist; GET /v1/models lists the served ones",
                param="model",
                code="model_not_found",
            )
        self._registered[model] = shards
        return shards

    def watch(self, model: str) -> QueueWatch:
        """The queue watch of a registered model (one per model and gateway)."""
        w = self._watches.get(model)
        if w is None:
            streams = request_streams(self.board.keys, model, self.check_model(model))
            w = self._watches.setdefault(model, QueueWatch(self.board, model, streams))
        return w

    def admit(self, call: Call) -> client.Submitted:
        """Queue the call; its request id and entry. 404, 503 (no coordinator) or 429 (the
        queue is full, or too slow for the call to start in time) first."""
        watch = self.watch(call.model)  # 404 for an unknown model
        with watch.admitting:
            q = watch.sample(fresh=True)
            if not q.alive:
                raise not_served(call.model, self.s.retry_after_s)
            self._check_room(call.model, watch, q)
            return self._queue(call, watch.streams)

    def _queue(self, call: Call, streams: list[str]) -> client.Submitted:
        req = client.new_request(
            call.model,
            prompt=call.prompt,
            prompt_ids=call.prompt_ids,
            messages=call.messages,
            max_tokens=call.max_tokens,
            sampling=call.sampling,
            tools=call.tools_json,
        )
        stream = streams[request_shard(req.request_id, len(streams))]
        try:
            return client.enqueue(self.board.r, stream, req)  # its room was checked above
        except client.RequestFailed as exc:  # Redis refuses writes: 503 at once
            raise ApiError(
                503,
                str(exc),
                kind="server_error",
                code="WritesRefused",
                retry_after_s=self.s.retry_after_s,
            ) from None

    def _check_room(self, model: str, watch: QueueWatch, q: QueueSample) -> None:
        """429 when `q.waiting` requests are ahead and the queue is full, or drains too slowly
        for one more to start within KVQ_API_TIMEOUT_S; Retry-After from the drain rate."""
        within, rate = self.s.timeout_s, watch.rate()
        start_s = None if rate is None else (q.waiting + 1) / rate
        if q.waiting >= self.s.max_queue:
            why = f"(KVQ_API_MAX_QUEUE {self.s.max_queue})"
        elif start_s is not None and start_s > within:
            why = (
                f"and drains at {rate:.2f}/s: a new one would start in "
                f"{start_s:.0f}s, over KVQ_API_TIMEOUT_S {within:g}"
            )
        else:
            return
        retry = watch.retry_after_s(q.waiting, within, self.s.max_queue)
        raise ApiError(
            429,
            f"model {model!r} has {q.waiting} requests waiting {why}; retry later",
            kind="rate_limit_error",
            code="queue_full",
            retry_after_s=retry or self.s.retry_after_s,
        )

    def cancel(self, model: str, request_id: str) -> None:
        client.cancel(self.board.r, self.board.keys, model, request_id)

    def healthy(self) -> bool:
        try:
            return bool(self.board.r.ping())
        except Exception:  # noqa: BLE001 - any failure to reach Redis is "unhealthy"
            return False

    def models(self) -> list[str]:
        return self.board.models()


def not_served(model: str, retry_after_s: int) -> ApiError:
    return ApiError(
        503,
        f"no coordinator serves model {model!r} right now",
        kind="server_error",
        code="model_not_served",
        retry_after_s=retry_after_s,
    )


def failure_status(f: wire.Failure | None) -> ApiError:
    """The HTTP answer for a request the coordinator refused or failed."""
    msg = f.message if f is not None else "the request failed"
    if f is not None and f.type == "BadRequest":
        return ApiError(400, msg, code="refused")
    if f is not None and f.retryable:
        return ApiError(503, msg, kind="server_error", code=f.type)
    return ApiError(500, msg, kind="server_error", code=f.type if f else None)
