"""Stage grain end to end (X12), real processes on a real Redis: a monitor registers the model
at stage grain (KVQ_GRAIN=stage), `kvq worker` processes volunteer for layer spans, download
exactly their bytes and serve them whole; the coordinator keeps only the embedding and the
head. Concurrent greedy requests give `kvq generate`'s tokens, and a stage holder SIGKILLed
mid-request costs no request: its sequences move to the span's other holder, which rebuilds
their state by replaying their tokens."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

import pytest
from e2e_helpers import local_tokens

from kvq import client
from kvq.bus import connect
from kvq.bus.redis_board import RedisBoard, open_board
from kvq.config import Settings, child_env, load_settings
from kvq.keys import Keys
from kvq.local.procs import Children
from kvq.tools.synth import make_tiny

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "hello", "a b c d e f g"]


def _settings(url: str, prefix: str, **more: object) -> Settings:
    values: dict[str, object] = {"worker_max_slices": 1, "heartbeat_ttl_s": 2.0, **more}
    return load_settings(redis_url=url, prefix=prefix, grain="stage", stage_layers=2, **values)


def _register(kids: Children, board: RedisBoard, model_id: str, model: Path) -> None:
    kids.spawn("monitor", "monitor", "--model", f"{model_id}={model}")
    kids.wait_for(lambda: model_id in board.models(), 120, "registration")


def _coordinator(kids: Children, board: RedisBoard, model_id: str, model: Path) -> None:
    """Coordinator c1 of `model_id`, started once its workers hold what they will."""
    kids.spawn("coord", "coordinator", "--model", str(model), "--model-id", model_id, "--id", "c1")
    kids.wait_for(lambda: board.coordinator_alive("c1"), 120, "the coordinator")


def _held(board: RedisBoard, model_id: str) -> dict[str, set[str]]:
    """Stage sid -> the live, ready workers holding it."""
    out: dict[str, set[str]] = {}
    for v in board.workers(model_id):
        if v.alive and v.ready:
            out.setdefault(v.slice_id, set()).add(v.worker_id)
    return out


def _generate_all(s: Settings, model_id: str, n: int) -> dict[str, list[int]]:
    """Every prompt of PROMPTS at once (one engine batch), greedy, `n` tokens each."""
    got: dict[str, list[int]] = {}

    def one(prompt: str) -> None:
        r = connect(s.bus)
        try:
            got[prompt] = client.generate(
                r, Keys(s.prefix), model_id, prompt=prompt, max_tokens=n, timeout_s=240
            )
        finally:
            r.close()

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return got


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("arch", "variant", "cohorts"), [("deepseek2", "v3", 1), ("qwen35moe", "", 2)]
)
def test_a_chain_of_stage_workers_gives_local_generations_tokens(
    redis_server, tmp_path: Path, arch: str, variant: str, cohorts: int
) -> None:  # type: ignore[no-untyped-def]
    """`cohorts` 2 (KVQ_MICROBATCHES): two passes through the chain at once, each cohort
    sampling and starting its next pass while the other is on its way."""
    model = tmp_path / f"{arch}.gguf"
    make_tiny(model, arch=arch, variant=variant, layers=4, experts=8, seed=5)
    model_id = f"stage-{arch}"
    s = _settings(redis_server.url, f"st-{arch}", microbatches=cohorts)
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path))
    board = open_board(s.bus, s.lifetimes)
    try:
        _register(kids, board, model_id, model)
        info = board.model_info(model_id)
        assert info is not None and info.grain == "stage"
        assert [(sp.layer_start, sp.layer_end) for sp in info.stages()] == [(0, 2), (2, 4)]
        for w in ("w0", "w1"):
            kids.spawn(w, "worker", "--id", w)
        kids.wait_for(lambda: set(_held(board, model_id)) == set(info.slices), 300, "a chain")
        _coordinator(kids, board, model_id, model)
        got = _generate_all(s, model_id, 8)
        for p in PROMPTS:
            assert got.get(p) == local_tokens(model, p, 8), p
        # each worker holds one span: every token crossed both
        holders = _held(board, model_id)
        assert all(len(ws) == 1 for ws in holders.values())
        assert {w for ws in holders.values() for w in ws} == {"w0", "w1"}
        _each_stops_on_sigterm(kids, ("w0", "w1"))
    finally:
        kids.stop_all()


def _each_stops_on_sigterm(kids: Children, names: tuple[str, ...]) -> None:
    """Each of `names` SIGTERMed exits 0 within 3 s (a supervisor waits 5 s, then kills)."""
    for name in names:
        kids.procs[name].send_signal(signal.SIGTERM)
    for name in names:
        try:
            code = kids.procs[name].wait(3)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs 3 s after its SIGTERM") from None
        assert code == 0, f"{name} exited {code}"


def _kill_serving(kids: Children, board: RedisBoard, model_id: str, sid: str) -> str:
    """SIGKILL a holder of `sid` that has served (its heartbeat says so, within a beat or
    two of its first job); returns its id."""
    serving: list[str] = []

    def found() -> bool:
        serving[:] = [
            v.worker_id
            for v in board.workers(model_id)
            if v.slice_id == sid and v.alive and v.last_serve_ms > 0
        ]
        return bool(serving)

    kids.wait_for(found, 30, f"the holder of {sid} in use")
    # the sequence sticks to one holder of the span; a second serves it too while it is
    # witnessed there (a new holder's sequences are, `kvq.coordinator.stage_check`)
    kids.kill(serving[0])
    return serving[0]


@pytest.mark.timeout(600)
def test_sigkill_of_a_stage_holder_loses_no_request(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = tmp_path / "olmoe.gguf"
    make_tiny(model, arch="olmoe", layers=4, experts=8, seed=2)
    model_id = "stage-kill"
    s = _settings(redis_server.url, "st-kill", base_replicas=2, backbone_replicas=2)
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path))
    board = open_board(s.bus, s.lifetimes)
    try:
        _register(kids, board, model_id, model)
        info = board.model_info(model_id)
        assert info is not None
        for w in ("w0", "w1", "w2", "w3"):
            kids.spawn(w, "worker", "--id", w)

        def two_each() -> bool:
            held = _held(board, model_id)
            return set(held) == set(info.slices) and all(len(ws) == 2 for ws in held.values())

        kids.wait_for(two_each, 300, "two holders of every stage")
        _coordinator(kids, board, model_id, model)
        r = connect(s.bus)
        keys = Keys(s.prefix)
        n = 200
        stage1 = info.stages()[1].sid
        killed = ""
        try:
            rid = client.submit(r, keys, model_id, prompt=PROMPTS[0], max_tokens=n).request_id
            tokens: list[int] = []
            for ev in client.events(r, keys, rid, timeout_s=240):
                if ev.kind == "token" and ev.token_id is not None:
                    tokens.append(ev.token_id)
                if not killed and len(tokens) >= 4:  # mid-request: kill the holder it uses
                    killed = _kill_serving(kids, board, model_id, stage1)
                if ev.kind == "done":
                    break
        finally:
            r.close()
        assert killed and len(tokens) == n
        assert tokens == local_tokens(model, PROMPTS[0], n)
    finally:
        kids.stop_all()


@pytest.mark.timeout(600)
def test_consecutive_spans_on_one_holder_cost_one_job_a_step(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = tmp_path / "gpt-oss.gguf"
    make_tiny(model, arch="gpt-oss", layers=6, experts=8, seed=4, quant="mxfp4")
    model_id = "stage-one"
    s = _settings(redis_server.url, "st-one", worker_max_slices=0)
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path))
    board = open_board(s.bus, s.lifetimes)
    try:
        _register(kids, board, model_id, model)
        info = board.model_info(model_id)
        assert info is not None and len(info.stages()) == 3
        kids.spawn("w0", "worker", "--id", "w0")
        kids.wait_for(
            lambda: _held(board, model_id) == {sid: {"w0"} for sid in info.slices},
            300,
            "one worker holding every span",
        )
        _coordinator(kids, board, model_id, model)
        r = connect(s.bus)
        try:
            got = client.generate(
                r, Keys(s.prefix), model_id, prompt=PROMPTS[0], max_tokens=8, timeout_s=240
            )
        finally:
            r.close()
        assert got == local_tokens(model, PROMPTS[0], 8)
        # 8 engine steps (the prompt, then 7 decode steps), each one job through all 3 spans
        kids.wait_for(lambda: board.coord_stats("c1").remote_jobs >= 8, 60, "published stats")
        assert board.coord_stats("c1").remote_sent == 8
    finally:
        kids.stop_all()


@pytest.mark.timeout(300)
def test_a_span_no_live_worker_holds_ends_the_request_with_a_clear_error(
    redis_server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    model = tmp_path / "olmoe.gguf"
    make_tiny(model, arch="olmoe", layers=4, experts=8, seed=2)
    model_id = "stage-gap"
    s = _settings(redis_server.url, "st-gap", replica_wait_s=3.0)
    kids = Children(child_env(s) | {"OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path))
    board = open_board(s.bus, s.lifetimes)
    try:
        _register(kids, board, model_id, model)
        kids.spawn("w0", "worker", "--id", "w0")  # one span only (KVQ_WORKER_MAX_SLICES=1)
        kids.wait_for(lambda: len(_held(board, model_id)) == 1, 300, "one span held")
        _coordinator(kids, board, model_id, model)
        r = connect(s.bus)
        try:
            with pytest.raises(client.RequestFailed) as err:
                client.generate(
                    r, Keys(s.prefix), model_id, prompt="hi", max_tokens=4, timeout_s=120
                )
        finally:
            r.close()
        failure = err.value.failure
        assert failure is not None and failure.type == "NoReplica"
        assert "KVQ_REPLICA_WAIT_S" in failure.message and "stage" in failure.message
    finally:
        kids.stop_all()
