"""compose.yaml's services, replayed as the processes `docker compose up` starts (no Docker
engine here): each default service's `command` and environment, in `depends_on` order, its
`/models` volume a temporary folder, its published ports free local ones, each worker replica
with a home of its own (a container's `~/.config/kvq`). Redis is the test's own.

It checks what compose promises: every service's healthcheck command passes; the coordinator
is healthy within its healthcheck's `start_period` from a cold start **under load** (a busy
loop on every CPU of the machine, as on a host that runs other work, beside the workers
loading their slices); and a burst through `kvq api` gives the workers a share of the expert
jobs (the `small` preset's experts cost more than a round trip). The cold start is printed
(`-s`); compose.yaml's comment states the figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings
from kvq.local.procs import Children
from kvq.local.server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.standalone, pytest.mark.serial]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = {n: s for n, s in COMPOSE["services"].items() if "profiles" not in s}


def _seconds(text: str) -> float:
    return float(text.rstrip("s"))


class Replay:
    """compose's services as child processes of this test."""

    def __init__(self, url: str, prefix: str, tmp: Path) -> None:
        self.models = tmp / "models"
        self.models.mkdir()
        self.tmp = tmp
        self.api_port = free_port()
        self.http_port = free_port()
        self.base = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
        self.base |= {k: str(v) for k, v in COMPOSE["x-kvq"]["environment"].items()}
        self.base |= {"KVQ_REDIS_URL": url, "KVQ_PREFIX": prefix}
        self.kids = Children(self.base, log_dir=str(tmp / "logs"))

    def args(self, words: list[str]) -> list[str]:
        out = [w.replace("/models/", f"{self.models}/") for w in words]
        if "--port" in out and out[0] == "api":
            out[out.index("--port") + 1] = str(self.api_port)
        return out

    def env(self, name: str, replica: int = 0) -> dict[str, str]:
        env = dict(self.base)
        for k, v in SERVICES[name].get("environment", {}).items():
            env[k] = str(v)
        env["KVQ_REDIS_URL"] = self.base["KVQ_REDIS_URL"]
        env |= {"KVQ_HTTP_HOST": "127.0.0.1"} if "KVQ_HTTP_HOST" in env else {}
        env |= {"KVQ_HTTP_PORT": str(self.http_port)} if "KVQ_HTTP_PORT" in env else {}
        env |= {"KVQ_API_PORT": str(self.api_port)} if "KVQ_API_PORT" in env else {}
        home = self.tmp / f"home-{name}-{replica}"  # each container's own home
        home.mkdir(exist_ok=True)
        return env | {"HOME": str(home)}

    def start(self, name: str, replica: int = 0) -> None:
        self.kids.spawn(
            f"{name}-{replica}",
            *self.args(SERVICES[name]["command"]),
            env=self.env(name, replica),
        )

    def healthy(self, name: str, replica: int = 0) -> bool:
        """The service's own healthcheck command, as compose runs it in its container."""
        test = SERVICES[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        words = self.args(test[1:])
        cmd = [sys.executable, "-m", "kvq", *words[1:]] if words[0] == "kvq" else words
        env = self.env(name, replica)
        got = subprocess.run(cmd, env=env, capture_output=True, timeout=30)
        return got.returncode == 0


@pytest.fixture
def replay(redis_server: Any, tmp_path: Path) -> Iterator[Replay]:
    if "cluster" in type(redis_server).__name__.lower():
        pytest.skip("compose runs one standalone server")
    r = redis.Redis.from_url(redis_server.url)
    for pattern in ("kvq:*", "rq:*"):  # compose sets no prefix: kvq's own, as docs name them
        for k in r.scan_iter(pattern):
            r.delete(k)
    r.close()
    rp = Replay(redis_server.url, "kvq", tmp_path)
    try:
        yield rp
    finally:
        rp.kids.stop_all(20)


def _burst_through_api(port: int, n: int, tokens: int) -> list[str]:
    errors: list[str] = []

    def one(i: int) -> None:
        body = {"model": "small", "prompt": f"Request {i}: hello", "max_tokens": tokens}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                json.loads(resp.read())
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return errors


def _cold_start_under_load(rp: Replay, board: RedisBoard) -> float:
    """Seconds from the coordinator's start to its healthcheck passing, every CPU also busy."""
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in os.sched_getaffinity(0)]
    try:
        t0 = time.monotonic()
        rp.start("coordinator")
        rp.start("api")
        ident = SERVICES["coordinator"]["command"]
        coord = ident[ident.index("--id") + 1]
        limit = _seconds(SERVICES["coordinator"]["healthcheck"]["start_period"])
        rp.kids.wait_for(lambda: board.coordinator_alive(coord), limit, "the coordinator")
        took = time.monotonic() - t0
        assert rp.healthy("coordinator"), "alive on the board, but its healthcheck fails"
    finally:
        for p in spinners:
            p.kill()
            p.wait(10)
    return took


