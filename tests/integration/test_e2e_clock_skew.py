"""Hosts whose clocks disagree by two minutes serve as one (liveness on Redis's clock).

Each role is a real process whose wall clock is 60 s off, one way or the other
(`skewed_clock/sitecustomize.py`): the coordinator on one side, the monitor, the worker and the
gateway on the other, then the reverse. Liveness, freshness, verdicts and job deadlines are on
Redis's clock (`kvq.bus.clock`), so every request is served through a worker (the coordinator
holds no experts), through `kvq.client` and the gateway, `kvq health` of each role passes from
a host 60 s off, and no job is refused as past its deadline.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import local_tokens

from kvq import client
from kvq.bus import connect
from kvq.bus.records import CoordStats, WorkerInfo
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.local.procs import Children

pytestmark = [pytest.mark.slow, pytest.mark.standalone]
MODEL, COORD, PROMPT, TOKENS = "tiny", "c1", "clocks that disagree", 6
SKEWED = str(Path(__file__).parent / "skewed_clock")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(base: dict[str, str], skew_s: float) -> dict[str, str]:
    path = os.pathsep.join(p for p in (SKEWED, base.get("PYTHONPATH", "")) if p)
    return base | {"PYTHONPATH": path, "SKEWED_CLOCK_S": str(skew_s)}


@pytest.fixture(params=[60.0, -60.0], ids=["coordinator-behind", "coordinator-ahead"])
def skew(request: pytest.FixtureRequest) -> float:
    """The others' skew; the coordinator's is its opposite."""
    return float(request.param)


@pytest.fixture
def system(
    settings: Settings, tiny_model: Path, tmp_path: Path, skew: float
) -> Iterator[tuple[Children, str, dict[str, str]]]:
    port = _free_port()
    s = settings.model_copy(
        update={"coordinator_experts": "none", "saturation_threshold": 1, "api_port": port}
    )
    base = child_env(s)
    kids = Children(base, log_dir=str(tmp_path / "logs"))
    r, keys = connect(s.bus), Keys(s.prefix)
    others = _env(base, skew)
    try:
        kids.spawn("monitor", "monitor", "--model", f"{MODEL}={tiny_model}", env=others)
        kids.wait_for(lambda: r.sismember(keys.models(), MODEL), 120, "registration")
        kids.spawn("w0", "worker", "--id", "w0", env=others)
        coord = ["coordinator", "--model", str(tiny_model), "--model-id", MODEL, "--id", COORD]
        kids.spawn("coord", *coord, env=_env(base, -skew))
        kids.spawn("api", "api", "--port", str(port), env=others)
        yield kids, f"http://127.0.0.1:{port}", others
    finally:
        r.close()
        kids.stop_all()


def _health(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kvq", "health", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_roles_60s_apart_serve_every_request_through_the_worker(
    system: tuple[Children, str, dict[str, str]], settings: Settings, tiny_model: Path
) -> None:
    kids, url, others = system
    r, keys = connect(settings.bus), Keys(settings.prefix)
    want = local_tokens(tiny_model, PROMPT, TOKENS)

    def served() -> bool:
        try:
            got = client.generate(r, keys, MODEL, prompt=PROMPT, max_tokens=TOKENS, timeout_s=20)
        except (client.RequestFailed, TimeoutError):
            return False
        assert got == want
        return True

    kids.wait_for(served, 180, "a first request served")
    for _ in range(3):
        assert served()
    kids.wait_for(lambda: _http_ok(url), 60, "the gateway")
    for _ in range(3):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
    for args in (
        ("coordinator", "--id", COORD),
        ("monitor", "--id", MODEL),
        ("worker", "--id", "w0"),
    ):
        done = _health(others, *args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    stats = CoordStats.from_hash(r.hgetall(keys.coord_stats(COORD)))
    info = WorkerInfo.from_hash(r.hgetall(keys.worker_info("w0")))
    assert stats is not None and info is not None
    assert stats.remote_jobs > 0 and info.served > 0
    assert stats.remote_errors == 0 and stats.fallback_jobs == 0, stats
    assert not kids.dead()
    r.close()


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
