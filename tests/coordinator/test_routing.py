"""The coordinator's `SliceRouter` fed from both boards: local at rest (K1), proven workers under
load (K3), unproven ones only inside their grace window (K4), rescues when a heartbeat dies (H8),
and refusal while a workers-only coordinator has an uncovered slice."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from boards import BoardCase

from kvq.bus.board import Board
from kvq.bus.records import Quarantine, WorkerInfo
from kvq.catalog import ModelInfo
from kvq.config import RoutingSettings, load_settings
from kvq.coordinator.routing import SliceRouter
from kvq.errors import UncoveredSlice
from kvq.gguf.registry import plan_model
from kvq.tools.synth import make_tiny

TOTAL = 4


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("routing") / "m.gguf"
    make_tiny(path, layers=2, experts=8)
    return path


def _routing(**overrides: Any) -> RoutingSettings:
    """The copy policy unless a test asks for the capacity split (tests at the end)."""
    base = {"dispatch_refresh_ms": 10, "dispatch_policy": "copies"}
    return load_settings(**{**base, **overrides}).routing


def _router(board: Board, gguf: Path, **overrides: Any) -> tuple[SliceRouter, list[str]]:
    """A router for model "m" (2 layers x 2 slices of 4 experts); its slice ids, in order."""
    info: ModelInfo = plan_model("m", gguf, 1, 4)
    board.register_model(info, 0)
    sids = sorted(
        info.slices, key=lambda s: (info.slices[s].layer_start, info.slices[s].expert_start)
    )
    assert len(sids) == 4
    return SliceRouter(board, _routing(**overrides), "coord", info), sids


def _serve(board: Board, worker: str, sid: str, proven: bool = True) -> None:
    """`worker` holds `sid` and beats; proven: it says it has computed experts, which alone
    proves nothing any more (`_prove`)."""
    board.rejoin("m", worker, sid)
    last = int(time.time() * 1000) if proven else 0
    board.beat(worker, WorkerInfo(model="m", slice=sid, device="cpu", last_serve_ms=last))


def _prove(router: SliceRouter, *workers: str) -> None:
    """A result of each worker was recomputed here and agreed: proven (K3)."""
    router.refresh(force=True)
    for w in workers:
        router.observe_result(w, 5.0, verified=True)


def _remote(router: SliceRouter, sids: list[str], busy: int) -> dict[str, str]:
    route = router.route(dict.fromkeys(sids, 1), busy, TOTAL)
    assert route.trial is None
    return {s: w for s in sids if (w := route.worker(s)) is not None}


def test_at_rest_every_slice_is_local(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    router, sids = _router(board, gguf)
    for i, sid in enumerate(sids):
        _serve(board, f"w{i}", sid)
    threshold = _routing().saturation_threshold
    for busy in (0, threshold - 1):
        route = router.route(dict.fromkeys(sids, 1), busy, TOTAL)
        assert all(route.worker(s) is None for s in sids)
        assert route.remote == {} and route.trial is None
    router.check()


def test_under_load_only_a_proven_worker_gets_its_slice(board_case: BoardCase, gguf: Path) -> None:
    """worker_grace_ms=0: the unproven worker is outside its K4 window from the start."""
    board = board_case.board
    router, sids = _router(board, gguf, worker_grace_ms=0)
    s0, s1 = sids[0], sids[1]
    _serve(board, "proven", s0)
    _serve(board, "new", s1, proven=False)
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {}, "saying it served proves nothing"
    _prove(router, "proven")
    assert _remote(router, sids, busy) == {s0: "proven"}
    assert _remote(router, sids, busy) == {s0: "proven"}, "and no trial later"
    assert _remote(router, sids, 0) == {}, "load gone: local again"


def test_under_load_an_unproven_worker_gets_one_trial_in_its_window(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    router, sids = _router(board, gguf, worker_grace_ms=60_000)
    s1 = sids[1]
    _serve(board, "new", s1, proven=False)
    busy = _routing().saturation_threshold
    assert router.route(dict.fromkeys(sids, 1), 0, TOTAL).remote == {}, "at rest: no trial"
    trial = router.route(dict.fromkeys(sids, 1), busy, TOTAL)
    assert (trial.trial, trial.worker(s1)) == ("new", "new")
    again = router.route(dict.fromkeys(sids, 1), busy, TOTAL)
    assert again.trial is None and again.worker(s1) is None, "one try only"
    router.observe_result("new", 5.0)  # it answered, unchecked: not proven yet
    assert router.route(dict.fromkeys(sids, 1), busy, TOTAL).worker(s1) is None
    router.observe_result("new", 5.0, verified=True)  # an answer checked here: proven
    assert router.route(dict.fromkeys(sids, 1), busy, TOTAL).worker(s1) == "new"


def test_a_dead_proven_worker_is_rescued_and_routing_goes_local(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    router, sids = _router(board, gguf)
    s0, s1 = sids[0], sids[1]
    _serve(board, "a", s0)
    _serve(board, "b", s1)
    _prove(router, "a", "b")
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {s0: "a", s1: "b"}
    replans = router.replans
    board_case.kill_worker("a")
    router.refresh(force=True)
    assert router.rescues == 1
    assert router.replans > replans
    assert _remote(router, sids, busy) == {s1: "b"}
    router.refresh(force=True)
    assert router.rescues == 1, "one death, one rescue"
    board_case.kill_worker("b")
    router.refresh(force=True)
    assert router.rescues == 2
    assert _remote(router, sids, busy) == {}
    router.check()  # the coordinator holds every slice


def test_a_worker_reaped_before_the_refresh_is_rescued_too(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    router, sids = _router(board, gguf)
    _serve(board, "a", sids[0])
    _prove(router, "a")
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {sids[0]: "a"}
    board_case.kill_worker("a")
    board.release("m", "a")  # the monitor reaped it before this coordinator looked again
    board.forget_worker("a")
    router.refresh(force=True)
    assert router.rescues == 1
    assert _remote(router, sids, busy) == {}


def test_a_death_off_the_current_route_is_no_rescue(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    router, sids = _router(board, gguf)
    _serve(board, "a", sids[0])
    assert _remote(router, sids, 0) == {}, "at rest the route is all local"
    board_case.kill_worker("a")
    router.refresh(force=True)
    assert router.rescues == 0
    assert _remote(router, sids, _routing().saturation_threshold) == {}


def test_refresh_rereads_only_when_due_or_forced(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    router, sids = _router(board, gguf, dispatch_refresh_ms=60_000)
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {}  # the first call reads the board
    _serve(board, "a", sids[0])
    assert _remote(router, sids, busy) == {}, "not due yet: the old view"
    replans = router.replans
    router.refresh()
    assert router.replans == replans
    router.refresh(force=True)
    assert router.replans == replans, "read now, but an unproven worker changes no copy"
    _prove(router, "a")
    assert router.replans == replans + 1, "proven: its copy is planned"
    assert _remote(router, sids, busy) == {sids[0]: "a"}
    router.refresh(force=True)
    assert router.replans == replans + 1, "same coverage: no re-plan"


def test_workers_only_coordinator_refuses_until_a_worker_beats(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    router, sids = _router(board, gguf, coordinator_experts="none")
    with pytest.raises(UncoveredSlice, match=sids[0]):
        router.check()
    with pytest.raises(UncoveredSlice):
        router.route(dict.fromkeys(sids, 1), 0, TOTAL)
    for i, sid in enumerate(sids[1:], start=1):
        _serve(board, f"w{i}", sid, proven=False)
    router.refresh(force=True)
    with pytest.raises(UncoveredSlice, match=sids[0]) as exc:
        router.check()
    assert sids[1] not in str(exc.value)
    board.rejoin("m", "w0", sids[0])  # holds it but has not beaten yet: not live
    router.refresh(force=True)
    with pytest.raises(UncoveredSlice, match=sids[0]):
        router.check()
    _serve(board, "w0", sids[0], proven=False)
    time.sleep(0.03)  # past dispatch_refresh_ms: check() rereads by itself
    router.check()
    route = router.route(dict.fromkeys(sids, 1), 0, TOTAL)
    assert {s: route.worker(s) for s in sids} == {s: f"w{i}" for i, s in enumerate(sids)}, (
        "no local experts: the only holders serve even unproven and at rest"
    )
    board_case.kill_worker("w0")
    router.refresh(force=True)
    with pytest.raises(UncoveredSlice, match=sids[0]):
        router.check()


# -- KVQ_DISPATCH_POLICY=capacity: under load the layer's slices are split by measured rates --


def _measured(
    router: SliceRouter, worker: str, ms_per_row: float, overhead_ms: float, own: float = 0.0
) -> None:
    """What dispatch feeds the router: the coordinator's local compute (`own` ms per row,
    default the worker's) and one result of the worker."""
    router.refresh(force=True)
    router.observe_local(rows=100, ms=100 * (own or ms_per_row))
    router.observe_result(
        worker, overhead_ms + 100 * ms_per_row, 100, 100 * ms_per_row, verified=True
    )


