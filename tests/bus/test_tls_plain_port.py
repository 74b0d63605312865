"""`rediss://` pointed at a server that speaks plain Redis (the wrong port, or TLS forgotten on
the server) fails within 5 s with one line that says so, instead of about 51 s of retries
(issue 32 item 8). The server is the tests' own plain one."""

from __future__ import annotations

import time

import pytest

from kvq.bus.connection import connect, speaks_plain_redis
from kvq.config import load_settings
from kvq.errors import TlsError
from kvq.local.cluster import EmbeddedCluster
from kvq.local.server import EmbeddedRedis, free_port


def test_rediss_to_a_plain_port_fails_within_5_s_with_one_line(
    redis_server: EmbeddedRedis | EmbeddedCluster,
) -> None:
    if isinstance(redis_server, EmbeddedCluster):
        pytest.skip("a standalone URL is what this checks")
    url = redis_server.url.replace("redis://", "rediss://kvq:s3cret@", 1)
    t0 = time.monotonic()
    with pytest.raises(TlsError) as err:
        connect(load_settings(redis_url=url).bus)
    took = time.monotonic() - t0
    msg = str(err.value)
    assert took < 5, f"took {took:.1f} s"
    assert "\n" not in msg and "plain Redis" in msg and "s3cret" not in msg, msg


def test_the_plain_probe_tells_a_redis_port_from_others(
    redis_server: EmbeddedRedis | EmbeddedCluster,
) -> None:
    if isinstance(redis_server, EmbeddedCluster):
        pytest.skip("a standalone URL is what this checks")
    assert speaks_plain_redis(redis_server.url)
    assert not speaks_plain_redis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
