"""A queued request is judged by its queue's progress (issue 30, item 2): a flood longer than
`KVQ_API_TIMEOUT_S` gets only 200 and 429 (never 504) while the queue moves; 429's Retry-After
comes from the measured drain rate; a stopped coordinator turns waiting calls into 503 within
2 s."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import MODEL, System
from test_api_errors import assert_error, haunt, post
from waiting import wait_for

from kvq.api.queue import QueueSample, QueueWatch
from kvq.coordinator import Coordinator
from kvq.keys import COORDINATOR_GROUP

pytestmark = pytest.mark.slow  # a system of kvq roles or processes


def flood(url: str, n: int, max_tokens: int) -> tuple[Counter[int], list[float], list[str]]:
    """`n` concurrent completions: the statuses, each call's seconds, the 429s' Retry-After."""
    times: list[float] = []
    retry: list[str] = []

    def one(i: int) -> int:
        t0 = time.monotonic()
        body = {"model": MODEL, "prompt": f"flood {i}", "max_tokens": max_tokens, "temperature": 0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=300)
        times.append(time.monotonic() - t0)
        if resp.status_code == 429:
            retry.append(resp.headers.get("Retry-After", ""))
        return resp.status_code

    with ThreadPoolExecutor(n) as pool:
        statuses = Counter(pool.map(one, range(n)))
    return statuses, times, retry


@pytest.mark.slow
def test_a_flood_longer_than_the_timeout_gets_no_504(system: System) -> None:
    """The issue's flood scaled to the tiny model: the queue takes several times
    KVQ_API_TIMEOUT_S to drain (the old fixed deadline answered 504 to the tail)."""
    timeout_s = 1.5
    url = system.gateway(api_timeout_s=timeout_s, api_max_queue=64)
    statuses, times, retry = flood(url, 75, 48)  # the 75 calls of 48 tokens
    print(f"flood: {dict(statuses)}, longest call {max(times):.1f}s")
    assert statuses[504] == 0, statuses
    assert set(statuses) <= {200, 429} and statuses[200] >= 4, statuses
    assert max(times) > 2 * timeout_s, "the flood did not outlast the timeout: no test"
    assert all(r.isdigit() and int(r) >= 1 for r in retry), retry


def test_drain_rate_and_retry_after() -> None:
    """The rate counts only stretches with a backlog; Retry-After is the time to drain to the
    admissible length."""
    w = QueueWatch(None, MODEL, ["s"])  # type: ignore[arg-type]  # samples are injected
    assert w.rate() is None and w.retry_after_s(10, 5.0, 64) is None
    idle = [QueueSample(t, 1, 0, 0, 0, ((0, 0),)) for t in (0.0, 5.0)]  # no backlog: no rate
    busy = [QueueSample(5.0 + t, 1, 20, 2 * t, 0, ((0, 0),)) for t in range(5)]  # 2/s while 20 wait
    w._samples.extend([*idle, *busy])
    assert w.rate() == pytest.approx(2.0)
    assert w.start_after_s(20) == pytest.approx(10.0)
    # 20 waiting, 2/s, 5 s to start: 9 may wait ahead, so 11 must go first: 6 s
    assert w.retry_after_s(20, 5.0, 64) == 6
    assert w.retry_after_s(20, 60.0, 8) == 7  # the queue limit binds: 13 to go at 2/s


def test_429_when_the_measured_rate_says_it_would_not_start_in_time(system: System) -> None:
    """A queue drained at 2 entries/s with 1 s to start: a new call behind several waiting
    ones is 429, its Retry-After the time the queue needs to drain to one that starts in time."""
    system.mon.register("slow", system.model_path)
    haunt(system, "slow")
    stream = system.keys.model_requests("slow")
    for i in range(12):
        system.r.xadd(stream, {"x": str(i)})
    system.r.xgroup_create(stream, COORDINATOR_GROUP, id="0")
    url = system.gateway(api_timeout_s=1.0, api_max_queue=64)
    waiting = threading.Thread(
        target=post, args=(url, "/v1/completions", {"model": "slow", "prompt": "x"})
    )
    waiting.start()  # its wait samples the queue
    for _ in range(6):  # 2 entries/s taken by a "coordinator"
        time.sleep(0.5)
        system.r.xreadgroup(COORDINATOR_GROUP, "ghost", {stream: ">"}, count=1)
    resp = post(url, "/v1/completions", {"model": "slow", "prompt": "x"})
    err = assert_error(resp, 429)
    assert err["code"] == "queue_full" and "drains at" in err["message"], err
    assert int(resp.headers["Retry-After"]) >= 2  # 7 waiting at ~2/s, 1 may wait: >= 3 s
    waiting.join(timeout=10)


def test_a_stopped_coordinator_is_503_within_2s(system: System) -> None:
    """A waiting call turns 503 once no coordinator is alive, and a clean stop removes the
    coordinator at once (not after its slot state goes stale)."""
    system.mon.register("solo", system.model_path)
    url = system.gateway(api_timeout_s=60.0)
    haunt(system, "solo")  # alive but never answers: the call waits
    got: list[tuple[int, float]] = []

    def call() -> None:
        resp = post(url, "/v1/completions", {"model": "solo", "prompt": "x"})
        got.append((resp.status_code, time.monotonic()))

    t = threading.Thread(target=call)
    t.start()
    wait_for(lambda: system.r.xlen(system.keys.model_requests("solo")) == 1, 20, "the call queued")
    stopped = time.monotonic()
    system.mon.board.forget_coordinator("solo", "ghost")  # what a clean stop does
    t.join(timeout=10)
    assert got and got[0][0] == 503 and got[0][1] - stopped < 2.0, got

    coord = Coordinator.from_settings(system.settings, "c-solo", "solo", system.model_path)
    th = threading.Thread(target=coord.run, daemon=True)
    th.start()
    wait_for(
        lambda: any(c.alive for c in system.mon.board.coordinators("solo")), 20, "c-solo alive"
    )
    coord.stop.set()
    th.join(timeout=20)
    coord.board.r.close()
    t0 = time.monotonic()
    resp = post(url, "/v1/completions", {"model": "solo", "prompt": "x"})
    assert assert_error(resp, 503)["code"] == "model_not_served"
    assert time.monotonic() - t0 < 2.0
