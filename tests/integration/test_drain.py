"""`kvq workers drain` against real processes: a monitor and two workers, the first holding
every slice of the model, the second idle (nothing wanted). Drained, the first gives its slices
back once its work is done (`Membership`, tested with work on its plate in
tests/worker/test_membership.py) and takes none again; the second takes them, so coverage
counts only it; the first keeps running (its heartbeat up, holding nothing), and the monitor
lists it as departed, drained by the operator. Released, it is a worker like any other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.bus.redis_board import open_board
from kvq.config import Settings, child_env
from kvq.local.procs import Children

MODEL = "tiny"


def _cli(env: dict[str, str], *argv: str) -> str:
    got = subprocess.run(
        [sys.executable, "-m", "kvq", *argv], env=env, capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0, got.stderr
    return got.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_drained_worker_s_slices_go_to_another_worker(
    settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    s = settings.model_copy(update={"slice_experts": 8})  # two slices: one a layer
    env = child_env(s)
    kids = Children(env, log_dir=str(tmp_path / "logs"))
    board = open_board(s.bus, s.lifetimes)

    def holders() -> dict[str, tuple[str, ...]]:
        return board.assignments(MODEL)

    try:
        kids.spawn("monitor", "monitor", "--model", f"{MODEL}={tiny_model}")
        kids.wait_for(lambda: MODEL in board.models(), 120, "the registration")
        slices = sorted(board.model_info(MODEL).slices)
        kids.spawn("w1", "worker", "--id", "w1")
        kids.wait_for(
            lambda: sorted(v.slice_id for v in board.workers(MODEL) if v.ready) == slices,
            120,
            "w1 serving every slice",
        )
        kids.spawn("w2", "worker", "--id", "w2")
        kids.wait_for(lambda: board.worker_alive("w2"), 60, "w2 beating (idle: nothing wanted)")
        assert set(holders()) == {"w1"}
        out = json.loads(_cli(env, "workers", "drain", "w1", "--by", "ops", "--json"))
        assert out == {"worker": "w1", "action": "drain", "models": [MODEL]}
        kids.wait_for(
            lambda: (
                set(holders()) == {"w2"}
                and sorted(v.slice_id for v in board.workers(MODEL) if v.ready) == slices
            ),
            120,
            "w2 serving every slice, w1 none",
        )
        assert {d.coverage for d in board.slice_demand(MODEL).values()} == {1}
        assert board.worker_alive("w1") and not kids.dead(), "w1 drained, not stopped"
        kids.wait_for(lambda: "w1" in board.departures(), 30, "w1 listed as departed")
        why = board.departures()["w1"].why
        assert why.startswith("drained by operator ops: its slices taken back"), why
        _cli(env, "workers", "release", "w1", "--by", "ops")
        assert not board.quarantined(MODEL)["w1"].drain
        assert set(holders()) == {"w2"}, "nothing wanted: w2 keeps them"
    finally:
        kids.stop_all()
        board.r.close()
