"""Redis connections with a reconnect policy shared by every process."""

from __future__ import annotations

import random
import time

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvq.config import BusSettings
from kvq.redact import redacted_url

__all__ = ["Backoff", "connect", "connect_async", "is_connection_error", "redacted_url"]


def connect(settings: BusSettings) -> redis.Redis:
    """A client for `KVQ_REDIS_URL` that retries each command across short outages.

    Raw bytes in and out (`decode_responses=False`): payloads are msgpack.
    """
    retry = Retry(ExponentialBackoff(cap=settings.reconnect_max_s, base=0.05), retries=3)
    return redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.socket_timeout_s + settings.block_ms / 1000,
        socket_connect_timeout=settings.socket_timeout_s,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def connect_async(settings: BusSettings) -> redis.asyncio.Redis:
    """The asyncio twin of `connect` (for `kvq api`), with the same timeouts and retries."""
    retry = redis.asyncio.retry.Retry(
        ExponentialBackoff(cap=settings.reconnect_max_s, base=0.05), retries=3
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
