"""`kvq health` (the compose healthchecks) on a real Redis, and compose.yaml's healthchecks and
published metrics port (issue 12 item 12)."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import pytest
import yaml

from kvq.bus.records import CoordStats, ModelState, SlotState, WorkerInfo
from kvq.bus.redis_board import open_board
from kvq.cli import build_parser, main
from kvq.config import Settings
from kvq.gguf.registry import plan_model
from kvq.tools.synth import make_tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in list(os.environ):
        if name.startswith("KVQ_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("KVQ_PREFIX", settings.prefix)
    return settings


def health(*args: str) -> int:
    return main(["health", *args])


def test_each_role_is_healthy_only_while_alive(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    board = open_board(env.bus, env.lifetimes)
    assert health("redis") == 0
    assert health("coordinator", "--id", "c1") == 1
    assert "unhealthy: coordinator c1" in capsys.readouterr().out
    stale = int(time.time() * 1000) - int(env.lifetimes.slot_state_stale_s * 1000) - 1000
    board.publish_slots("c1", SlotState(model="m", busy=0, total=4, ts_ms=stale), CoordStats())
    assert health("coordinator", "--id", "c1") == 1, "stale slot state is a dead coordinator"
    now = int(time.time() * 1000)
    board.publish_slots("c1", SlotState(model="m", busy=0, total=4, ts_ms=now), CoordStats())
    assert health("coordinator", "--id", "c1") == 0

    assert health("worker", "--id", "w1") == 1
    capsys.readouterr()
    slow = "float32 (no int8 kernel: none installed, no compiler)"
    board.beat("w1", WorkerInfo(model="", slice="", device="cpu", state="idle", kernels=slow))
    assert health("worker", "--id", "w1") == 0
    assert f"ok: worker w1 heartbeats (kernels: {slow})" in capsys.readouterr().out
    board.forget_worker("w1")
    assert health("worker", "--id", "w1") == 1

    gguf = tmp_path / "m.gguf"
    make_tiny(gguf, layers=2, experts=8)
    assert health("monitor", "--id", "m") == 1
    board.register_model(plan_model("m", gguf, 1, 4), 1)
    assert health("monitor", "--id", "m") == 1, "registered, but no monitor tick yet"
    board.publish_model_state("m", ModelState(ts_ms=int(time.time() * 1000)))
    assert health("monitor", "--id", "m") == 0
    board.r.close()


def test_an_unreachable_redis_is_unhealthy(
    env: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVQ_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("KVQ_SOCKET_TIMEOUT_S", "0.5")
    monkeypatch.setenv("KVQ_RECONNECT_MAX_S", "0.1")
    assert health("redis") == 1
    assert "unhealthy: redis:" in capsys.readouterr().out


def test_compose_has_healthchecks_and_publishes_metrics() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    default = {n for n, svc in services.items() if "profiles" not in svc}
    assert default == {"redis", "model", "monitor", "coordinator", "worker", "api"}
    parser = build_parser()
    for name, svc in services.items():
        check = svc.get("healthcheck", {}).get("test")
        assert check, f"service {name} has no healthcheck"
        if check[:2] == ["CMD", "kvq"]:
            parser.parse_args(check[2:])  # a real kvq command line (SystemExit if not)
    mon = services["monitor"]
    port = mon["environment"]["KVQ_HTTP_PORT"]
    assert any(p.endswith(f":{port}:{port}") for p in mon["ports"]), mon["ports"]
    assert mon["environment"]["KVQ_HTTP_HOST"] == "0.0.0.0"
    assert mon["environment"]["KVQ_REDIS_URL"] == compose["x-kvq"]["environment"]["KVQ_REDIS_URL"]
    api = services["api"]  # the gateway on the host's loopback, checked on its own port
    args = build_parser().parse_args(api["command"])
    assert api["ports"] == [f"127.0.0.1:{args.port}:{args.port}"] and args.host == "0.0.0.0"
    assert api["environment"]["KVQ_API_PORT"] == str(args.port)
    assert api["healthcheck"]["test"] == ["CMD", "kvq", "health", "api"]
    assert all(p.startswith("127.0.0.1:") for s in services.values() for p in s.get("ports", []))
    coord = services["coordinator"]
    ident = coord["command"][coord["command"].index("--id") + 1]
    assert shlex.join(coord["healthcheck"]["test"]).endswith(f"--id {ident}")


def test_compose_gpu_profile_runs_a_worker_that_asks_for_the_gpu() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["command"] == ["worker"]
    assert gpu["environment"]["KVQ_DEVICE"] == "cuda"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    dockerfile = (ROOT / gpu["build"]["dockerfile"]).read_text()
    for arg in gpu["build"]["args"]:
        assert f"ARG {arg}=" in dockerfile, f"{arg} is no build argument of the Dockerfile"
    assert gpu["image"] != services["worker"].get("image", "kvq:local")


@pytest.mark.parametrize("role", ["redis", "coordinator"])
def test_a_port_that_never_answers_fails_within_the_socket_timeout(
    env: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], role: str
) -> None:
    """It accepts connections and never answers: one try, no retries, no blocking read."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.listen(16)
        monkeypatch.setenv("KVQ_REDIS_URL", f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        monkeypatch.setenv("KVQ_SOCKET_TIMEOUT_S", "1")
        t0 = time.monotonic()
        assert health(role) == 1
        took = time.monotonic() - t0
    assert took < 4.0, f"kvq health {role} took {took:.1f}s against a silent port"
    assert capsys.readouterr().out.startswith("unhealthy: redis")
