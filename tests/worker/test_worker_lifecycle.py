"""Worker life cycle on a real Redis: wind-down when demand falls (K10), back up when it rises."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from waiting import wait_for

from kvq.config import Settings
from kvq.keys import Keys
from kvq.monitor import Monitor
from kvq.quant.kernels import describe
from kvq.tools.synth import make_tiny
from kvq.worker import Worker


def test_idle_surplus_worker_leaves_and_last_one_stays(
    settings: Settings, tmp_path: Path, run_in_thread
) -> None:
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8)
    s = settings.model_copy(
        update={
            "slice_experts": 8,
            "base_replicas": 2,
            "idle_release_s": 0.3,
            "idle_shutdown_s": 0.3,
        }
    )
    keys = Keys(s.prefix)
    info = Monitor.from_settings(s).register("m", model)
    (sid,) = info.slices
    a, b = Worker.from_settings(s, "a"), Worker.from_settings(s, "b")
    ta, tb = run_in_thread(a), run_in_thread(b)
    wait_for(lambda: a.holding is not None and b.holding is not None)
    a.board.r.hset(keys.model_target("m"), sid, 1)  # load drained: one replica is enough
    wait_for(lambda: not ta.is_alive() or not tb.is_alive())
    assert a.board.r.hget(keys.model_coverage("m"), sid) == b"1"
    leaver, stayer = ("a", "b") if not ta.is_alive() else ("b", "a")
    assert a.board.r.hgetall(keys.model_workers("m")) == {stayer.encode(): sid.encode()}
    assert not a.board.r.exists(keys.worker_heartbeat(leaver)), "hb"
    assert not a.board.r.exists(keys.worker_inbox(leaver)), "inbox"
    import time

    time.sleep(1.0)  # a second of wind-down checks in which neither may leave
    assert (ta.is_alive(), tb.is_alive()).count(True) == 1, "the last replica stays"


def test_wind_down_releases_the_surplus_and_the_worker_comes_back_for_a_second_burst(
    settings: Settings, tmp_path: Path, run_in_thread
) -> None:
    """The default wind-down (KVQ_IDLE_SHUTDOWN_S=0): the surplus worker gives its slice back
    and stays, idle and beating; when the target rises again it takes the slice again."""
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8)
    s = settings.model_copy(update={"slice_experts": 8, "base_replicas": 2, "idle_release_s": 0.3})
    keys = Keys(s.prefix)
    info = Monitor.from_settings(s).register("m", model)
    (sid,) = info.slices
    a, b = Worker.from_settings(s, "a"), Worker.from_settings(s, "b")
    ta, tb = run_in_thread(a), run_in_thread(b)
    wait_for(lambda: a.holding is not None and b.holding is not None)
    r = a.board.r
    r.hset(keys.model_target("m"), sid, 1)  # the burst is over: base is one replica
    wait_for(lambda: (a.holding is None) != (b.holding is None))
    released = a if a.holding is None else b
    assert r.hget(keys.model_coverage("m"), sid) == b"1"
    assert not r.exists(keys.worker_inbox(released.id)), "its inbox went with the slice"
    assert released.server is None, "the slice's memory is freed"
    wait_for(lambda: r.exists(keys.worker_heartbeat(released.id)) == 1)  # idle beats
    assert ta.is_alive() and tb.is_alive(), "nobody exits with KVQ_IDLE_SHUTDOWN_S=0"
    r.hset(keys.model_target("m"), sid, 2)  # a second burst raises the target
    wait_for(lambda: released.holding is not None)
    assert r.hget(keys.model_coverage("m"), sid) == b"2"
    assert released.server is not None


def test_a_worker_says_what_it_is_doing_from_ready_to_stopped(
    settings: Settings, tmp_path: Path, run_in_thread, caplog: pytest.LogCaptureFixture
) -> None:
    """Its lines, in order: ready (with its kernels), the slice downloaded and warming up (with
    the kernel path), serving, and stopped (what it gave back)."""
    model = tmp_path / "m.gguf"
    make_tiny(model, layers=1, experts=8, quant="q4_k_m", hidden=256)
    s = settings.model_copy(update={"slice_experts": 8})
    Monitor.from_settings(s).register("m", model)
    w = Worker.from_settings(s, "talker")
    caplog.set_level(logging.INFO, logger="kvq.worker")
    t = run_in_thread(w)
    wait_for(lambda: w.holding is not None, 60, "a slice served")
    w.stop.set()
    t.join(timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvq.worker"]
    said = [next(i for i, m in enumerate(lines) if m.startswith(word)) for word in WORDS]
    assert said == sorted(said), lines
    kernels = describe("cpu")
    assert kernels in lines[said[0]] and lines[said[1]].endswith(f"warming up with {kernels}")
    assert (
        lines[said[3]]
        == "stopped: worker talker gave back 1 slice(s) after 0 job(s) served on them"
    )


WORDS = ("ready: worker talker", "downloaded m ", "serving m ", "stopped: worker talker")