def test_capacity_split_uses_coordinator_and_worker_under_load(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    router, sids = _router(board, gguf, dispatch_policy="capacity", swarm_ewma_alpha=1.0)
    s0, s1 = sids[0], sids[1]  # both slices of layer 0
    _serve(board, "w", s0)
    _serve(board, "w2", s1)
    _measured(router, "w", 1.0, 2.0)
    _measured(router, "w2", 1.0, 2.0)
    busy = _routing().saturation_threshold
    assert router.route({s0: 10, s1: 10}, 0, TOTAL).remote == {}, "at rest: all local (K1)"
    split = router.route({s0: 10, s1: 10}, busy, TOTAL)
    # 10 rows each at 1 ms/row: both local 20 ms; one on a worker 12 ms, both remote 12 ms
    assert split.pipeline_id == -2 and len(split.remote) >= 1
    assert split.remote.get(s0, "w") == "w" and split.remote.get(s1, "w2") == "w2"


def test_capacity_keeps_work_local_when_the_round_trip_costs_more(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    router, sids = _router(board, gguf, dispatch_policy="capacity", swarm_ewma_alpha=1.0)
    _serve(board, "w", sids[0])
    _measured(router, "w", 0.01, 5.0)  # 0.1 ms of work against a 5 ms round trip
    busy = _routing().saturation_threshold
    assert router.route({sids[0]: 10, sids[1]: 10}, busy, TOTAL).remote == {}


def test_capacity_gives_a_failing_worker_nothing(board_case: BoardCase, gguf: Path) -> None:
    board = board_case.board
    router, sids = _router(board, gguf, dispatch_policy="capacity", swarm_ewma_alpha=1.0)
    _serve(board, "w", sids[0])
    _measured(router, "w", 0.5, 0.5, own=1.0)  # twice as fast: 10.5 ms against 20 here
    busy = _routing().saturation_threshold
    assert router.route({sids[0]: 20}, busy, TOTAL).remote == {sids[0]: "w"}
    router.observe_failure("w", 2000.0)  # score 0 with alpha 1: not eligible
    assert router.route({sids[0]: 20}, busy, TOTAL).remote == {}


def test_a_worker_that_died_mid_use_is_a_rescue_after_its_misses_priced_it_out(
    board_case: BoardCase, gguf: Path
) -> None:
    """Issue 12 item 7: a dead worker's jobs miss their deadlines first (each a failure, so the
    router prices it out), and only then does its heartbeat expire: it was on the route when
    it died, so it is a rescue even though the current route no longer uses it."""
    board = board_case.board
    router, sids = _router(board, gguf)
    _serve(board, "a", sids[0])
    _prove(router, "a")
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {sids[0]: "a"}
    for _ in range(3):  # the dispatcher's missed deadlines
        router.observe_failure("a", 2000.0)
    assert _remote(router, sids, busy) == {}, "priced out before its heartbeat expires"
    board_case.kill_worker("a")
    router.refresh(force=True)
    assert router.rescues == 1


def test_a_worker_that_recovered_before_dying_is_no_rescue(
    board_case: BoardCase, gguf: Path
) -> None:
    board = board_case.board
    router, sids = _router(board, gguf)
    _serve(board, "a", sids[0])
    _prove(router, "a")
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {sids[0]: "a"}
    router.observe_failure("a", 2000.0)
    router.observe_result("a", 5.0, verified=True)  # it answered again
    assert _remote(router, sids, 0) == {}, "at rest: all local, a is off the route"
    board_case.kill_worker("a")
    router.refresh(force=True)
    assert router.rescues == 0


def _beat_queue(board: Board, worker: str, sid: str, rows: int, by: str) -> None:
    """`worker`'s heartbeat reports `rows` waiting (JSON `by` coordinator), 1 ms per row."""
    board.beat(
        worker,
        WorkerInfo(
            model="m",
            slice=sid,
            device="cpu",
            last_serve_ms=int(time.time() * 1000),
            ms_per_row=1.0,
            busy_rows=rows // 4,
            queued_rows=rows - rows // 4,
            queued_by=by,
        ),
    )


def test_capacity_gives_a_worker_busy_with_another_coordinator_less(
    board_case: BoardCase, gguf: Path
) -> None:
    """Issue 10 item 3: rows another coordinator queued on a worker (its heartbeat) delay
    work sent to it, so the split keeps more here; this coordinator's own rows do not."""
    board = board_case.board
    router, sids = _router(board, gguf, dispatch_policy="capacity", swarm_ewma_alpha=1.0)
    s0, s1 = sids[0], sids[1]
    _serve(board, "w", s0)
    _serve(board, "w2", s1)
    _measured(router, "w", 0.5, 1.0, own=1.0)  # 6 ms for 10 rows there, 10 ms here
    _measured(router, "w2", 0.5, 1.0, own=1.0)
    busy = _routing().saturation_threshold
    work = {s0: 10, s1: 10}
    assert router.route(work, busy, TOTAL).remote == {s0: "w", s1: "w2"}

    _beat_queue(board, "w", s0, 200, '{"coord":200}')  # its own rows: no change
    router.refresh(force=True)
    assert router.route(work, busy, TOTAL).remote == {s0: "w", s1: "w2"}

    _beat_queue(board, "w", s0, 200, '{"other":160}')  # 200 rows x 1 ms ahead of ours
    router.refresh(force=True)
    assert router.capacity.describe()["w"]["backlog_ms"] == 200.0
    assert router.route(work, busy, TOTAL).remote == {s1: "w2"}

    _beat_queue(board, "w", s0, 0, "{}")  # the queue drained
    router.refresh(force=True)
    assert router.route(work, busy, TOTAL).remote == {s0: "w", s1: "w2"}


def test_a_quarantined_worker_gets_no_work_until_its_quarantine_ends(
    board_case: BoardCase, gguf: Path
) -> None:
    """Issue 11: a verdict on the board (any coordinator's) leaves the worker out of routing
    at the next refresh, without counting it as a death; after the quarantine it is back as
    an unproven worker, and a banned one never comes back."""
    board = board_case.board
    router, sids = _router(board, gguf)
    _serve(board, "a", sids[0])
    _serve(board, "b", sids[1])
    _prove(router, "a", "b")
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {sids[0]: "a", sids[1]: "b"}
    now = int(time.time() * 1000)
    board.quarantine("m", "a", Quarantine(until_ms=now + 300, mismatches=1, coord="other"))
    board.quarantine("m", "b", Quarantine(until_ms=0, mismatches=3, banned=True))
    router.refresh(force=True)
    assert _remote(router, sids, busy) == {} and router.rescues == 0
    assert router.trust.barred("a") and router.trust.p("a") == 1.0
    time.sleep(0.35)  # past the quarantine's 300 ms: the time is what is tested
    router.refresh(force=True)
    back = router.route(dict.fromkeys(sids, 1), busy, TOTAL)
    assert (back.trial, back.remote) == ("a", {sids[0]: "a"}), "back as new: one K4 trial"
    assert _remote(router, sids, busy) == {}, "unproven until a checked answer"
    _prove(router, "a", "b")
    assert _remote(router, sids, busy) == {sids[0]: "a"}, "b stays banned"


def test_capacity_reprobes_a_priced_out_worker_and_it_wins_work_back(
    board_case: BoardCase, gguf: Path
) -> None:
    """Issue 10 item 2 under the split: one slow sample (a busy moment) prices a worker out;
    after `reprobe_ms` without a slice it gets one (the router's re-probe here: its copy is
    not the base route), and the probe's sample replaces its estimate, so a worker that is
    fast again takes its share back."""
    board = board_case.board
    router, sids = _router(
        board, gguf, dispatch_policy="capacity", swarm_ewma_alpha=0.3, reprobe_ms=50
    )
    _serve(board, "w", sids[0])
    _measured(router, "w", 5.0, 2.0, own=1.0)  # a slow sample: 5x the coordinator's rate
    busy = _routing().saturation_threshold
    work = {sids[0]: 20}
    assert router.route(work, busy, TOTAL).remote == {}, "priced out by its sample"
    assert router.route(work, busy, TOTAL).remote == {}, "no probe before reprobe_ms"
    time.sleep(0.08)  # past reprobe_ms (50): the time is what is tested
    probe = router.route(work, busy, TOTAL)
    assert (probe.remote, probe.trial) == ({sids[0]: "w"}, "w"), "the probe: not waited for"
    assert router.split_probes + router.router.probes == 1
    assert router.route(work, busy, TOTAL).remote == {}, "one probe, then the estimates"
    # its answer: fast now (0.5 ms per row); with alpha 0.3 a nudge would leave it priced
    # out (0.7 x 5 + 0.3 x 0.5 = 3.65 ms/row), the probe's sample replaces the estimate
    router.observe_result("w", 2.0 + 20 * 0.5, 20, 20 * 0.5, verified=True)
    assert router.route(work, busy, TOTAL).remote == {sids[0]: "w"}, "won its work back"


def test_capacity_reprobes_a_worker_on_the_base_copy(board_case: BoardCase, gguf: Path) -> None:
    """The router re-probes only workers off its chosen copy; a worker on that copy whom the
    split prices out gets its probe from the split (`split_probes`)."""
    board = board_case.board
    router, sids = _router(
        board, gguf, dispatch_policy="capacity", swarm_ewma_alpha=1.0, reprobe_ms=50
    )
    _serve(board, "w", sids[0])
    _prove(router, "w")  # proven and fast by latency: the router's copy uses it under load
    router.capacity.reset("w")
    router.observe_local(rows=100, ms=100.0)
    router.capacity.observe_remote("w", 100, 502.0, 500.0)  # one slow sample: 5 ms per row
    busy = _routing().saturation_threshold
    work = {sids[0]: 20}
    assert router.route(work, busy, TOTAL).remote == {}
    time.sleep(0.08)  # past reprobe_ms (50): the time is what is tested
    probe = router.route(work, busy, TOTAL)
    assert (probe.remote, probe.trial) == ({sids[0]: "w"}, "w"), "a shadow: not waited for"
    assert (router.split_probes, router.router.probes) == (1, 0)
    router.observe_result("w", 2.0 + 20 * 0.5, 20, 20 * 0.5, verified=True)
    assert router.route(work, busy, TOTAL).remote == {sids[0]: "w"}


@pytest.mark.parametrize(
    ("threads", "machine", "cpus", "device", "shares"),
    [
        ("all", "here", "mine", "cpu", True),  # our cores, all busy with our threads
        ("all", "here", "", "cpu", True),  # its CPUs unknown: assume ours
        ("one", "here", "mine", "cpu", False),  # we leave cores free (taskset, OMP_NUM_THREADS)
        ("all", "there", "mine", "cpu", False),  # another machine adds its cores
        ("all", "", "mine", "cpu", False),  # unknown machine: never a match
        ("all", "here", "other", "cpu", False),  # pinned to CPUs we do not run on
        ("all", "here", "mine", "cuda", False),  # computes on its GPU
    ],
)
def test_capacity_gives_no_share_to_a_worker_on_our_busy_cores(
    board_case: BoardCase,
    gguf: Path,
    threads: str,
    machine: str,
    cpus: str,
    device: str,
    shares: bool,
) -> None:
    """A CPU worker on the coordinator's machine adds no compute while the coordinator's
    threads cover all of its CPUs: its part of a layer would run in turn with the
    coordinator's, so the split (which counts node finish times as parallel) leaves it out."""
    from kvq.machine import cpus as my_cpus
    from kvq.machine import cpus_text, machine_id

    if not machine_id():
        pytest.skip("no boot id here")
    board = board_case.board
    mine = my_cpus()
    router, sids = _router(board, gguf, dispatch_policy="capacity", swarm_ewma_alpha=1.0)
    router.uses_all_cores = threads == "all"  # what SliceRouter's compute_threads decides
    beat_cpus = {"mine": cpus_text(mine), "": "", "other": cpus_text({max(mine) + 1})}[cpus]
    board.rejoin("m", "w", sids[0])
    board.beat(
        "w",
        WorkerInfo(
            model="m",
            slice=sids[0],
            device=device,
            last_serve_ms=int(time.time() * 1000),
            machine={"here": machine_id(), "there": "another-boot-id", "": ""}[machine],
            cpus=beat_cpus,
        ),
    )
    _measured(router, "w", 0.5, 0.5, own=1.0)  # twice as fast as the coordinator
    busy = _routing().saturation_threshold
    assert router.shares_cores(board.workers("m")[0]) is shares
    assert router.route({sids[0]: 20}, busy, TOTAL).remote == ({} if shares else {sids[0]: "w"})


def test_compute_threads_decide_whether_the_coordinator_uses_all_cores(
    board_case: BoardCase, gguf: Path
) -> None:
    from kvq.machine import cpus

    info = plan_model("m", gguf, 1, 4)
    n = len(cpus())
    assert SliceRouter(board_case.board, _routing(), "c", info, None, n).uses_all_cores
    assert not SliceRouter(board_case.board, _routing(), "c", info, None, 0).uses_all_cores
    if n > 1:
        assert not SliceRouter(board_case.board, _routing(), "c", info, None, n - 1).uses_all_cores


def test_a_worker_serving_several_slices_is_routed_each_of_them(
    board_case: BoardCase, gguf: Path
) -> None:
    """Issue 10 item 4: one view per (worker, slice); a slice it still loads is not routed."""
    import json

    board = board_case.board
    router, sids = _router(board, gguf, coordinator_experts="none")
    board.rejoin("m", "multi", *sids)
    holds = json.dumps({"m": sids[:3]})  # the fourth is loading
    now = int(time.time() * 1000)
    info = WorkerInfo(model="m", slice=sids[3], device="cpu", last_serve_ms=now, holds=holds)
    board.beat("multi", info)
    router.refresh(force=True)
    assert router.holders == {"multi": frozenset(sids[:3])}
    with pytest.raises(UncoveredSlice, match=sids[3]):
        router.check()
    board.beat(
        "multi",
        WorkerInfo(
            model="m", slice=sids[3], device="cpu", last_serve_ms=now, holds=json.dumps({"m": sids})
        ),
    )
    _prove(router, "multi")
    router.check()
    assert _remote(router, sids, busy=TOTAL) == dict.fromkeys(sids, "multi")


def test_a_drained_worker_gets_no_new_work_until_released(
    board_case: BoardCase, gguf: Path
) -> None:
    """An operator's drain (`kvq.bus.operator`) leaves the worker out of routing at the next
    refresh, no death and no bar on the results it still sends; a release brings it back."""
    from kvq.bus import operator

    board = board_case.board
    router, sids = _router(board, gguf)
    _serve(board, "a", sids[0])
    _serve(board, "b", sids[1])
    _prove(router, "a", "b")
    busy = _routing().saturation_threshold
    assert _remote(router, sids, busy) == {sids[0]: "a", sids[1]: "b"}
    assert operator.drain(board, "a", "alice") == ["m"]
    router.refresh(force=True)
    assert _remote(router, sids, busy) == {sids[1]: "b"} and router.rescues == 0
    assert not router.trust.barred("a"), "what it was sent is still used"
    assert board.held_by("m", "a") == (sids[0],), "it keeps its slice"
    operator.release(board, "a", "alice")
    router.refresh(force=True)
    _prove(router, "a")
    assert _remote(router, sids, busy) == {sids[0]: "a", sids[1]: "b"}
