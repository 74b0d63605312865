"""The monitor's logic on both boards: seeded demand (K8), boost under saturation (K7, K10),
stale coordinators, reaping. The Redis-only parts (the readable meta hash, which inbox entries
count as unanswered) are at the end."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import redis
from boards import BoardCase

from kvq.bus.records import CoordStats, Quarantine, SlotState, WorkerInfo
from kvq.bus.redis_board import RedisBoard
from kvq.config import Settings, load_settings
from kvq.gguf import read_meta
from kvq.keys import WORKER_GROUP, Keys
from kvq.monitor import Monitor
from kvq.tools.synth import make_tiny

# saturation follows busy at once here; tests/monitor/test_hysteresis.py covers the holds
BASE = load_settings(saturation_enter_s=0.0, saturation_leave_s=0.0).monitor


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mon") / "m.gguf"
    make_tiny(path, layers=3, experts=8)
    return path


def _slots(
    case: BoardCase, coord: str, busy: int, age_s: float = 0.0, experts: bool = True
) -> None:
    ts = int((time.time() - age_s) * 1000)
    state = SlotState(model="m", busy=busy, total=4, ts_ms=ts, experts=experts)
    case.board.publish_slots(coord, state, CoordStats())


def _targets(case: BoardCase) -> set[int]:
    return {d.target for d in case.board.slice_demand("m").values()}


def test_register_seeds_demand_from_metadata(board_case: BoardCase, model: Path) -> None:
    info = Monitor(board_case.board, BASE).register("m", model)
    assert len(info.slices) == 3 * (8 // BASE.slice_experts)
    demand = board_case.board.slice_demand("m")
    assert sorted(demand) == sorted(info.slices)
    assert _targets(board_case) == {BASE.base_replicas}
    assert board_case.board.models() == ["m"]
    back = board_case.board.model_info("m")
    assert back == info and back.meta == read_meta(model)


def test_saturation_raises_then_drain_lowers_targets(board_case: BoardCase, model: Path) -> None:
    mon = Monitor(board_case.board, BASE)
    mon.register("m", model)
    _slots(board_case, "c1", busy=1)
    assert not mon.poll("m").saturated
    assert _targets(board_case) == {BASE.base_replicas}
    _slots(board_case, "c1", busy=BASE.saturation_threshold)
    st = mon.poll("m")
    assert st.saturated and st.effective_target == BASE.base_replicas + BASE.boost_replicas
    assert _targets(board_case) == {st.effective_target}
    assert board_case.board.model_state("m") == st
    _slots(board_case, "c1", busy=0)
    assert mon.poll("m").effective_target == BASE.base_replicas
    assert _targets(board_case) == {BASE.base_replicas}


def test_a_backbone_only_coordinator_raises_the_base_to_two_copies(
    board_case: BoardCase, model: Path
) -> None:
    """Issue 33 item 2: while a live coordinator of the model holds no experts, every slice
    wants `KVQ_BACKBONE_REPLICAS` (2) copies at rest, the boost on top; once it is gone, the
    base is `KVQ_BASE_REPLICAS` again."""
    mon = Monitor(board_case.board, BASE)
    mon.register("m", model)
    _slots(board_case, "full", busy=0)
    assert mon.poll("m").base_target == BASE.base_replicas == 1
    _slots(board_case, "backbone", busy=0, experts=False)
    st = mon.poll("m")
    assert st.base_target == st.effective_target == BASE.backbone_replicas == 2
    assert _targets(board_case) == {2}
    _slots(board_case, "backbone", busy=BASE.saturation_threshold, experts=False)
    assert _targets(board_case) == {2} and mon.poll("m").effective_target == 3
    board_case.vanish_coordinator("backbone")
    assert mon.poll("m").base_target == 1 and _targets(board_case) == {1}


def test_stale_and_vanished_coordinators_are_ignored(board_case: BoardCase, model: Path) -> None:
    mon = Monitor(board_case.board, BASE)
    mon.register("m", model)
    stale_s = board_case.board.lifetimes.slot_state_stale_s
    _slots(board_case, "old", busy=4, age_s=stale_s + 5)
    _slots(board_case, "gone", busy=4)
    board_case.vanish_coordinator("gone")
    st = mon.poll("m")
    assert not st.saturated and st.coordinators == 0
    assert [c.coord for c in board_case.board.coordinators("m")] == ["old"]


def test_a_quarantined_workers_slices_are_re_covered_by_the_pool(
    board_case: BoardCase, model: Path
) -> None:
    """Issue 32 item 5: a caught liar stops counting as coverage: the monitor takes its slices
    away, so that a spare worker re-covers them, while its other copy serves on."""
    board = board_case.board
    mon = Monitor(board, BASE)
    info = mon.register("m", model)
    sid = sorted(info.slices)[0]
    for other in info.slices:
        board.set_target("m", other, 2 if other == sid else 0)
    assert board.volunteer("m", "liar") == sid and board.volunteer("m", "honest") == sid
    assert board.volunteer("m", "spare") is None, "two copies: nothing wanted"
    for w in ("liar", "honest", "spare"):  # all alive: only the verdict tells them apart
        board.beat(w, _info(sid))
    now = int(time.time() * 1000)
    board.quarantine("m", "liar", Quarantine(until_ms=now + 600_000, mismatches=1, coord="c1"))
    board.quarantine("m", "old", Quarantine(until_ms=now - 1, mismatches=1, coord="c1"))
    assert mon.release_quarantined("m") == ["liar"]  # (every tick does it)
    assert board.held_by("m", "liar") == () and board.held_by("m", "honest") == (sid,)
    assert board.slice_demand("m")[sid].coverage == 1
    assert board.volunteer("m", "spare") == sid, "its copy is wanted again"
    assert mon.release_quarantined("m") == [] and board.held_by("m", "spare") == (sid,)


def test_reap_releases_slice_and_requeues_jobs(board_case: BoardCase, model: Path) -> None:
    board = board_case.board
    mon = Monitor(board, BASE)
    info = mon.register("m", model)
    sid = sorted(info.slices)[0]
    for other in info.slices:
        board.set_target("m", other, 0)
    board.set_target("m", sid, 2)
    assert board.volunteer("m", "dead") == sid
    assert board.volunteer("m", "live") == sid
    for w in ("dead", "live"):
        board.beat(w, _info(sid))
    board_case.kill_worker("dead")
    board.send_jobs([("dead", {"m": f"job{i}"}) for i in range(3)])
    assert mon.reap("m") == ["dead"]
    assert [f["m"] for f in board_case.inbox("live")] == ["job0", "job1", "job2"]
    assert board_case.inbox("dead") == []
    assert board.slice_demand("m")[sid].coverage == 1
    assert board.assignments("m") == {"live": (sid,)}
    assert board.worker_info("dead") is None
    assert mon.reap("m") == []


def _info(sid: str) -> WorkerInfo:
    return WorkerInfo(model="m", slice=sid, device="cpu")


# -- Redis only ------------------------------------------------------------------------------
def test_registered_meta_is_readable_with_redis_cli(
    settings: Settings, model: Path, r: redis.Redis
) -> None:
    keys = Keys(settings.prefix)
    Monitor.from_settings(settings).register("m", model)
    meta = r.hgetall(keys.model_meta("m"))
    assert meta[b"expert_count"] == b"8" and meta[b"block_count"] == b"3"
    assert r.sismember(keys.models(), "m")


def test_requeue_moves_only_unanswered_entries(settings: Settings, r: redis.Redis) -> None:
    keys = Keys(settings.prefix)
    board = RedisBoard(r, keys, settings.lifetimes)
    inbox = keys.worker_inbox("dead")
    r.xgroup_create(inbox, WORKER_GROUP, id="0", mkstream=True)
    ids = [r.xadd(inbox, {"t": "job", "m": f"job{i}"}) for i in range(4)]
    r.xreadgroup(WORKER_GROUP, "dead", {inbox: ">"}, count=2)  # 2 delivered ...
    r.xack(inbox, WORKER_GROUP, ids[0])  # ... one of them answered
    assert board.requeue_inbox("dead", ["live"]) == 3
    moved = [f[b"m"] for _, f in r.xrange(keys.worker_inbox("live"))]
    assert moved == [b"job1", b"job2", b"job3"], "pending and undelivered move, answered don't"
    assert not r.exists(inbox)


def test_reap_sends_each_job_of_a_multi_slice_worker_to_its_own_slice(
    board_case: BoardCase, tmp_path: Path
) -> None:
    """Issue 10 item 4: a dead worker held a slice of two models; each job in its inbox goes
    to a live peer of that job's model and slice, and both slices are released."""
    from kvq import wire
    from kvq.bus.board import spread_jobs

    board = board_case.board
    mon = Monitor(board, BASE)
    sids = {}
    for name in ("m", "n"):
        path = tmp_path / f"{name}.gguf"
        make_tiny(path, layers=1, experts=8)
        info = mon.register(name, path)
        sids[name] = sorted(info.slices)[0]
        for other in info.slices:
            board.set_target(name, other, 0)
        board.set_target(name, sids[name], 2)
        assert board.volunteer(name, "dead") == sids[name]
    assert board.volunteer("m", "peer-m") == sids["m"]
    assert board.volunteer("n", "peer-n") == sids["n"]
    for w in ("dead", "peer-m", "peer-n"):
        board.beat(w, _info(sids["m"]))
    board_case.kill_worker("dead")

    def job(model: str, i: int) -> dict[str, bytes | str]:
        t = wire.Tensor.of(np.zeros((1, 2), dtype=np.float32))
        return wire.encode(
            wire.Job(
                job_id=f"{model}{i}",
                model=model,
                layer=0,
                slice=sids[model],
                expert_start=0,
                expert_end=4,
                coord="c",
                reply_to="r",
                deadline_ms=0,
                x=t,
                ids=t,
                weights=t,
            )
        )

    jobs = [job("m", 0), job("n", 0), job("m", 1), {"m": b"garbage"}]
    board.send_jobs([("dead", f) for f in jobs])
    assert mon.reap("m", "n") == ["dead"]
    ids = {
        w: [
            wire.decode(f, wire.Job).job_id if f["m"] != b"garbage" else "garbage"
            for f in _raw_inbox(board_case, w)
        ]
        for w in ("peer-m", "peer-n")
    }
    assert sorted(ids["peer-m"]) == ["garbage", "m0", "m1"] and ids["peer-n"] == ["n0"]
    assert board.assignments("m") == {"peer-m": (sids["m"],)}
    assert board.assignments("n") == {"peer-n": (sids["n"],)}
    assert spread_jobs([jobs[1]], {("m", sids["m"]): ["x"]}) == [], "no peer: dropped"


