"""A coordinator that holds only the backbone (issue 33 item 3), on a real Redis with worker
processes: the same greedy tokens as `kvq generate` on the full file, and a clear error
within `KVQ_REPLICA_WAIT_S` when no worker serves a slice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import wait_for, wait_ready

from kvq import client
from kvq.client import RequestFailed
from kvq.config import Settings, child_env
from kvq.coordinator import Coordinator
from kvq.errors import ConfigError, ModelMismatch
from kvq.gguf.split import write_backbone
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow

LIAR = Path(__file__).with_name("liar_worker.py")
PROMPTS = ("backbone only", "experts live elsewhere")
TOKENS = 12


@pytest.fixture(scope="module")
def backbone(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("backbone") / "tiny-backbone.gguf"
    write_backbone(tiny_model, out)
    return out


def _generate(model: Path, prompt: str) -> list[int]:
    """`kvq generate --json` on `model`, as a user runs it."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvq",
            "generate",
            "--model",
            str(model),
            "--prompt",
            prompt,
            "--max-tokens",
            str(TOKENS),
            "--json",
        ],
        capture_output=True,
        check=True,
        timeout=120,
    )
    ids: list[int] = json.loads(out.stdout)["token_ids"]
    return ids


def test_backbone_coordinator_and_two_half_workers_match_generate(
    settings: Settings, tiny_model: Path, backbone: Path, run_in_thread, tmp_path: Path
) -> None:
    s = settings.model_copy(
        update={
            "slice_experts": 4,
            "worker_max_slices": 2,  # 4 slices: two workers, two slices each
            "job_deadline_ms": 10_000,
            "replica_wait_s": 30.0,
        }
    )
    keys = Keys(s.prefix)
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", tiny_model)  # the full file: the workers' source
    assert len(info.slices) == 4
    run_in_thread(mon)
    kids = Children(child_env(s), log_dir=str(tmp_path))
    try:
        for i in range(2):
            kids.spawn(f"w{i}", "worker", "--id", f"w{i}")
        wait_ready(mon, "tiny", 4, 120)  # one view per (worker, slice)
        held: dict[str, set[str]] = {}
        for v in mon.board.workers("tiny"):
            held.setdefault(v.worker_id, set()).add(v.slice_id)
        assert sorted(len(sids) for sids in held.values()) == [2, 2], held
        assert set().union(*held.values()) == set(info.slices), "together they hold every slice"
        coord = Coordinator.from_settings(s, "c1", "tiny", backbone)
        assert coord.bank is None and not coord.dispatch.has_experts
        assert coord.backbone.experts == {}
        run_in_thread(coord)
        r = mon.board.r
        for prompt in PROMPTS:
            rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=TOKENS)
            got = [e.token_id for e in client.events(r, keys, rid, 120) if e.token_id is not None]
            assert got == _generate(tiny_model, prompt), prompt
        st = coord.dispatch.stats
        assert st.local_jobs == 0 and st.fallback_jobs == 0, "nothing computed here"
        assert st.remote_jobs > 0 and set(coord.dispatch.per_worker) == {"w0", "w1"}
        assert st.verified == 0, "nothing here can recompute a worker's result"
    finally:
        kids.stop_all()


def test_no_worker_ends_with_a_clear_error_within_the_wait(
    settings: Settings, tiny_model: Path, backbone: Path, run_in_thread
) -> None:
    wait_s = 2.0
    s = settings.model_copy(update={"replica_wait_s": wait_s})
    keys = Keys(s.prefix)
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)  # registered, but no worker ever starts
    coord = Coordinator.from_settings(s, "c1", "tiny", backbone)
    run_in_thread(coord)
    r = mon.board.r
    t0 = time.monotonic()
    rid = client.send(r, keys, "tiny", prompt="nobody home", max_tokens=4)
    tokens = []
    with pytest.raises(RequestFailed) as caught:
        for ev in client.events(r, keys, rid, 60):
            tokens.append(ev)
    took = time.monotonic() - t0
    failure = caught.value.failure
    assert failure is not None and failure.type == "NoReplica"
    assert "KVQ_REPLICA_WAIT_S" in failure.message and "no routed experts" in failure.message
    assert tokens == [], "no token is made up"
    assert wait_s <= took < wait_s + 15, took
    assert r.xpending(keys.model_requests("tiny"), "coordinators")["pending"] == 0
    # the coordinator goes on serving: the next request waits and fails the same way
    rid = client.send(r, keys, "tiny", prompt="again", max_tokens=2)
    with pytest.raises(RequestFailed, match="KVQ_REPLICA_WAIT_S"):
        list(client.events(r, keys, rid, 60))


