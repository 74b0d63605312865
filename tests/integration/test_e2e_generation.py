"""Generation through remote workers on a real Redis equals all-local generation, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_helpers import ids_on_every_shard, local_tokens, start_with_worker, wait_for

from kvq import client
from kvq.config import Settings
from kvq.coordinator import Coordinator
from kvq.keys import Keys, request_streams
from kvq.monitor import Monitor
from kvq.worker import Worker

pytestmark = pytest.mark.slow
PROMPTS = ["hello world", "the quick brown fox", "MoE experts over Redis", "kvq"]


@pytest.mark.parametrize(("microbatches", "shards"), [(1, 1), (2, 1), (1, 3)])
def test_remote_generation_equals_local(
    settings: Settings, tiny_model: Path, run_in_thread, microbatches: int, shards: int
) -> None:
    # threshold 1: every step is "under load", so every covered slice goes remote
    s = settings.model_copy(
        update={
            "saturation_threshold": 1,
            "job_deadline_ms": 10_000,
            "dispatch_policy": "copies",  # whole copies: the tiny model's split would stay local
            "microbatches": microbatches,  # 2: layer calls of two micro-batches in flight at once
            "request_shards": shards,  # 3: the requests spread over three streams (issue 14)
            "worker_max_slices": 1,  # one worker per slice (one would fit every slice)
        }
    )
    keys = Keys(s.prefix)
    mon = Monitor.from_settings(s)
    info = mon.register("tiny", tiny_model)
    workers = [Worker.from_settings(s, f"w{i}") for i in range(len(info.slices))]
    for w in workers:
        run_in_thread(w)
    wait_for(lambda: all(w.holding for w in workers), what="coverage (every worker loaded)")
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    run_in_thread(coord)

    ids = ids_on_every_shard(len(PROMPTS), shards)
    rids = [
        client.send(mon.board.r, keys, "tiny", prompt=p, max_tokens=12, request_id=rid)
        for p, rid in zip(PROMPTS, ids, strict=True)
    ]
    got = {
        rid: [
            e.token_id for e in client.events(mon.board.r, keys, rid, 60) if e.token_id is not None
        ]
        for rid in rids
    }
    for rid, prompt in zip(rids, PROMPTS, strict=True):
        assert got[rid] == local_tokens(tiny_model, prompt, 12), prompt

    st = coord.dispatch.stats
    assert st.remote_jobs > 0 and st.fallback_jobs == 0 and st.remote_errors == 0
    assert st.remote_sent == st.remote_jobs
    assert sum(w.served for w in workers) >= st.remote_jobs
    assert all(w.served > 0 for w in workers), "every slice's worker took part"
    assert (coord.dispatch.stats.microbatched_steps > 0) == (microbatches > 1)
    streams = request_streams(keys, "tiny", shards)
    assert len(coord.requests.streams) == shards and coord.requests.streams == streams
    assert all(mon.board.r.xlen(st) == 0 for st in streams), "every shard answered and acked"


def test_at_rest_everything_is_local(settings: Settings, tiny_model: Path, run_in_thread) -> None:
    """K1: one request at a time never reaches the saturation threshold (2)."""
    mon, keys, _ = start_with_worker(settings, "tiny", tiny_model, run_in_thread)
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    ids = client.generate(mon.board.r, keys, "tiny", prompt="one at a time", max_tokens=6)
    assert ids == local_tokens(tiny_model, "one at a time", 6)
    assert coord.dispatch.stats.remote_sent == 0 and coord.dispatch.stats.local_jobs > 0


def test_bad_request_gets_error_event(settings: Settings, tiny_model: Path, run_in_thread) -> None:
    keys = Keys(settings.prefix)
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    rid = client.send(mon.board.r, keys, "tiny", prompt_ids=[1, 2, 99999], max_tokens=4)
    try:
        list(client.events(mon.board.r, keys, rid, 20))
        raise AssertionError("expected RequestFailed")
    except client.RequestFailed as exc:
        assert "prompt_ids" in str(exc)
    # garbage on the request stream is dead-lettered and the coordinator keeps serving
    mon.board.r.xadd(keys.model_requests("tiny"), {"t": "request", "m": b"\xc1garbage"})
    assert client.generate(mon.board.r, keys, "tiny", prompt="still alive", max_tokens=3)
    dl = mon.board.r.xrange(keys.deadletter())
    assert dl and b"undecodable" in dl[-1][1][b"reason"]


def test_requests_of_a_dead_coordinator_are_taken_over(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    from kvq.bus import Consumer
    from kvq.keys import COORDINATOR_GROUP

    s = settings.model_copy(update={"claim_idle_ms": 200})
    keys = Keys(s.prefix)
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    ghost = Consumer(mon.board.r, keys.model_requests("tiny"), COORDINATOR_GROUP, "ghost")
    rid = client.send(mon.board.r, keys, "tiny", prompt="orphan", max_tokens=4)
    assert len(ghost.read(1, None)) == 1  # taken by a coordinator that then died
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    got = [e.token_id for e in client.events(mon.board.r, keys, rid, 30) if e.token_id is not None]
    assert got == local_tokens(tiny_model, "orphan", 4)
    assert coord.intake.claimed == 1
