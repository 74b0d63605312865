"""`kvq acl` prints the rules; `kvq acl --apply` then a whole deployment of `kvq` processes
(monitor, workers, coordinator, client, and `kvq api` with API keys and a per-key limit),
each logged in as its role's user: zero NOPERM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
from acl_helpers import denials
from e2e_helpers import local_tokens
from waiting import wait_for

from kvq.bus.redis_board import RedisBoard
from kvq.cli import main
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.local.server import free_port
from kvq.security import acl

LOADED = {"saturation_threshold": 1, "job_deadline_ms": 10_000, "dispatch_policy": "copies"}


def test_kvq_acl_prints_every_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["acl", "--prefix", "pp", "--worker", "gpu1"]) == 0
    out = capsys.readouterr().out
    for user in ("pp-monitor", "pp-coordinator", "pp-worker-gpu1", "pp-client", "pp-api"):
        assert f"ACL SETUSER {user} reset on" in out
    assert "'(~pp:{w:gpu1}:hb +set " in out and "><PASSWORD>" in out


def test_kvq_acl_refuses_an_unsafe_worker_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["acl", "--worker", "a*"]) == 2
    assert "not allowed" in capsys.readouterr().err


@pytest.mark.slow
def test_apply_then_a_whole_deployment_on_those_users(
    settings: Settings,
    r: redis.Redis,
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secrets = tmp_path / "acl.json"
    argv = [
        "acl",
        "--apply",
        settings.redis_url,
        "--prefix",
        settings.prefix,
        "--worker",
        "w0",
        "--worker",
        "w1",
        "--secrets",
        str(secrets),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    made = json.loads(secrets.read_text())
    assert all(s["password"] not in printed for s in made.values()), "passwords never printed"
    assert oct(secrets.stat().st_mode & 0o777) == "0o600"
    url = {s["role"] if s["role"] != "worker" else n: s["url"] for n, s in made.items()}
    # 2 slices: one per worker (one worker's budget would fit both)
    s = settings.model_copy(update={**LOADED, "slice_experts": 8, "worker_max_slices": 1})
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(role_url: str, *args: str) -> subprocess.Popen[bytes]:
        env = child_env(s, redis_url=role_url)
        with (tmp_path / f"{args[0]}-{len(procs)}.log").open("wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "kvq", *args], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        procs.append(p)
        return p

    try:
        spawn(url["monitor"], "monitor", "--model", f"tiny={tiny_model}")
        for w in ("w0", "w1"):
            spawn(url[f"{settings.prefix}-worker-{w}"], "worker", "--id", w)
        spawn(url["coordinator"], "coordinator", "--model", str(tiny_model), "--model-id", "tiny")
        keys = Keys(s.prefix)
        board = RedisBoard(r, keys, s.lifetimes)

        def up() -> bool:  # both workers serving (their beat says so), the coordinator's slots
            assert all(p.poll() is None for p in procs), _logs(tmp_path)
            coord = keys.coord_slots("coord-" + __import__("socket").gethostname())
            return sum(v.alive and v.ready for v in board.workers("tiny")) == 2 and bool(
                r.exists(coord)
            )

        wait_for(up, 120, "two serving workers and the coordinator", poll_s=0.2)
        env = child_env(s, redis_url=url["client"])
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvq",
                "submit",
                "--model",
                "tiny",
                "--prompt",
                "acl",
                "--max-tokens",
                "6",
                "--json",
                "--timeout",
                "90",
            ],
            env=env,
            capture_output=True,
            timeout=150,
        )
        assert out.returncode == 0, out.stderr.decode() + _logs(tmp_path)
        got = json.loads(out.stdout)
        assert got["token_ids"] == local_tokens(tiny_model, "acl", 6)
        _keyed_api_under_its_user(s, url["api"], tmp_path, procs)
        assert denials(r, settings.prefix) == [], _logs(tmp_path)
        assert "NOPERM" not in _logs(tmp_path)
        assert "disabled ACL user" not in _logs(tmp_path), "honest workers within quota"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        acl.remove(r, made)


def _keyed_api_under_its_user(
    s: Settings, api_url: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """`kvq api` as the `P-api` user with API keys and KVQ_API_KEY_RPM=2: two calls of a key
    are served, its third is 429 (the per-key counter works under the ACL), another key's call
    is served."""
    port = free_port()
    keys = "key-aaaaaaaa-1,key-bbbbbbbb-2"
    env = child_env(s, redis_url=api_url, api_port=port, api_keys=keys, api_key_rpm=2)
    with (tmp_path / "api.log").open("wb") as log:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "kvq", "api"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        )
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert procs[-1].poll() is None, _logs(tmp_path)
        return httpx.get(base + "/health", timeout=2).status_code == 200

    wait_for(healthy, 60, "kvq api to start", poll_s=0.2, ignore=httpx.HTTPError)

    def call(key: str) -> httpx.Response:
        return httpx.post(
            base + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "prompt": "acl", "max_tokens": 3},
            timeout=60,
        )

    got = [call("key-aaaaaaaa-1").status_code for _ in range(3)]
    assert got == [200, 200, 429], _logs(tmp_path)
    assert call("key-bbbbbbbb-2").status_code == 200, _logs(tmp_path)
    streamed = httpx.post(
        base + "/v1/completions",
        headers={"Authorization": "Bearer key-bbbbbbbb-2"},
        json={"model": "tiny", "prompt": "acl", "max_tokens": 3, "stream": True},
        timeout=60,
    )
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text, _logs(tmp_path)


def _logs(d: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in d.glob("*.log")
    )
