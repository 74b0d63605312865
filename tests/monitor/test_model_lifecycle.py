"""A model's lifecycle on a real Redis: `kvq model list`, `kvq model rm` (refused while a
coordinator serves it, every key gone, never restored by a monitor), registration again with
another file (its old slices given back), and a monitor that fails to start registers
nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from kvq.bus.records import CoordStats, SlotState
from kvq.cli import main
from kvq.config import Settings
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny


@pytest.fixture
def env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The in-process CLI reads the test's Redis and prefix."""
    monkeypatch.setenv("KVQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("KVQ_PREFIX", settings.prefix)
    return settings


def _tiny(tmp_path: Path, seed: int) -> Path:
    path = tmp_path / f"tiny-{seed}.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=seed)
    return path


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _model_keys(r: redis.Redis, prefix: str, model: str) -> list[str]:
    return sorted(k.decode() for k in r.scan_iter(match=f"{prefix}:{{m:{model}}}:*"))


def test_list_then_rm_refused_while_served_then_forced(
    env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mon = Monitor.from_settings(env)
    info = mon.register("tiny", _tiny(tmp_path, 1))
    board, keys = mon.board, Keys(env.prefix)
    sid = sorted(info.slices)[0]
    assert board.volunteer("tiny", "w1") is not None  # a worker holds a slice
    board.publish_slots(
        "c1", SlotState(model="tiny", busy=0, total=4, ts_ms=int(board.now_ms())), CoordStats()
    )
    board.r.xadd(keys.model_requests("tiny"), {"t": "x"})
    rows = _cli_json(capsys, "model", "list")
    assert rows == [
        {
            "model": "tiny",
            "source": info.source,
            "arch": "qwen3moe",
            "grain": "expert",
            "slices": len(info.slices),
            "covered": 1,
            "workers": 0,  # no heartbeat: assigned, not alive
            "coordinators": 1,
            "file_bytes": info.meta.file_size,
        }
    ]
    assert main(["model", "rm", "tiny"]) == 1
    err = capsys.readouterr().err
    assert "ModelInUse" in err and "c1" in err and "--force" in err, err
    assert board.models() == ["tiny"], "refused: nothing removed"
    got = _cli_json(capsys, "model", "rm", "tiny", "--force")
    assert got == {"model": "tiny", "workers": ["w1"], "coordinators": ["c1"]}
    assert board.models() == [] and board.assignments("tiny") == {}
    assert _model_keys(board.r, env.prefix, "tiny") == [keys.model_removed("tiny")]
    assert sid not in board.slice_demand("tiny")
    mon.tick()
    assert board.models() == [] and "tiny" not in mon.known, "the monitor never restores it"
    assert main(["model", "rm", "tiny"]) == 1
    assert "UnknownModel" in capsys.readouterr().err
    mon.register("tiny", _tiny(tmp_path, 1))  # registering again clears the removal
    assert board.models() == ["tiny"] and not board.model_removed("tiny")
    board.r.close()


def test_a_restore_racing_a_removal_is_undone_by_the_next_tick(
    env: Settings, tmp_path: Path
) -> None:
    mon = Monitor.from_settings(env)
    info = mon.register("tiny", _tiny(tmp_path, 1))
    board = mon.board
    board.unregister_model("tiny")
    assert not board.register_model(info, 1, restore=True), "a restore skips a removed model"
    board.r.sadd(Keys(env.prefix).models(), "tiny")  # as if a restore came just before
    mon.tick()
    assert board.models() == [] and "tiny" not in mon.known
    board.r.close()


def test_registering_another_file_gives_back_the_old_slices(env: Settings, tmp_path: Path) -> None:
    mon = Monitor.from_settings(env)
    mon.register("tiny", _tiny(tmp_path, 1))
    board = mon.board
    held = board.volunteer("tiny", "w1")
    assert held is not None and board.assignments("tiny") == {"w1": (held,)}
    mon.register("tiny", _tiny(tmp_path, 1))  # the same bytes: kept
    assert board.assignments("tiny") == {"w1": (held,)}
    mon.register("tiny", _tiny(tmp_path, 2))  # other weights: every slice changed
    assert board.assignments("tiny") == {}
    assert board.slice_demand("tiny")[held].coverage == 0
    board.r.close()


def test_a_monitor_whose_port_is_busy_registers_nothing(settings: Settings, tmp_path: Path) -> None:
    path = _tiny(tmp_path, 1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVQ_")}
        env |= {
            "KVQ_REDIS_URL": settings.redis_url,
            "KVQ_PREFIX": settings.prefix,
            "KVQ_HTTP_PORT": str(port),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "kvq", "monitor", "--model", f"tiny={path}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr
    r = redis.Redis.from_url(settings.redis_url)
    try:
        assert not r.smembers(Keys(settings.prefix).models())
        assert not _model_keys(r, settings.prefix, "tiny"), "no key of the model written"
    finally:
        r.close()
