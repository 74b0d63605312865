"""Redis connections with a reconnect policy shared by every process."""

from __future__ import annotations

import logging
import random
import socket
import ssl
import time
import weakref
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from kvq.errors import TlsError
from kvq.security.redact import redacted_text, redacted_url
from kvq.settings_checks import tls_weakening
from kvq.settings_parts import BusSettings

__all__ = [
    "Backoff",
    "connect",
    "connect_async",
    "is_connection_error",
    "is_tls_error",
    "redacted_url",
]
log = logging.getLogger("kvq.bus")


_SENTINELS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def plain_url(url: str) -> str:
    """The URL redis-py parses: `redis+cluster://h:p` → `redis://h:p`."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=parts.scheme.split("+", 1)[0]))


def tls_options(settings: BusSettings) -> dict[str, Any]:
    """redis-py's TLS arguments from the `KVQ_TLS_*` settings (none for redis:// or unix://)."""
    if urlsplit(plain_url(settings.redis_url)).scheme != "rediss":
        return {}
    opts: dict[str, Any] = {}
    if settings.tls_ca_file:
        opts["ssl_ca_certs"] = settings.tls_ca_file
    if settings.tls_cert_file:
        opts["ssl_certfile"], opts["ssl_keyfile"] = settings.tls_cert_file, settings.tls_key_file
    weak = tls_weakening(settings.redis_url)
    if weak:  # the settings refuse this without KVQ_TLS_INSECURE
        log.warning(
            "KVQ_REDIS_URL has %s: the Redis server's certificate is NOT fully "
            "verified (KVQ_TLS_INSECURE=1 allows it)",
            weak,
        )
    if settings.tls_insecure:
        log.warning(
            "KVQ_TLS_INSECURE=1: the Redis server's certificate is NOT verified; "
            "anyone on the path can read and change kvq's traffic"
        )
        opts["ssl_cert_reqs"], opts["ssl_check_hostname"] = "none", False
    return opts


def connect(settings: BusSettings, retries: int = 3) -> redis.Redis:
    """A client for `KVQ_REDIS_URL` that retries each command across short outages: a plain
    client, a `RedisCluster` (mode cluster) or the master of a Sentinel set (mode sentinel).

    Raw bytes in and out (`decode_responses=False`): payloads are msgpack. Over TLS the first
    connection is made now: a certificate problem fails here with a one-line TlsError instead
    of being retried forever (an unreachable server is still waited for, later). `retries`:
    how often a command is tried again after a connection error or a timeout (0 for a check
    that must answer within one socket timeout, `kvq health`).
    """
    retry = Retry(ExponentialBackoff(cap=settings.reconnect_max_s, base=0.05), retries=retries)
    if settings.mode == "cluster":
        return _cluster(settings, retry)
    if settings.mode == "sentinel":
        return _sentinel(settings, retry)
    tls = tls_options(settings)
    r = redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.socket_timeout_s + settings.block_ms / 1000,
        socket_connect_timeout=settings.socket_timeout_s,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        **tls,
    )
    if urlsplit(settings.redis_url).scheme == "rediss":
        try:
            _first_tls_ping(settings, tls)
        except TlsError:
            r.close()
            raise
    return r


def _first_tls_ping(settings: BusSettings, tls: dict[str, Any]) -> None:
    """One TLS connection, made now and not retried: a certificate problem, or a server that
    speaks plain Redis on that port (a handshake there waits for an answer that never comes),
    raises a one-line TlsError within a few seconds. Anything else (the server is down) is
    left to the client's retries."""
    probe = redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=_HANDSHAKE_S,
        socket_connect_timeout=_HANDSHAKE_S,
        retry=Retry(NoBackoff(), 0),
        **tls,
    )
    try:
        probe.ping()
    except redis.RedisError as exc:
        tls_failed = is_tls_error(exc)
        if (tls_failed or isinstance(exc, redis.TimeoutError)) and speaks_plain_redis(
            settings.redis_url
        ):
            raise TlsError(
                f"{redacted_url(settings.redis_url)} is a rediss:// (TLS) URL, but the server "
                "there speaks plain Redis: use redis://, or the port of its --tls-port"
            ) from None
        if tls_failed:
            raise TlsError(tls_message(settings.redis_url, exc)) from None
    finally:
        probe.close()


_HANDSHAKE_S = 2.0  # a TLS handshake on loopback or a LAN takes milliseconds


def speaks_plain_redis(url: str, timeout_s: float = 1.0) -> bool:
    """Whether host:port of `url` answers a plain-text PING as Redis does (+PONG, or an
    error such as -NOAUTH): a TLS port closes on it or answers with a TLS alert instead."""
    parts = urlsplit(plain_url(url))
    try:
        with socket.create_connection(
            (parts.hostname or "", parts.port or 6379), timeout_s
        ) as sock:
            sock.sendall(b"PING\r\n")
            first = sock.recv(1)
    except OSError:
        return False
    return first in (b"+", b"-")


