"""Redis connections with a reconnect policy shared by every process."""

from __future__ import annotations

import random
import time
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvq.config import BusSettings
from kvq.errors import ConfigError


def plain_url(url: str) -> str:
    """The URL redis-py parses: `redis+cluster://h:p` → `redis://h:p`."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=parts.scheme.split("+", 1)[0]))


def connect(settings: BusSettings) -> redis.Redis:
    """A client for `KVQ_REDIS_URL` that retries each command across short outages: a plain
    client, a `RedisCluster` (mode cluster) or the master of a Sentinel set (mode sentinel).

    Raw bytes in and out (`decode_responses=False`): payloads are msgpack.
    """
    retry = Retry(ExponentialBackoff(cap=settings.reconnect_max_s, base=0.05), retries=3)
    if settings.mode == "cluster":
        return _cluster(settings, retry)
    if settings.mode == "sentinel":
        return _sentinel(settings, retry)
    return redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.socket_timeout_s + settings.block_ms / 1000,
        socket_connect_timeout=settings.socket_timeout_s,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def _timeouts(settings: BusSettings) -> dict[str, Any]:
    return {
        "socket_timeout": settings.socket_timeout_s + settings.block_ms / 1000,
        "socket_connect_timeout": settings.socket_timeout_s,
    }


def _cluster(settings: BusSettings, retry: Retry) -> redis.Redis:
    from redis.cluster import RedisCluster

    # the board's calls are plain Redis calls that stay inside one hash tag (docs/streams.md)
    client = RedisCluster.from_url(plain_url(settings.redis_url), retry=retry,
                                   **_timeouts(settings))  # fmt: skip
    return cast(redis.Redis, client)


def _sentinel(settings: BusSettings, retry: Retry) -> redis.Redis:
    from redis.sentinel import Sentinel

    parts = urlsplit(plain_url(settings.redis_url))
    hosts = [(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1]) if ":" in h else 26379)
             for h in parts.netloc.rsplit("@", 1)[-1].split(",")]  # fmt: skip
    master = parts.path.strip("/").split("/")[0]
    auth = {"username": parts.username, "password": parts.password}
    sentinel = Sentinel(hosts, sentinel_kwargs=auth, **_timeouts(settings))
    conn = sentinel.master_for(master, retry=retry, retry_on_error=[redis.ConnectionError,
                               redis.TimeoutError], **auth, **_timeouts(settings))  # fmt: skip
    return cast(redis.Redis, conn)


def connect_async(settings: BusSettings) -> redis.asyncio.Redis:
    """The asyncio twin of `connect` (for `kvq api`), with the same timeouts and retries."""
    retry = redis.asyncio.retry.Retry(
        ExponentialBackoff(cap=settings.reconnect_max_s, base=0.05), retries=3
    )
    if settings.mode == "cluster":
        from redis.asyncio.cluster import RedisCluster

        client = RedisCluster.from_url(plain_url(settings.redis_url), retry=retry,
                                       **_timeouts(settings))  # fmt: skip
        return cast(redis.asyncio.Redis, client)
    if settings.mode == "sentinel":
        raise ConfigError(
            "kvq api does not support KVQ_REDIS_MODE=sentinel yet; use the master's URL"
        )
    return redis.asyncio.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.socket_timeout_s + settings.block_ms / 1000,
        socket_connect_timeout=settings.socket_timeout_s,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, redis.ConnectionError | redis.TimeoutError | ConnectionError)


class Backoff:
    """Exponential backoff with jitter for the outer loops of long-running processes."""

    def __init__(self, cap_s: float, base_s: float = 0.1) -> None:
        self.cap_s, self.base_s, self.failures = cap_s, base_s, 0

    def wait(self) -> float:
        delay = self.next_delay()
        time.sleep(delay)
        return delay

    def next_delay(self) -> float:
        """Count a failure and return how long to wait before the next try (no sleep)."""
        self.failures += 1
        delay: float = min(self.cap_s, self.base_s * 2.0 ** (self.failures - 1))
        return delay * (0.5 + random.random() / 2)

    def reset(self) -> None:
        self.failures = 0


def redacted_url(url: str) -> str:
    """The URL without its password, for printing."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))
