"""Several monitors: one active through a lease in Redis, a standby takes over within the
lease after the active one is SIGKILLed, and reaping goes on (issue 12 item 5)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from waiting import wait_for

from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import Lifetimes
from kvq.bus.redis_board import open_board
from kvq.config import Settings, child_env, load_settings
from kvq.errors import ConfigError
from kvq.local.procs import Children
from kvq.tools.synth import make_tiny

LEASE_S = 1.0


def test_one_lease_holder_at_a_time_on_the_memory_board() -> None:
    board = MemoryBoard(Lifetimes(1.0, 10.0, 60.0))
    assert board.hold_lease("a", 0.2) and not board.hold_lease("b", 0.2)
    assert board.hold_lease("a", 0.2), "renewed by its holder"
    time.sleep(0.25)  # past the 0.2 s lease: the expiry is what is tested
    assert board.hold_lease("b", 0.2) and board.lease_holder() == "b", "expired: taken"
    board.drop_lease("a")  # not the holder: nothing happens
    assert board.lease_holder() == "b"
    board.drop_lease("b")
    assert board.lease_holder() is None


def test_a_lease_shorter_than_a_poll_is_refused() -> None:
    with pytest.raises(ConfigError, match="KVQ_MONITOR_LEASE_S|monitor_lease_s"):
        load_settings(monitor_poll_s=2.0, monitor_lease_s=1.0)


def test_the_standby_takes_over_when_the_active_monitor_is_killed(
    settings: Settings, tmp_path: Path
) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8)
    s = settings.model_copy(
        update={"monitor_lease_s": LEASE_S, "monitor_poll_s": 0.1, "slice_experts": 8}
    )
    board = open_board(s.bus, s.lifetimes)
    kids = Children(child_env(s), log_dir=str(tmp_path / "logs"))
    try:
        kids.spawn("m1", "monitor", "--id", "m1", "--model", f"m={model}")
        wait_for(lambda: board.lease_holder() == "m1", 60, "m1 to take the lease")
        kids.spawn("m2", "monitor", "--id", "m2", "--model", f"m={model}")
        log = tmp_path / "logs" / "m2.log"
        wait_for(lambda: log.exists() and "stands by" in log.read_text(), 60, "m2 to stand by")
        assert board.lease_holder() == "m1", "the active monitor keeps its lease"
        kids.procs["m1"].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: board.lease_holder() == "m2", 10, "m2 to take over")
        took_s = time.monotonic() - t0
        assert took_s <= LEASE_S + 1.0, f"took {took_s:.2f}s for a {LEASE_S}s lease"
        # the new active monitor reaps: a worker that holds the slice but never beats
        (sid,) = board.model_info("m").slices  # type: ignore[union-attr]
        board.rejoin("m", "ghost", sid)
        wait_for(lambda: "ghost" not in board.assignments("m"), 10, "the ghost to be reaped")
    finally:
        kids.stop_all()
        board.r.close()
