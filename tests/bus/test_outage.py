"""`kvq.bus.outage`: which Redis errors a role waits out, and one log line per episode."""

from __future__ import annotations

import logging
import threading

import pytest
import redis

from kvq.bus.outage import Outage, kind_of, refusal, run_until_stopped
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


def test_run_until_stopped_rides_out_redis_errors_and_ends_when_told() -> None:
    stop = threading.Event()
    outage = Outage(logging.getLogger("test.outage"), cap_s=0.01, base_s=0.001)
    script: list[BaseException | bool | None] = [
        redis.ConnectionError("down"),
        redis.ResponseError("WRONGTYPE Operation against a key"),
        None,
        True,
        False,  # the step says: no more
        None,  # never reached
    ]
    calls, rereads = [], []

    def step() -> bool | None:
        calls.append(1)
        got = script.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got

    run_until_stopped(stop, step, outage, after_failure=lambda: rereads.append(1))
    assert len(calls) == 5 and len(rereads) == 2
    assert outage.kind is None and outage.episodes == 2  # each kind an episode, then served


def test_run_until_stopped_raises_a_fatal_error_and_stops_on_the_event() -> None:
    outage = Outage(logging.getLogger("test.outage"), cap_s=0.01, base_s=0.001)

    def refused() -> None:
        raise redis.AuthenticationError("WRONGPASS invalid username-password pair")

    with pytest.raises(redis.AuthenticationError):
        run_until_stopped(threading.Event(), refused, outage)
    stop = threading.Event()
    steps: list[int] = []

    def count() -> None:
        steps.append(1)
        if len(steps) == 3:
            stop.set()

    run_until_stopped(stop, count, outage, pause_s=0.001)
    assert len(steps) == 3
