"""A worker's membership on both boards: volunteering, holding, heartbeats, giving back,
retiring (K10) and leaving (K9)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from boards import BoardCase, make_case
from waiting import wait_for

from kvq.bus import operator
from kvq.bus.board import Board
from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import Lifetimes, WorkerInfo
from kvq.catalog import ModelInfo
from kvq.gguf.registry import plan_model
from kvq.machine import cpus, cpus_text, machine_id
from kvq.swarm import WorkerView
from kvq.tools.synth import make_tiny
from kvq.worker.membership import Held, Membership

SHORT_TTL_S = 0.5  # beats every ~0.17 s


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("member") / "m.gguf"
    make_tiny(path, layers=1, experts=8)
    return path


def _register(board: Board, gguf: Path, base_replicas: int = 0) -> list[str]:
    """Model "m" with two slices (1 layer x 4 experts), sorted."""
    info: ModelInfo = plan_model("m", gguf, 1, 4)
    board.register_model(info, base_replicas)
    assert len(info.slices) == 2
    return sorted(info.slices)


def _coverage(board: Board, sid: str) -> int:
    return board.slice_demand("m")[sid].coverage


def _holding(board: Board, worker: str, sid: str, served: int = 0, last: int = 0) -> Membership:
    """A member that volunteered for `sid` (the only slice with demand) and loaded it."""
    m = Membership(board, worker, "cpu", served=lambda: (served, last))
    held = m.volunteer()
    assert held == Held("m", sid)
    m.hold(held)
    return m


def _view(sid: str, device: str = "gpu0", **fields: Any) -> WorkerView:
    """Worker "w"'s view of `sid` as a beat from this process shows it."""
    return WorkerView(
        "w", sid, alive=True, device=device, machine=machine_id(), cpus=cpus(), **fields
    )