def is_tls_error(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a TLS failure: retrying will not fix it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError | ssl.CertificateError):
            return True
        text = str(seen)
        if "SSL" in text and ("CERTIFICATE" in text.upper() or "HANDSHAKE" in text.upper()):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def tls_message(url: str, exc: BaseException) -> str:
    """One line: which server, what failed, which settings to check."""
    why = " ".join(redacted_text(str(exc)).split())
    return (
        f"TLS to {redacted_url(url)} failed: {why}; check KVQ_TLS_CA_FILE (the CA that signed "
        "the server's certificate), KVQ_TLS_CERT_FILE/KVQ_TLS_KEY_FILE (if the server asks for "
        "a client certificate) and the host name in KVQ_REDIS_URL"
    )


def _timeouts(settings: BusSettings) -> dict[str, Any]:
    return {
        "socket_timeout": settings.socket_timeout_s + settings.block_ms / 1000,
        "socket_connect_timeout": settings.socket_timeout_s,
    }


def _cluster(settings: BusSettings, retry: Retry) -> redis.Redis:
    from redis.cluster import RedisCluster

    # the board's calls are plain Redis calls that stay inside one hash tag (docs/streams.md)
    client = RedisCluster.from_url(
        plain_url(settings.redis_url), retry=retry, **_timeouts(settings), **tls_options(settings)
    )
    return cast(redis.Redis, client)


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, dict[str, str | None]]:
    """(sentinel addresses, master name, credentials) of `redis+sentinel://h1:p1,h2:p2/name`."""
    parts = urlsplit(plain_url(url))
    hosts = [
        (h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1]) if ":" in h else 26379)
        for h in parts.netloc.rsplit("@", 1)[-1].split(",")
    ]
    master = parts.path.strip("/").split("/")[0]
    return hosts, master, {"username": parts.username, "password": parts.password}


def _sentinel(settings: BusSettings, retry: Retry) -> redis.Redis:
    from redis.sentinel import Sentinel

    hosts, master, auth = _sentinel_parts(settings.redis_url)
    sentinel = Sentinel(hosts, sentinel_kwargs=auth, **_timeouts(settings))
    conn = sentinel.master_for(
        master,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        **auth,
        **_timeouts(settings),
    )
    return cast(redis.Redis, conn)


async def close_async(client: redis.asyncio.Redis) -> None:
    """Close `connect_async`'s client, and the Sentinel connections it found its master by."""
    await client.aclose()
    for s in _SENTINELS.pop(client, []):
        await s.aclose()


def connect_async(settings: BusSettings) -> redis.asyncio.Redis:
    """The asyncio twin of `connect` (for `kvq api`), with the same timeouts and retries."""
    retry = redis.asyncio.retry.Retry(
        ExponentialBackoff(cap=settings.reconnect_max_s, base=0.05), retries=3
    )
    if settings.mode == "cluster":
        from redis.asyncio.cluster import RedisCluster

        client = RedisCluster.from_url(
            plain_url(settings.redis_url), retry=retry, **_timeouts(settings)
        )
        return cast(redis.asyncio.Redis, client)
    if settings.mode == "sentinel":
        from redis.asyncio.sentinel import Sentinel

        hosts, master, auth = _sentinel_parts(settings.redis_url)
        sentinel = Sentinel(hosts, sentinel_kwargs=auth, **_timeouts(settings))
        conn = sentinel.master_for(
            master,
            retry=retry,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            **auth,
            **_timeouts(settings),
        )
        _SENTINELS[conn] = list(sentinel.sentinels)  # closed by `close_async`
        return cast(redis.asyncio.Redis, conn)
    return redis.asyncio.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.socket_timeout_s + settings.block_ms / 1000,
        socket_connect_timeout=settings.socket_timeout_s,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        **tls_options(settings),
    )


def is_connection_error(exc: BaseException) -> bool:
    """A failure worth waiting out (the server, a cluster node or the whole cluster is down,
    unreachable or failing over); TLS failures are not: the same certificate fails the same
    way."""
    from redis.exceptions import (
        ClusterDownError,
        RedisClusterException,
        SlotNotCoveredError,
        TryAgainError,
    )

    if isinstance(exc, ClusterDownError | SlotNotCoveredError | TryAgainError):
        return True  # a cluster failover in progress
    if isinstance(exc, RedisClusterException):  # no node reachable; others (cross-slot) are bugs
        return "cannot be connected" in str(exc)
    transient = isinstance(exc, redis.ConnectionError | redis.TimeoutError | ConnectionError)
    return transient and not is_tls_error(exc)


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
