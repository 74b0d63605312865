"""Issue 29 item 4: SIGTERM stops every role with exit code 0, Redis up or down.

Real processes on their own server: a monitor (with its RQ coarse-job worker, KVQ_RQ_URL being
the same standalone server), a coordinator, a worker serving a slice, and the HTTP gateway.
With Redis up, each is stopped in turn; with Redis down (stopped under them, so each is in its
reconnect loop), each is stopped too: every exit code is 0, within the reconnect backoff.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

from kvq.config import child_env, load_settings
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.local.server import EmbeddedRedis, free_port

pytestmark = [pytest.mark.slow, pytest.mark.standalone]  # it stops its own server


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("redis_up", [True, False], ids=["redis-up", "redis-down"])
@pytest.mark.timeout(300)
def test_sigterm_exits_0_for_every_role(tiny_model: Path, tmp_path: Path, redis_up: bool) -> None:
    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    s = load_settings(
        redis_url=server.url,
        prefix="term",
        block_ms=100,
        heartbeat_ttl_s=1.0,
        volunteer_poll_s=0.05,
        monitor_poll_s=0.1,
        reconnect_max_s=1.0,
        slice_experts=8,
    )
    port = free_port()
    kids = Children(child_env(s, api_port=port), log_dir=str(tmp_path / "logs"))
    r = redis.Redis.from_url(server.url)
    keys = Keys(s.prefix)
    try:
        kids.spawn("monitor", "monitor", "--model", f"tiny={tiny_model}")
        kids.wait_for(lambda: r.sismember(keys.models(), "tiny"), 120, "registration")
        kids.spawn("worker", "worker", "--id", "w0")
        kids.spawn(
            "coordinator",
            "coordinator",
            "--model",
            str(tiny_model),
            "--model-id",
            "tiny",
            "--id",
            "c1",
        )
        kids.spawn("api", "api")
        kids.wait_for(
            lambda: r.exists(keys.coord_slots("c1")) and r.hlen(keys.model_workers("tiny")),
            120,
            "the coordinator and the worker",
        )
        kids.wait_for(lambda: _up(f"http://127.0.0.1:{port}/health"), 120, "the gateway")
        if not redis_up:
            server.stop()
            time.sleep(1.5)  # every role meets the outage and enters its reconnect loop
        assert not kids.dead(), kids.dead()
        codes = {}
        for name, proc in kids.procs.items():
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            codes[name] = (proc.wait(30), round(time.monotonic() - t0, 1))
        print(f"redis {'up' if redis_up else 'down'}: exit codes and seconds {codes}")
        bad = {n: c for n, (c, _) in codes.items() if c != 0}
        logs = {n: (tmp_path / "logs" / f"{n}.log").read_text()[-1500:] for n in bad}
        assert not bad, f"non-zero exits {bad}: {logs}"
    finally:
        kids.stop_all()
        r.close()
        server.close()


@pytest.mark.timeout(120)
def test_sigterm_exits_0_while_a_coordinator_waits_for_its_model(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Before a role's own stop is installed (a coordinator waits for Redis or for its model's
    registration at start), SIGTERM still ends it with code 0."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    s = load_settings(redis_url=server.url, prefix="term-start", reconnect_max_s=1.0)
    kids = Children(child_env(s), log_dir=str(tmp_path / "logs"))
    try:
        proc = kids.spawn(
            "coordinator",
            "coordinator",
            "--model",
            str(tiny_model),
            "--model-id",
            "nobody-registered-it",
            "--id",
            "c1",
        )
        log = tmp_path / "logs" / "coordinator.log"
        kids.wait_for(
            lambda: "waiting for model" in log.read_text(),
            90,
            "the coordinator waiting for its model",
        )
        server.stop()  # and Redis goes too
        time.sleep(0.5)  # it waits on with Redis gone: the outage is what is tested
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        kids.stop_all()
        server.close()