def test_backbone_refuses_all_experts_and_another_source(
    settings: Settings, tiny_model: Path, backbone: Path, tmp_path: Path
) -> None:
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    with pytest.raises(ConfigError, match="backbone file without routed experts"):
        Coordinator.from_settings(
            settings.model_copy(update={"coordinator_experts": "all"}), "c1", "tiny", backbone
        )
    other = tmp_path / "other.gguf"
    make_tiny(other, layers=2, experts=8, experts_used=2, hidden=128, seed=3)
    other_bb = tmp_path / "other-backbone.gguf"
    write_backbone(other, other_bb)
    with pytest.raises(ModelMismatch, match="was not split from the file registered"):
        Coordinator.from_settings(settings, "c2", "tiny", other_bb)


def _replicated(
    settings: Settings,
    tiny_model: Path,
    run_in_thread,
    tmp_path: Path,
    replicas: int,
    **more: object,
) -> tuple[Settings, Keys, Monitor, Children]:
    """The tiny model in 2 slices of `replicas` copies each, registered, its monitor running;
    the workers are the test's to start (`kids`)."""
    s = settings.model_copy(
        update={
            "slice_experts": 8,
            "base_replicas": replicas,
            "worker_max_slices": 2,
            "replica_wait_s": 30.0,
            **more,
        }
    )
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    run_in_thread(mon)
    return s, Keys(s.prefix), mon, Children(child_env(s), log_dir=str(tmp_path))


def test_a_stopped_replica_jobs_go_to_the_other_one(
    settings: Settings, tiny_model: Path, backbone: Path, run_in_thread, tmp_path: Path
) -> None:
    """Two workers hold every slice; the one in use is SIGSTOPped mid-request: its jobs miss
    their deadline and are sent again to the other replica, the tokens stay those of
    `generate`."""
    s, keys, mon, kids = _replicated(
        settings, tiny_model, run_in_thread, tmp_path, 2, job_deadline_ms=1500, heartbeat_ttl_s=30.0
    )
    try:
        for i in range(2):
            kids.spawn(f"w{i}", "worker", "--id", f"w{i}")
        wait_ready(mon, "tiny", 4, 120)  # 2 slices x 2 replicas
        coord = Coordinator.from_settings(s, "c1", "tiny", backbone)
        run_in_thread(coord)
        r = mon.board.r
        prompt = "stop one replica"
        want = _generate(tiny_model, prompt)
        rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=TOKENS)
        events = client.events(r, keys, rid, 120)
        got = [next(events).token_id]  # the first token: both replicas were live
        served = coord.dispatch.per_worker
        victim = max(served, key=lambda w: served[w])  # the route uses it: its next job misses
        os.kill(kids.procs[victim].pid, signal.SIGSTOP)
        got += [e.token_id for e in events if e.token_id is not None]
        assert got == want
        st = coord.dispatch.stats
        assert st.local_jobs == 0 and st.fallback_jobs == 0
        assert st.remote_sent > st.remote_jobs, "some jobs were sent again"
    finally:
        for proc in kids.procs.values():
            os.kill(proc.pid, signal.SIGCONT)
        kids.stop_all()


