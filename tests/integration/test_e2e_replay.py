"""Issue 12 items 2 and 3 on a real Redis: a duplicate request id is refused without touching
the first request's stream; a coordinator SIGKILLed mid-request and restarted (or taken over by
another) streams no token twice and the completion equals local generation; a request whose
runs keep dying is dead-lettered with an error event after `KVQ_MAX_ATTEMPTS` runs."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from e2e_helpers import ids_on_every_shard, local_tokens, wait_for

from kvq import client, wire
from kvq.config import Settings, child_env
from kvq.coordinator import Coordinator
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.monitor import Monitor

PROMPT = "the same words again"


def raw_events(r, keys: Keys, rid: str) -> list[wire.ReplyEvent]:  # type: ignore[no-untyped-def]
    return [wire.decode(f, wire.ReplyEvent) for _, f in r.xrange(keys.request_reply(rid))]


def test_a_duplicate_request_id_is_refused_and_the_first_is_untouched(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    r, keys = mon.board.r, Keys(settings.prefix)
    first = client.submit(r, keys, "tiny", prompt=PROMPT, max_tokens=24, request_id="dup")
    second = client.submit(r, keys, "tiny", prompt="other words", max_tokens=24, request_id="dup")
    run_in_thread(coord)
    got = [
        ev.token_id
        for ev in client.events(r, keys, "dup", 60, first.entry)
        if ev.token_id is not None
    ]
    assert got == local_tokens(tiny_model, PROMPT, 24), "the first request's tokens only"
    with pytest.raises(client.RequestFailed, match="duplicate request id"):
        list(client.events(r, keys, "dup", 10, second.entry))
    on_stream = raw_events(r, keys, "dup")
    assert {ev.entry for ev in on_stream} == {first.entry, second.entry}
    assert [ev.kind for ev in on_stream if ev.entry == second.entry] == ["error"]
    tokens = [ev for ev in on_stream if ev.kind == "token"]
    assert [ev.index for ev in tokens] == list(range(24)), "no interleaved second generation"


def _coordinator_args(model: Path, coord_id: str) -> list[str]:
    return ["coordinator", "--model-id", "tiny", "--model", str(model), "--id", coord_id]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("how", "shards"), [("restart", 1), ("takeover", 1), ("takeover", 3)])
def test_a_killed_coordinator_s_requests_stream_each_token_once(
    settings: Settings, tiny_model: Path, tmp_path: Path, run_in_thread, how: str, shards: int
) -> None:
    """With 3 request shards, each request on its own: the dead coordinator held entries of
    every shard (one generating, the others delivered and held back), all taken over."""
    s = settings.model_copy(
        update={
            "n_slots": 1,
            "saturation_threshold": 1,
            "claim_idle_ms": 300,
            "request_shards": shards,
        }
    )
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    run_in_thread(mon)
    r, keys = mon.board.r, Keys(s.prefix)
    n_tokens, n_requests = 120, 3
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path / "logs"))
    try:
        kids.spawn("c1", *_coordinator_args(tiny_model, "c1"))
        ids = ids_on_every_shard(n_requests, shards, how)
        subs = [
            client.submit(
                r, keys, "tiny", prompt=f"{PROMPT} {i}", max_tokens=n_tokens, request_id=ids[i]
            )
            for i in range(n_requests)
        ]
        first = subs[0].request_id
        kids.wait_for(lambda: r.xlen(keys.request_reply(first)) >= 10, 60, "tokens streaming")
        kids.procs["c1"].send_signal(signal.SIGKILL)
        kids.procs["c1"].wait(10)
        del kids.procs["c1"]
        before = r.xlen(keys.request_reply(first))
        assert before < n_tokens, "killed mid-request"
        kids.spawn("c2", *_coordinator_args(tiny_model, "c1" if how == "restart" else "c2"))
        for i, (rid, entry) in enumerate(subs):
            want = local_tokens(tiny_model, f"{PROMPT} {i}", n_tokens)
            got = [
                ev.token_id
                for ev in client.events(r, keys, rid, 120, entry)
                if ev.token_id is not None
            ]
            assert got == want, f"request {i}: the completion equals local generation"
            on_stream = raw_events(r, keys, rid)
            indices = [ev.index for ev in on_stream if ev.kind == "token"]
            assert indices == list(range(n_tokens)), f"request {i}: no token written twice"
            (done,) = [ev for ev in on_stream if ev.kind == "done"]
            assert done.index == n_tokens
        replayed = raw_events(r, keys, first)
        assert {ev.attempt for ev in replayed} == {1, 2}, "the first request ran twice"
        assert [ev.attempt for ev in replayed][before:] == [2] * (len(replayed) - before)
    finally:
        kids.stop_all()


def test_a_request_whose_runs_keep_dying_is_dead_lettered(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    """Each run is stopped without acking (as a crash leaves it); the run after the cap is not
    started: a dead letter and an error event."""
    s = settings.model_copy(update={"max_attempts": 2})
    mon = Monitor.from_settings(s)
    mon.register("tiny", tiny_model)
    r, keys = mon.board.r, Keys(s.prefix)
    rid, entry = client.submit(r, keys, "tiny", prompt=PROMPT, max_tokens=400)
    for attempt in (1, 2):
        coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
        coord.tick()  # admits it (one run) and computes the first token
        assert [seq.attempt for seq in coord.engine.active] == [attempt]
        coord.board.r.close()  # "crashes": nothing acked, the entry stays pending
    coord = Coordinator.from_settings(s, "c1", "tiny", tiny_model)
    coord.tick()
    coord.board.r.close()
    assert not coord.engine.active, "not started a third time"
    try:
        with pytest.raises(client.RequestFailed, match="KVQ_MAX_ATTEMPTS"):
            list(client.events(r, keys, rid, 10, entry))
        dead = wait_for(lambda: r.xrange(keys.deadletter()), what="the dead letter")
        assert any(b"KVQ_MAX_ATTEMPTS" in f[b"reason"] for _, f in dead)
        assert r.xlen(keys.model_requests("tiny")) == 0, "acked and deleted"
    finally:
        r.close()


def test_reply_filter_skips_replays_stale_runs_and_other_entries() -> None:
    def tok(i: int, attempt: int, entry: str = "1-0") -> wire.ReplyEvent:
        return wire.ReplyEvent(kind="token", index=i, token_id=i, attempt=attempt, entry=entry)

    f = client.ReplyFilter("1-0")
    seen = [
        ev.index
        for ev in [
            tok(0, 1),
            tok(1, 1),
            tok(0, 2),
            tok(2, 1),
            tok(1, 2),
            tok(2, 2),
            tok(3, 2),
            tok(3, 1),
            tok(4, 2, "9-0"),
            tok(4, 2),
        ]
        if f.accept(ev)
    ]
    assert seen == [0, 1, 2, 3, 4]
    old = client.ReplyFilter()  # v2 events carry neither attempt nor entry: all pass in order
    assert all(old.accept(wire.ReplyEvent(kind="token", index=i)) for i in range(3))


def test_a_lost_run_record_does_not_restart_the_run_count(
    settings: Settings, tiny_model: Path, run_in_thread
) -> None:
    """Issue 29: Redis lost `P:{r:R}:run` of a request in its second run; the next run is
    numbered from the runs its reply stream shows (3), not 1, so readers (who ignore a run
    numbered below one they saw) follow it, and it replays what was streamed."""
    mon = Monitor.from_settings(settings)
    mon.register("tiny", tiny_model)
    r, keys = mon.board.r, Keys(settings.prefix)
    rid, entry = client.submit(r, keys, "tiny", prompt=PROMPT, max_tokens=40)
    for run in (1, 2):  # two runs die mid-request (their coordinator stops ticking)
        coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
        while sum(ev.kind == "token" for ev in raw_events(r, keys, rid)) < 6 * run:
            coord.tick()
        coord.board.r.close()
    assert {ev.attempt for ev in raw_events(r, keys, rid)} == {1, 2}
    r.delete(keys.request_run(rid))
    coord = Coordinator.from_settings(settings, "c1", "tiny", tiny_model)
    run_in_thread(coord)
    got = [ev.token_id for ev in client.events(r, keys, rid, 60, entry) if ev.token_id is not None]
    assert got == local_tokens(tiny_model, PROMPT, 40)
    on_stream = raw_events(r, keys, rid)
    assert [ev.index for ev in on_stream if ev.kind == "token"] == list(range(40))
    assert on_stream[-1].kind == "done" and on_stream[-1].attempt == 3
