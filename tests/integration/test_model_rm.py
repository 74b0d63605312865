"""`kvq model rm` against real processes: a monitor and a worker serving a model; the removal
deletes every key of it but its removal mark, the monitor stops watching it without
publishing it again, and the worker stops serving its slices without re-asserting them (its
beats would bring the coverage back otherwise); both keep running. Registering it again
serves it again. Forced while a coordinator serves it, the coordinator ends its requests with
an error and exits, leaving nothing of the model behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvq import client
from kvq.bus import connect
from kvq.bus.redis_board import open_board
from kvq.config import Settings, child_env
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.monitor.registration import remove

MODEL = "tiny"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rm_with_a_live_monitor_and_worker(
    settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    s = settings.model_copy(update={"slice_experts": 8})  # two slices: one a layer
    env = child_env(s)
    kids = Children(env, log_dir=str(tmp_path / "logs"))
    r, keys = connect(s.bus), Keys(s.prefix)

    def model_keys() -> list[str]:
        return sorted(k.decode() for k in r.scan_iter(match=f"{s.prefix}:{{m:{MODEL}}}:*"))

    def log(name: str) -> str:
        return (tmp_path / "logs" / f"{name}.log").read_text()

    try:
        kids.spawn("monitor", "monitor", "--model", f"{MODEL}={tiny_model}")
        kids.spawn("w0", "worker", "--id", "w0")
        kids.wait_for(lambda: r.hlen(keys.model_workers(MODEL)) == 1, 120, "w0 holds a slice")
        kids.wait_for(lambda: "serving tiny" in log("w0"), 120, "w0 serving")
        rm = subprocess.run(
            [sys.executable, "-m", "kvq", "model", "rm", MODEL],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert rm.returncode == 0, rm.stderr
        assert "removed tiny" in rm.stdout and "from 1 worker(s)" in rm.stdout, rm.stdout
        kids.wait_for(
            lambda: "model tiny was removed" in log("w0") and "no longer watched" in log("monitor"),
            60,
            "the worker and the monitor to see the removal",
        )
        # w0 beats as an idle worker again (it volunteers, finds nothing): its loop ran after
        # the drop, and nothing of the model came back
        kids.wait_for(lambda: r.hget(keys.worker_info("w0"), "state") == b"idle", 60, "w0 idle")
        assert model_keys() == [keys.model_removed(MODEL)]
        assert not r.sismember(keys.models(), MODEL)
        assert not kids.dead()
        kids.spawn("monitor-2", "monitor", "--model", f"{MODEL}={tiny_model}", "--id", "m2")
        kids.wait_for(lambda: r.hlen(keys.model_workers(MODEL)) >= 1, 120, "served again")
        assert not r.exists(keys.model_removed(MODEL))
    finally:
        kids.stop_all()
        r.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rm_force_with_a_live_coordinator(
    settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    """`kvq model rm --force` while a coordinator generates a request of the model: the
    request ends with a `ModelRemoved` error, the coordinator exits (code 1, saying why) and
    leaves none of the model's keys behind (only the removal mark stays); the monitor runs on."""
    s = settings.model_copy(update={"slice_experts": 8})
    env = child_env(s)
    kids = Children(env, log_dir=str(tmp_path / "logs"))
    board = open_board(s.bus, s.lifetimes)
    r, keys = board.r, Keys(s.prefix)

    def rm(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvq", "model", "rm", MODEL, *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        kids.spawn("monitor", "monitor", "--model", f"{MODEL}={tiny_model}")
        kids.wait_for(lambda: MODEL in board.models(), 120, "the registration")
        coord = kids.spawn(
            "c1", "coordinator", "--model", str(tiny_model), "--model-id", MODEL, "--id", "c1"
        )
        kids.wait_for(lambda: board.coordinator_alive("c1"), 120, "the coordinator")
        refused = rm()
        assert refused.returncode == 1 and "ModelInUse" in refused.stderr, refused.stderr
        rid = client.send(r, keys, MODEL, prompt="hello", max_tokens=400)
        events = client.events(r, keys, rid, 120)
        assert next(events).kind == "token", "it is generating"
        # what `kvq model rm --force` calls, here without a process start: the request is
        # still being generated
        gone = remove(board, MODEL, force=True)
        assert gone.coordinators == ["c1"], gone
        with pytest.raises(client.RequestFailed) as failed:
            for _ in events:
                pass
        assert failed.value.failure is not None and failed.value.failure.type == "ModelRemoved"
        assert coord.wait(60) == 1
        kids.procs.pop("c1")
        log = (tmp_path / "logs" / "c1.log").read_text()
        assert "ModelRemoved: model 'tiny' was removed" in log, log[-2000:]
        left = sorted(k.decode() for k in r.scan_iter(match=f"{s.prefix}:{{m:{MODEL}}}:*"))
        assert left == [keys.model_removed(MODEL)]
        assert not kids.dead(), "the monitor runs on"
    finally:
        kids.stop_all()
        r.close()