def test_the_only_holder_killed_ends_the_request_within_the_wait(
    settings: Settings, tiny_model: Path, backbone: Path, run_in_thread, tmp_path: Path
) -> None:
    """One copy of each slice, on one worker, SIGKILLed mid-request while its heartbeat has
    a minute to live: the step's jobs are retried on it only until `KVQ_REPLICA_WAIT_S`
    after the first miss, then the request ends with NoReplica (no made-up token), not
    after the heartbeat expires."""
    wait_s, deadline_ms = 3.0, 1000
    s, keys, mon, kids = _replicated(
        settings,
        tiny_model,
        run_in_thread,
        tmp_path,
        1,
        job_deadline_ms=deadline_ms,
        heartbeat_ttl_s=60.0,
        replica_wait_s=wait_s,
    )
    try:
        kids.spawn("w0", "worker", "--id", "w0")
        wait_ready(mon, "tiny", 2, 120)
        coord = Coordinator.from_settings(s, "c1", "tiny", backbone)
        run_in_thread(coord)
        r = mon.board.r
        rid = client.send(r, keys, "tiny", prompt="the only holder", max_tokens=200)
        events = client.events(r, keys, rid, 120)
        assert next(events).token_id is not None
        kids.procs["w0"].kill()
        t0 = time.monotonic()
        with pytest.raises(RequestFailed) as caught:
            for _ in events:
                pass
        took = time.monotonic() - t0
        failure = caught.value.failure
        assert failure is not None and failure.type == "NoReplica", failure
        assert took < deadline_ms / 1000 * 3 + wait_s + 5, took  # not the heartbeat's 60 s
    finally:
        kids.stop_all()


def test_replicas_check_each_other_and_a_liar_is_outvoted(
    settings: Settings, tiny_model: Path, backbone: Path, run_in_thread, tmp_path: Path
) -> None:
    """Issue 32 item 5: three workers hold every slice, one of them (`liar_worker.py`) answers
    every job with noise. The backbone-only coordinator cannot recompute anything: it has each
    result drawn for a check confirmed by another holder (with the default trust schedule, all
    of a new worker's first 50), a third decides a disagreement. Every token equals
    `generate`'s, the liar is quarantined, and the honest ones serve on."""
    s, keys, mon, kids = _replicated(
        settings, tiny_model, run_in_thread, tmp_path, 3, job_deadline_ms=5000
    )
    try:
        for i in range(2):
            kids.spawn(f"w{i}", "worker", "--id", f"w{i}")
        with (tmp_path / "liar.log").open("wb") as out:
            kids.procs["liar"] = subprocess.Popen(
                [sys.executable, str(LIAR), "--id", "liar", "--garbage", "1"],
                env=kids.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_ready(mon, "tiny", 6, 120)  # 2 slices x 3 replicas
        coord = Coordinator.from_settings(s, "c1", "tiny", backbone)
        run_in_thread(coord)
        r = mon.board.r
        for prompt in PROMPTS:
            rid = client.send(r, keys, "tiny", prompt=prompt, max_tokens=TOKENS)
            got = [e.token_id for e in client.events(r, keys, rid, 120) if e.token_id is not None]
            assert got == _generate(tiny_model, prompt), prompt
        st = coord.dispatch.stats
        assert "liar" in mon.board.quarantined("tiny"), (tmp_path / "liar.log").read_text()[-2000:]
        assert st.witness_jobs > 0 and st.verified > 0 and st.mismatches >= 1
        assert st.local_jobs == 0, "nothing computed here"
        # its slices are taken from it (re-covered from the pool), the honest copies serve on
        wait_for(lambda: mon.board.held_by("tiny", "liar") == (), 15, "the liar's slices freed")
        assert mon.released_quarantined >= 1
        rid = client.send(r, keys, "tiny", prompt=PROMPTS[0], max_tokens=TOKENS)
        got = [e.token_id for e in client.events(r, keys, rid, 120) if e.token_id is not None]
        assert got == _generate(tiny_model, PROMPTS[0])
        print(
            f"witness jobs {st.witness_jobs}, confirmed {st.verified}, outvoted "
            f"{st.mismatches}, unresolved {st.unresolved}; used per worker "
            f"{coord.dispatch.per_worker}"
        )
    finally:
        kids.stop_all()