def _raw_inbox(case: BoardCase, worker: str) -> list[dict[str, object]]:
    b = case.board
    if isinstance(b, RedisBoard):
        rows = [f for _, f in b.r.xrange(b.keys.worker_inbox(worker))]
        return [{k.decode(): v for k, v in f.items()} for f in rows]
    return [dict(f) for f in b.inboxes.get(worker, [])]  # type: ignore[attr-defined]


def test_reap_sends_each_job_to_a_peer_of_its_own_slice_of_one_model(
    board_case: BoardCase, tmp_path: Path
) -> None:
    """Issue 10 item 4: a dead worker held two slices of one model; both are released at once
    and each job goes to the live peer of its own slice."""
    from kvq import wire

    board = board_case.board
    mon = Monitor(board, BASE)
    path = tmp_path / "one.gguf"
    make_tiny(path, layers=1, experts=8)
    a, b = sorted(mon.register("m", path).slices)
    board.set_target("m", a, 2)
    board.set_target("m", b, 2)
    assert board.volunteer("m", "dead") == a
    assert board.volunteer("m", "dead", None, [a]) == b
    assert board.volunteer("m", "peer-a", None, [b]) == a  # b "held": it takes a
    assert board.rejoin("m", "peer-b", b) == 1
    for w in ("dead", "peer-a", "peer-b"):
        board.beat(w, _info(a))
    board_case.kill_worker("dead")

    def job(sid: str, lo: int, i: int) -> dict[str, bytes | str]:
        t = wire.Tensor.of(np.zeros((1, 2), dtype=np.float32))
        return wire.encode(
            wire.Job(
                job_id=f"{sid}/{i}",
                model="m",
                layer=0,
                slice=sid,
                expert_start=lo,
                expert_end=lo + 4,
                coord="c",
                reply_to="r",
                deadline_ms=0,
                x=t,
                ids=t,
                weights=t,
            )
        )

    board.send_jobs([("dead", f) for f in (job(a, 0, 0), job(b, 4, 0), job(a, 0, 1))])
    assert mon.reap("m") == ["dead"]
    got = {
        w: sorted(wire.decode(f, wire.Job).slice for f in _raw_inbox(board_case, w))
        for w in ("peer-a", "peer-b")
    }
    assert got == {"peer-a": [a, a], "peer-b": [b]}
    assert board.assignments("m") == {"peer-a": (a,), "peer-b": (b,)}
    assert {s: d.coverage for s, d in board.slice_demand("m").items()} == {a: 1, b: 1}
