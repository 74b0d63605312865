"""`kvq.bus.outage`: which Redis errors a role waits out, and one log line per episode."""

from __future__ import annotations

import logging

import pytest
import redis

from kvq.bus.outage import Outage, kind_of, refusal
from kvq.monitor.metrics import refusal_reasons

REFUSALS = [
    (redis.exceptions.OutOfMemoryError("command not allowed"), "OOM"),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), "READONLY"),
    (redis.exceptions.BusyLoadingError("Redis is loading"), "LOADING"),
    (redis.ResponseError("MISCONF Errors writing to the AOF file: No space left"), "MISCONF"),
    (redis.ResponseError("BUSY Redis is busy running a script."), "BUSY"),
    (redis.ResponseError("BUSYGROUP Consumer Group name already exists"), None),
    (redis.ResponseError("WRONGTYPE Operation against a key"), None),
]


@pytest.mark.parametrize(("exc", "code"), REFUSALS)
def test_refusals_are_told_by_their_code(exc: redis.RedisError, code: str | None) -> None:
    assert refusal(exc) == code


def test_an_episode_is_logged_once_and_credentials_end_the_role(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage(logging.getLogger("kvq.test"), cap_s=0.001, base_s=0.001)
    oom = redis.exceptions.OutOfMemoryError("command not allowed")
    with caplog.at_level(logging.WARNING, "kvq.test"):
        for _ in range(5):
            outage.failed(oom)
        outage.ok()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "refusing writes (OOM)" in lines[0] and "again" in lines[1]
    assert kind_of(redis.ConnectionError("down")) == "unreachable"
    assert kind_of(redis.ResponseError("WRONGTYPE x")) == "refused a command"
    with pytest.raises(redis.exceptions.NoPermissionError):
        outage.failed(redis.exceptions.NoPermissionError("NOPERM"))


def test_refusal_reasons_from_info() -> None:
    ok = {
        "rdb_last_bgsave_status": "ok",
        "aof_last_write_status": "ok",
        "role": "master",
        "maxmemory": 0,
        "maxmemory_policy": "noeviction",
        "used_memory": 10,
        "loading": 0,
    }
    assert refusal_reasons(ok) == set()
    full = ok | {"maxmemory": 100, "used_memory": 99, "aof_last_write_status": "err"}
    assert refusal_reasons(full) == {"oom", "misconf"}
    assert refusal_reasons(full | {"maxmemory_policy": "allkeys-lru"}) == {"misconf"}