def test_volunteer_takes_the_slice_with_most_demand(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    a, b = _register(board, gguf)
    m = Membership(board, "w", "cpu")
    assert m.volunteer() is None, "no target: nothing to take"
    assert board.assignments("m") == {}
    board.set_target("m", a, 1)
    board.set_target("m", b, 2)
    held = m.volunteer()
    assert held == Held("m", b)
    assert board.assignments("m") == {"w": (b,)} and _coverage(board, b) == 1
    again = Membership(board, "w", "cpu")  # the same id, restarted: the answer was lost
    assert again.volunteer() == held, "a slice reserved to it and unknown to it comes back"
    assert _coverage(board, b) == 1
    assert Membership(board, "x", "cpu").volunteer() == Held("m", a), "tie: least covered"
    assert Membership(board, "y", "cpu").volunteer() == Held("m", b)
    assert Membership(board, "z", "cpu").volunteer() is None, "all demand met"


def test_hold_makes_the_worker_alive_with_its_counters(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    _, b = _register(board, gguf)
    board.set_target("m", b, 1)
    m = Membership(
        board, "w", "gpu0", served=lambda: (3, 1234), instance="i1", kernels="torch on gpu0"
    )
    held = m.volunteer()
    assert held is not None
    # offered, not yet loaded: beating (never reaped while it downloads), not routable
    gpu = "torch on gpu0"
    assert board.workers("m") == [_view(b, last_serve_ms=1234, ready=False, kernels=gpu)]
    assert board.worker_info("w") == WorkerInfo(
        model="m",
        slice=b,
        device="gpu0",
        served=3,
        last_serve_ms=1234,
        state="loading",
        instance="i1",
        holds="{}",
        machine=machine_id(),
        cpus=cpus_text(cpus()),
        kernels="torch on gpu0",
    )
    m.loaded(10, 100)
    m.beat()
    info = board.worker_info("w")
    assert info is not None and (info.loaded_bytes, info.total_bytes) == (10, 100)
    m.hold(held)
    assert m.held == held
    assert board.workers("m") == [_view(b, last_serve_ms=1234, load=0.0, kernels=gpu)]
    assert board.worker_info("w") == WorkerInfo(
        model="m",
        slice=b,
        device="gpu0",
        served=3,
        last_serve_ms=1234,
        loaded_bytes=10,
        total_bytes=100,
        instance="i1",
        holds=f'{{"m":["{b}"]}}',
        machine=machine_id(),
        cpus=cpus_text(cpus()),
        kernels=gpu,
    )


def test_beat_reports_fresh_counters_and_rejoins_after_release(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    a, _ = _register(board, gguf)
    board.set_target("m", a, 1)
    counters = [(0, 0)]
    m = Membership(board, "w", "cpu", served=lambda: counters[0])
    held = m.volunteer()
    assert held is not None
    m.hold(held)
    board.release("m", "w")  # the monitor reaped it, but it is still serving
    assert board.assignments("m") == {} and _coverage(board, a) == 0
    counters[0] = (7, 99)
    m.beat()
    assert board.assignments("m") == {"w": (a,)} and _coverage(board, a) == 1
    assert board.workers("m") == [_view(a, "cpu", last_serve_ms=99, load=0.0)]
    info = board.worker_info("w")
    assert info is not None and info.served == 7
    m.beat()
    assert _coverage(board, a) == 1, "a beat while held counts it once"


def test_a_removed_models_slices_are_dropped_not_rejoined(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    a, _ = _register(board, gguf)
    board.set_target("m", a, 1)
    m = _holding(board, "w", a)
    board.unregister_model("m")  # kvq model rm
    m.beat()
    assert board.assignments("m") == {} and board.slice_demand("m") == {}, "no rejoin"
    assert m.holds == {} and m.take_dropped() == [Held("m", a)] and m.take_dropped() == []


def test_a_drained_worker_gives_its_slices_back_once_its_work_is_done(
    board_case: BoardCase, gguf: Path
) -> None:
    """`kvq workers drain`: the worker answers what is on its plate first, then gives every
    slice back (coverage 0: other workers take them), takes none of the model while drained,
    and volunteers again once released."""
    board = board_case.board
    a, b = _register(board, gguf, base_replicas=1)
    m = Membership(board, "w", "cpu")
    for _ in range(2):
        held = m.volunteer()
        assert held is not None
        m.hold(held)
    m.backlog.read([("c1", 3)])  # a job read, not answered yet
    assert operator.drain(board, "w", "ops") == ["m"]
    m.beat()
    m.beat()
    assert set(board.held_by("m", "w")) == {a, b}, "its work first"
    m.backlog.start("c1", 3)
    m.backlog.done()
    m.beat()
    assert board.held_by("m", "w") == () and m.holds == {}
    assert {d.coverage for d in board.slice_demand("m").values()} == {0}, "wanted elsewhere"
    assert sorted(h.sid for h in m.take_dropped()) == [a, b], "the serving loop unloads them"
    assert m.volunteer() is None, "no slice of a model it is drained of"
    m.beat()
    assert board.held_by("m", "w") == (), "no rejoin either"
    operator.release(board, "w", "ops")
    m.beat()
    assert m.volunteer() is not None, "released: it volunteers again"


def test_beat_without_a_slice_writes_nothing(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    _register(board, gguf, base_replicas=1)
    Membership(board, "w", "cpu").beat()
    assert board.worker_info("w") is None and board.assignments("m") == {}


def test_retire_gives_back_only_a_surplus_replica(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    a, b = _register(board, gguf)
    board.set_target("m", a, 2)
    first, second = _holding(board, "p", a), _holding(board, "q", a)
    assert first.retire() is None, "both replicas are wanted"
    assert _coverage(board, a) == 2
    board.set_target("m", a, 1)  # load drained
    assert first.retire() == Held("m", a)
    assert second.retire() is None, "the last replica stays"
    assert first.held is None and second.held == Held("m", a)
    assert board.assignments("m") == {"q": (a,)} and _coverage(board, a) == 1
    assert board.worker_info("p") is None
    assert [v.worker_id for v in board.workers("m") if v.alive] == ["q"]
    first.beat()
    assert board.assignments("m") == {"q": (a,)}, "a retired worker's beat does not rejoin"
    assert board.worker_info("p") is None
    assert all(b not in sids for sids in board.assignments("m").values())


def test_leave_releases_and_forgets_and_is_idempotent(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    a, _ = _register(board, gguf)
    board.set_target("m", a, 1)
    m = _holding(board, "w", a, served=2, last=50)
    board.send_jobs([("w", {"m": "job0"})])
    assert len(board_case.inbox("w")) == 1
    m.leave()
    assert m.held is None
    assert board.workers("m") == [] and board.assignments("m") == {}
    assert board.worker_info("w") is None
    assert _coverage(board, a) == 0 and board.slice_demand("m")[a].demand == 1
    assert board_case.inbox("w") == []
    m.leave()
    m.beat()
    assert board.assignments("m") == {} and board.worker_info("w") is None
    assert _coverage(board, a) == 0


def test_give_back_returns_an_offered_slice(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    a, _ = _register(board, gguf)
    board.set_target("m", a, 1)
    m = Membership(board, "w", "cpu")
    held = m.volunteer()
    assert held == Held("m", a) and _coverage(board, a) == 1
    m.give_back(held)  # could not load it
    assert board.assignments("m") == {} and _coverage(board, a) == 0
    assert m.held is None
    assert Membership(board, "other", "cpu").volunteer() == held, "the demand is back"


# -- the heartbeat thread ---------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def short_case(request: pytest.FixtureRequest) -> BoardCase:
    """Both boards with a heartbeat that expires in `SHORT_TTL_S`."""
    return make_case(request, request.param, Lifetimes(SHORT_TTL_S, 10.0, 600))


def _alive(board: Board, worker: str) -> bool:
    return any(v.worker_id == worker and v.alive for v in board.workers("m"))


def test_heartbeat_thread_keeps_it_alive_then_stops_on_close(
    short_case: BoardCase, gguf: Path
) -> None:
    board = short_case.board
    assert board.lifetimes.heartbeat_ttl_s == SHORT_TTL_S
    a, _ = _register(board, gguf)
    board.set_target("m", a, 1)
    calls = [0]

    def served() -> tuple[int, int]:
        calls[0] += 1
        return calls[0], 1

    m = Membership(board, "w", "cpu", served=served)
    held = m.volunteer()
    assert held is not None
    m.hold(held)
    m.start()
    try:
        until = time.monotonic() + 2.5 * SHORT_TTL_S
        while time.monotonic() < until:
            assert _alive(board, "w"), "beats keep the heartbeat up"
            time.sleep(0.05)
        info = board.worker_info("w")
        assert info is not None and info.served >= 4, "each beat reports fresh counters"
    finally:
        m.close()
    assert m._thread is not None and not m._thread.is_alive()
    beats = calls[0]
    wait_for(lambda: not _alive(board, "w"), 3 * SHORT_TTL_S)
    assert calls[0] == beats, "no beat after close"
    assert board.assignments("m") == {"w": (a,)}, "close is not leave: the monitor reaps it"


def test_heartbeat_thread_rejoins_after_a_release(short_case: BoardCase, gguf: Path) -> None:
    board = short_case.board
    a, _ = _register(board, gguf)
    board.set_target("m", a, 1)
    m = _holding(board, "w", a)
    m.start()
    try:
        board.release("m", "w")
        wait_for(lambda: board.assignments("m") == {"w": (a,)}, 3 * SHORT_TTL_S)
        assert _coverage(board, a) == 1
    finally:
        m.close()


def test_close_without_start_is_harmless(board_case: BoardCase, gguf: Path) -> None:
    _register(board_case.board, gguf)
    Membership(board_case.board, "w", "cpu").close()


# -- MemoryBoard only -------------------------------------------------------------------------
def test_a_beat_racing_a_reader_that_expires_the_old_one_is_kept(gguf: Path) -> None:
    """The heartbeat thread's `beat` lands while a reader (`workers`) is expiring the previous
    beat. The interleaving is forced through the injectable clock: the reader's first clock
    read lets a beat run on another thread, as a thread switch at that point would."""
    now = [100.0]
    racing = [False]
    threads: list[threading.Thread] = []

    def clock() -> float:
        if racing[0]:
            racing[0] = False
            info = WorkerInfo(model="m", slice=sid, device="cpu")
            t = threading.Thread(target=board.beat, args=("w", info), daemon=True)
            t.start()
            threads.append(t)
            t.join(timeout=0.5)  # a board that serialises the two lets the beat wait instead
        return now[0]

    board = MemoryBoard(Lifetimes(1.0, 10.0, 600), clock=clock)
    sid = _register(board, gguf)[0]
    board.set_target("m", sid, 1)
    _holding(board, "w", sid)
    assert _alive(board, "w")
    now[0] += 20.0  # the old beat and info are long expired ...
    racing[0] = True  # ... and a fresh beat lands while `workers` expires them
    board.workers("m")
    for t in threads:
        t.join(timeout=2)
    assert threads and not threads[0].is_alive()
    assert _alive(board, "w") and board.worker_info("w") is not None, "the fresh beat counts"


def test_beats_report_load_and_per_row_rate(board_case: BoardCase, gguf: Path) -> None:
    """H5: each beat carries the share of the interval spent computing and ms per row; the
    coordinators' views carry the load into the cost."""
    import time

    board = board_case.board
    _, b = _register(board, gguf)
    board.set_target("m", b, 1)
    work = [(0.0, 0)]
    m = Membership(board, "w", "cpu", work=lambda: work[0])
    held = m.volunteer()
    assert held is not None
    m.hold(held)
    t0 = time.monotonic()
    time.sleep(0.05)
    work[0] = (0.02, 8)  # 20 ms of compute over 8 rows during the interval
    m.beat()
    dt = time.monotonic() - t0
    info = board.worker_info("w")
    assert info is not None
    assert info.ms_per_row == pytest.approx(2.5)
    assert 0.02 / (dt + 0.05) < info.load <= 0.02 / 0.05 + 1e-9
    (view,) = board.workers("m")
    assert view.load == info.load
    m.beat()  # no work since: idle
    info = board.worker_info("w")
    assert info is not None and info.load == 0.0 and info.ms_per_row == 0.0


def test_beats_report_busy_and_queued_rows_per_coordinator(
    board_case: BoardCase, gguf: Path
) -> None:
    """Issue 10 item 3: rows on the worker's plate (the job computing, the batch read, the
    inbox unread at its mean rows per job) reach the coordinators' views."""
    board = board_case.board
    _, b = _register(board, gguf)
    board.set_target("m", b, 1)
    m = Membership(board, "w", "cpu", served=lambda: (4, 1), work=lambda: (0.01, 40))
    held = m.volunteer()
    assert held is not None
    m.hold(held)
    m.backlog.read([("c1", 8), ("c2", 30), ("c1", 4)])
    m.backlog.start("c1", 8)
    board.send_jobs([("w", {b"j": str(i).encode()}) for i in range(5)])  # its batch + 2 more
    m.beat()  # learns the inbox's length: 2 unread, priced at 10 rows per job
    m.beat()
    info = board.worker_info("w")
    assert info is not None
    assert (info.busy_rows, info.queued_rows) == (8, 34 + 20)
    assert info.queued_by_coord() == {"c1": 12, "c2": 30}
    (view,) = board.workers("m")
    assert view.queued_rows == 8 + 54 and dict(view.queued_by) == {"c1": 12, "c2": 30}
    m.backlog.done()
    m.backlog.read([])
    board.forget_worker("w")  # its inbox too
    board.rejoin("m", "w", b)
    m.beat()
    m.beat()
    info = board.worker_info("w")
    assert info is not None and (info.busy_rows, info.queued_rows) == (0, 0)
    assert info.queued_by_coord() == {}


@pytest.mark.parametrize("text", ["", "[1]", "{bad", '{"c": "x"}'])
def test_a_queued_by_field_that_does_not_decode_reads_as_empty(text: str) -> None:
    info = WorkerInfo(model="m", slice="s", device="cpu", queued_by=text)
    assert info.queued_by_coord() == {}


# -- several slices (issue 10 item 4) ----------------------------------------------------------
def _two_models(board: Board, gguf: Path) -> tuple[str, str]:
    """Models "m" and "n", one slice each (1 layer x 8 experts) with a target of 1."""
    sids = []
    for model in ("m", "n"):
        info = plan_model(model, gguf, 1, 8)
        board.register_model(info, 1)
        sids.append(next(iter(info.slices)))
    return sids[0], sids[1]


def test_a_worker_takes_one_slice_of_each_model(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    sm, sn = _two_models(board, gguf)
    m = Membership(board, "w", "cpu")
    first = m.volunteer()
    assert first == Held("m", sm)
    m.hold(first)
    second = m.volunteer()
    assert second == Held("n", sn), "m's only slice is held: n's comes next"
    # loading the second: the first stays routable, the second is not yet
    views = {(mod, v.slice_id): v for mod in ("m", "n") for v in board.workers(mod)}
    assert views[("m", sm)].ready and not views[("n", sn)].ready
    m.hold(second)
    assert m.holds == {("m", sm): first, ("n", sn): second} and m.held == second
    assert all(v.ready for mod in ("m", "n") for v in board.workers(mod))
    info = board.worker_info("w")
    assert info is not None and info.held() == {"m": (sm,), "n": (sn,)}
    assert m.volunteer() is None, "a slice of every model: nothing more to take"
    assert board.assignments("m") == {"w": (sm,)} and board.assignments("n") == {"w": (sn,)}


def test_a_slice_that_does_not_fit_is_not_reserved(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    sm, _ = _two_models(board, gguf)
    size = plan_model("m", gguf, 1, 8).slices[sm].nbytes
    m = Membership(board, "w", "cpu")
    assert m.volunteer(room=size - 1) is None
    assert board.assignments("m") == {} and board.assignments("n") == {}, "nothing reserved"
    assert board.slice_demand("m")[sm].demand == 1
    assert m.volunteer(room=size) == Held("m", sm), "exactly its size fits"


def _holding_both(board: Board, gguf: Path) -> tuple[Membership, str, str]:
    """A worker holding a slice of each of two models (and those slices' ids)."""
    sm, sn = _two_models(board, gguf)
    m = Membership(board, "w", "cpu")
    for _ in range(2):
        held = m.volunteer()
        assert held is not None
        m.hold(held)
    return m, sm, sn


def test_beats_reassert_every_slice_and_leave_releases_them_all(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    m, sm, sn = _holding_both(board, gguf)
    board.release("m", "w")
    board.release("n", "w")  # reaped, or Redis lost its data
    m.beat()
    assert board.assignments("m") == {"w": (sm,)} and board.assignments("n") == {"w": (sn,)}
    m.leave()
    assert board.assignments("m") == {} and board.assignments("n") == {}
    assert board.worker_info("w") is None


def test_retiring_one_slice_keeps_the_others_and_the_keys(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    m, sm, sn = _holding_both(board, gguf)
    assert m.retire("m") is None, "still wanted"
    board.set_target("m", sm, 0)
    assert m.retire("n") is None and m.retire("m") == Held("m", sm)
    assert m.holds == {("n", sn): Held("n", sn)} and board.assignments("m") == {}
    info = board.worker_info("w")
    assert info is not None and info.held() == {"n": (sn,)}, "its beat no longer lists it"
    m.beat()
    assert board.assignments("m") == {}, "a retired slice is not re-asserted"
    assert any(v.alive for v in board.workers("n"))
    board.set_target("n", sn, 0)
    assert m.retire("n") == Held("n", sn)
    assert board.worker_info("w") is None, "the last slice takes the worker's keys with it"


def test_a_worker_takes_several_slices_of_one_model(board_case: BoardCase, gguf: Path) -> None:
    """Issue 10 item 4: one slice at a time, each one it does not hold, while slices are
    wanted; beats list them all and re-assert them all; each retires on its own."""
    board = board_case.board
    a, b = _register(board, gguf, base_replicas=1)
    m = Membership(board, "w", "cpu")
    first = m.volunteer()
    assert first == Held("m", a)
    m.hold(first)
    second = m.volunteer()
    assert second == Held("m", b), "a slice of the same model it does not hold"
    m.hold(second)
    assert m.volunteer() is None, "both held: no demand left"
    assert board.assignments("m") == {"w": (a, b)}
    assert [(v.slice_id, v.ready) for v in board.workers("m")] == [(a, True), (b, True)]
    info = board.worker_info("w")
    assert info is not None and info.held() == {"m": (a, b)}
    board.release("m", "w")  # reaped, or Redis lost its data: both come back with a beat
    assert board.assignments("m") == {}
    m.beat()
    assert board.assignments("m") == {"w": (a, b)} and _coverage(board, a) == 1
    board.set_target("m", b, 0)
    assert m.retire("m", a) is None, "a is still wanted"
    assert m.retire("m", b) == Held("m", b)
    assert board.assignments("m") == {"w": (a,)} and list(m.holds) == [("m", a)]
    m.beat()
    assert board.assignments("m") == {"w": (a,)}, "a retired slice is not re-asserted"
    m.leave()
    assert board.assignments("m") == {} and _coverage(board, a) == 0
