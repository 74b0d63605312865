"""A real system for the gateway's tests: embedded Redis, a monitor's registration, one
worker and one coordinator (threads), and `kvq api` as its own process on a free port.

One system per module (starting it is most of a test's cost); each module has its own key
prefix. Extra gateways with other settings join the same system (`gateway`): the same app on
uvicorn, in a thread of the test process, as they start in milliseconds."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from waiting import wait_for

from kvq.api import create_app
from kvq.asgi import ThreadedServer
from kvq.config import Settings, child_env, load_settings
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.local.server import EmbeddedRedis
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny
from kvq.worker import Worker

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def start_gateway(s: Settings, log: Path, **overrides: Any) -> Gateway:
    port = free_port()
    env = child_env(s, api_port=port, **overrides)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvq", "api"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError("kvq api exited")
        return httpx.get(gw.url + "/health", timeout=1).status_code == 200

    try:  # a loaded machine imports slowly
        wait_for(healthy, 90, "kvq api to start", poll_s=0.05, ignore=httpx.HTTPError)
    except AssertionError as exc:
        gw.stop()
        raise AssertionError(f"{exc}:\n{log.read_text()}") from None
    return gw


@dataclass
class System:
    settings: Settings
    model_path: Path
    url: str
    r: redis.Redis
    keys: Keys
    coord: Coordinator
    mon: Monitor
    tmp: Path
    gateways: list[Gateway] = field(default_factory=list)
    threaded: list[ThreadedServer] = field(default_factory=list)

    def gateway(self, **overrides: Any) -> str:
        """Another gateway on the same system, with other settings; its base URL."""
        s = self.settings.model_copy(update={"api_port": 0, **overrides})
        srv = ThreadedServer(create_app(s), "127.0.0.1", 0)
        self.threaded.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    def prefix_keys(self) -> set[bytes]:
        return set(self.r.scan_iter(f"{self.keys.prefix}:*", count=1000))

    def queued(self, model: str = MODEL) -> int:
        return int(self.r.xlen(self.keys.model_requests(model)))


@pytest.fixture(scope="module")
def api_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("api-model") / "tiny-bpe.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3, tokenizer="bpe")
    return path


@pytest.fixture(scope="module")
def system(
    redis_server: EmbeddedRedis, api_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[System]:
    s = load_settings(
        redis_url=redis_server.url,
        prefix=f"t{uuid.uuid4().hex[:10]}",
        block_ms=100,
        heartbeat_ttl_s=1.0,
        volunteer_poll_s=0.05,
        monitor_poll_s=0.1,
        dispatch_refresh_ms=50,
        slot_poll_s=0.02,
        n_slots=4,
        api_timeout_s=30.0,
    )
    tmp = tmp_path_factory.mktemp("api")
    mon = Monitor.from_settings(s)
    mon.register(MODEL, api_model)
    worker = Worker.from_settings(s, "w0")
    coord = Coordinator.from_settings(s, "c1", MODEL, api_model)
    threads = [threading.Thread(target=x.run, daemon=True) for x in (worker, coord)]
    for t in threads:
        t.start()
    gw = start_gateway(s, tmp / "api.log")
    sysm = System(s, api_model, gw.url, mon.board.r, Keys(s.prefix), coord, mon, tmp, [gw])
    wait_for(lambda: any(c.alive for c in mon.board.coordinators(MODEL)), 20, "the coordinator")
    yield sysm
    for gw in sysm.gateways:
        gw.stop()
    for srv in sysm.threaded:
        srv.shutdown()
    worker.stop.set()
    coord.stop.set()
    for t in threads:
        t.join(timeout=10)
    for x in (worker, coord):
        x.board.r.close()