def _count_doc_lines(board: RedisBoard, worker: str) -> None:
    """docs/streams.md's lines on this deployment after its burst, with one of its workers'
    ids for `laptop-1` (printed: the page's `# README:` statements are the README's)."""
    from test_streams_doc import doc_claims, is_empty, raw_client, reply_of

    r = board.r
    rid = next(
        (k.decode().split("{r:")[1].split("}")[0] for k in r.scan_iter("kvq:{r:*}:reply")), ""
    )
    got = [
        not is_empty(reply_of(r, raw_client(r), c.line.replace("laptop-1", worker), rid))
        for c in doc_claims()
    ]
    print(f"compose replay: {sum(got)} of {len(got)} redis-cli lines of docs/streams.md with data")


@pytest.mark.timeout(1200)
def test_compose_up_replayed_serves_and_its_workers_get_work(replay: Replay) -> None:
    rp = replay
    s = Settings(redis_url=rp.base["KVQ_REDIS_URL"], prefix=rp.base["KVQ_PREFIX"])
    board = open_board(s.bus, s.lifetimes)
    try:
        got = subprocess.run(
            [sys.executable, "-m", "kvq", *rp.args(SERVICES["model"]["command"])],
            env=rp.env("model"),
            capture_output=True,
            timeout=300,
        )
        assert got.returncode == 0 and rp.healthy("model"), got.stderr
        model = SERVICES["monitor"]["command"][2].split("=")[0]
        # after redis and model: the monitor and the workers (they wait for no monitor)
        rp.start("monitor")
        replicas = SERVICES["worker"]["deploy"]["replicas"]
        for i in range(replicas):
            rp.start("worker", i)
        rp.kids.wait_for(lambda: rp.healthy("monitor"), 300, "the monitor's healthcheck", 2)
        took = _cold_start_under_load(rp, board)
        print(f"compose replay: coordinator healthy {took:.1f}s after its start, every CPU busy")
        for i in range(replicas):
            assert rp.healthy("worker", i)
        rp.kids.wait_for(lambda: rp.healthy("api"), 60, "the api's healthcheck", 1)
        slices = len(board.model_info(model).slices)
        rp.kids.wait_for(
            lambda: len({v.slice_id for v in board.workers(model) if v.ready}) == slices,
            300,
            "the workers to cover every slice",
        )
        before = board.coord_stats("coord-1")
        assert before is not None
        errors = _burst_through_api(rp.api_port, 16, 32)
        assert not errors, errors[:3]
        after = board.coord_stats("coord-1")
        assert after is not None
        remote = after.remote_jobs - before.remote_jobs
        local = after.local_jobs - before.local_jobs
        print(f"compose replay burst: {remote} remote and {local} local expert jobs")
        assert remote > 0, f"the workers got no share of a burst ({local} local jobs)"
        _count_doc_lines(board, sorted(board.assignments(model))[0])
    finally:
        board.r.close()
