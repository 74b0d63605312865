"""LiveRouter: the coordinator's dispatch as swarm routing (K1-K4), on plain data."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import UncoveredSlice
from kvq.slices import slice_id
from kvq.swarm import LivePolicy, LiveRouter, WorkerView

SLICES = [slice_id(layer, layer + 1, e, e + 4) for layer in range(3) for e in (0, 4)]  # 6 slices
S0, S1, S2 = SLICES[0], SLICES[1], SLICES[2]


def _router() -> LiveRouter:
    return LiveRouter("tiny", SLICES, "coord", LivePolicy(grace_ms=1000.0))


def _proven(wid: str, sid: str, alive: bool = True) -> WorkerView:
    return WorkerView(wid, sid, alive=alive, last_serve_ms=1_700_000_000_000)


def _feed(r: LiveRouter, *workers: WorkerView, now: float = 0.0, latency: float = 5.0) -> None:
    r.update_workers(workers, now)
    for w in workers:
        if w.last_serve_ms:  # and a result of it was checked here: proven
            r.observe_result(w.worker_id, latency, verified=True)


@pytest.mark.parametrize("latency", [0.0, 0.5, 5.0])
def test_at_rest_the_all_local_copy_wins(latency: float) -> None:
    r = _router()
    _feed(r, *(_proven(f"w{i}", s) for i, s in enumerate(SLICES)), latency=latency)
    r.set_slots(1, 4)  # below saturation_threshold = 2
    route = r.route(0.0)
    assert route.pipeline_id == 0 and route.remote == {}
    assert all(route.worker(s) is None for s in SLICES)


def test_under_load_copies_of_proven_workers_win() -> None:
    r = _router()
    _feed(r, _proven("w0", S0), _proven("w1", S1))
    r.set_slots(2, 4)
    route = r.route(0.0)
    assert route.remote == {S0: "w0", S1: "w1"}
    assert route.worker(S2) is None  # uncovered by workers: local
    r.set_slots(0, 4)
    assert r.route(0.0).remote == {}


def test_a_slow_proven_worker_loses_even_under_load() -> None:
    r = _router()
    _feed(r, _proven("w0", S0), latency=400.0)
    r.set_slots(4, 4)
    assert r.route(0.0).remote == {}


def test_saying_it_served_elsewhere_earns_a_probe_not_work() -> None:
    """`last_serve_ms` is self-reported: it decides nothing but makes the worker worth a
    re-probe, whose checked answer proves it (issue 11)."""
    r = LiveRouter("tiny", SLICES, "coord", LivePolicy(grace_ms=0.0, reprobe_ms=100.0))
    r.update_workers([_proven("w0", S0)], 0.0)  # last_serve_ms > 0, no result checked here
    r.set_slots(2, 4)
    assert r.route(50.0).remote == {}, "not proven here: no work under load"
    probe = r.route(200.0, [S0])
    assert (probe.trial, probe.remote) == ("w0", {S0: "w0"})
    r.observe_result("w0", 5.0, verified=True)
    assert r.route(300.0).remote == {S0: "w0"}


def test_unproven_worker_gets_one_trial_in_its_grace_window_under_load_only() -> None:
    r = _router()
    r.update_workers([WorkerView("new", S1)], now_ms=1000.0)
    r.set_slots(0, 4)
    assert r.route(1100.0).remote == {}  # at rest: no trial
    r.set_slots(3, 4)
    trial = r.route(1200.0)
    assert (trial.pipeline_id, trial.trial, trial.remote) == (-1, "new", {S1: "new"})
    again = r.route(1300.0)
    assert again.trial is None and "new" not in again.remote.values()  # one try only
    r.observe_result("new", 6.0, verified=True)  # it answered: proven
    assert r.route(1400.0).remote == {S1: "new"}
    info = r.describe()
    assert info["proven"] == ["new"] and info["loaded"] is True and info["trials_pending"] == []


def test_a_trial_is_only_spent_on_a_slice_with_work() -> None:
    r = _router()
    r.update_workers([WorkerView("new", S2)], now_ms=0.0)
    r.set_slots(2, 4)
    assert r.route(10.0, active={S0, S1}).trial is None  # S2 is in another layer
    assert r.describe()["trials_pending"] == ["new"]
    trial = r.route(20.0, active={S2})
    assert trial.trial == "new" and trial.worker(S2) == "new"


@pytest.mark.parametrize("given_first_seen", [False, True])
def test_unproven_worker_outside_grace_is_not_recruited_only_probed(
    given_first_seen: bool,
) -> None:
    """K4: past its grace window an unproven worker gets no work, only one checked probe per
    `reprobe_ms` (counted from when it was first seen), so a worker that joined while the
    machine idled is not left out for good."""
    r = LiveRouter("tiny", SLICES, "coord", LivePolicy(grace_ms=1000.0, reprobe_ms=5000.0))
    if given_first_seen:  # the caller's own first-seen time wins over the router's
        r.update_workers([WorkerView("late", S1, first_seen_ms=0.0)], now_ms=1500.0)
    else:
        r.update_workers([WorkerView("late", S1)], now_ms=0.0)
    r.set_slots(4, 4)
    for now in (2000.0, 4000.0):
        route = r.route(now)
        assert route.trial is None and route.remote == {}, "no trial past its window"
    probe = r.route(5000.0)
    assert probe.trial == "late" and probe.remote == {S1: "late"} and probe.pipeline_id == -1
    assert r.probes == 1
    for now in (5001.0, 9000.0):
        route = r.route(now)
        assert route.trial is None and route.remote == {}, "not recruited: one probe per interval"
    assert r.route(10_000.0).trial == "late"


def test_heartbeat_expiry_fails_over_and_stops_dispatching_to_it() -> None:
    r = _router()
    _feed(r, _proven("w0", S0), _proven("w1", S1))
    r.set_slots(2, 4)
    assert r.route(0.0).remote == {S0: "w0", S1: "w1"}
    rescue = r.mark_down("w0")
    assert rescue is not None and rescue.result is not None
    assert rescue.lost.pipeline.nodes == {"coord", "w0", "w1"}
    assert "w0" not in rescue.result.route.pipeline.nodes
    assert rescue.result.rung == "copy" and not rescue.result.degraded
    assert r.route(0.0).remote == {S1: "w1"}  # re-planned without w0
    assert r.mark_down("w0") is None


def test_spreads_over_several_workers_of_a_slice_by_cost() -> None:
    r = _router()
    _feed(r, _proven("a", S0), _proven("b", S0))
    r.set_slots(2, 4)
    assert r.route(0.0).remote == {S0: "a"}  # tie → lower pipeline id
    for _ in range(5):
        r.observe_result("a", 80.0, verified=True)
    assert r.route(0.0).remote == {S0: "b"}


def test_uncovered_slice_refuses_the_model_until_coverage_returns() -> None:
    r = LiveRouter("tiny", SLICES, "coord", local_slices=SLICES[1:])
    with pytest.raises(UncoveredSlice, match=S0):
        r.check()
    with pytest.raises(UncoveredSlice):
        r.route(0.0)
    r.update_workers([WorkerView("w", S0)], 0.0)  # unproven, but the only holder of S0
    r.check()
    assert r.route(0.0).remote == {S0: "w"}
    r.mark_down("w")
    with pytest.raises(UncoveredSlice):
        r.check()


def test_replans_only_when_coverage_changes() -> None:
    r = _router()
    views = [_proven("w0", S0), WorkerView("x", "L999-999:E0000-0001")]  # other model's slice
    assert r.update_workers(views, 0.0) is False, "unproven here: no copy uses it"
    n = r.replans
    r.observe_result("w0", 3.0, verified=True)
    assert r.replans == n + 1, "a checked result proves it: a copy with it"
    n = r.replans
    assert r.update_workers(views, 10.0) is False
    r.set_slots(3, 4)
    r.route(0.0)
    assert r.replans == n
    assert r.update_workers([_proven("w0", S0, alive=False)], 20.0) is True
    assert r.update_workers([], 30.0) is False  # a dead worker leaving changes no copy
    assert r.update_workers([_proven("w0", S0)], 40.0) is False, "back: to be proven again"


def test_route_is_fast_and_allocation_free_on_steady_state() -> None:
    r = _router()
    _feed(r, *(_proven(f"w{i}", s) for i, s in enumerate(SLICES)))
    r.set_slots(3, 4)
    first = r.route(0.0)
    t0 = time.perf_counter()
    for _ in range(20_000):
        assert r.route(0.0) is first
    assert time.perf_counter() - t0 < 1.0


_worker = st.builds(
    WorkerView,
    st.sampled_from(["a", "b", "c", "d", "e"]),
    st.sampled_from(SLICES),
    st.booleans(),
    st.sampled_from([0, 1]),
    st.one_of(st.none(), st.floats(0, 1)),
)
_event = st.one_of(
    st.tuples(st.just("result"), st.sampled_from("abcde"), st.floats(0, 300)),
    st.tuples(st.just("failure"), st.sampled_from("abcde"), st.floats(0, 3000)),
    st.tuples(st.just("down"), st.sampled_from("abcde"), st.just(0.0)),
    st.tuples(st.just("slots"), st.integers(0, 4), st.just(0.0)),
)


@settings(max_examples=150, deadline=None, database=None)
@given(
    st.lists(_worker, max_size=6),
    st.lists(_event, max_size=10),
    st.sets(st.sampled_from(SLICES)),
    st.floats(0, 3000),
)
def test_live_routes_only_send_to_live_eligible_holders(
    workers: list[WorkerView],
    events: list[tuple[str, str | int, float]],
    local: set[str],
    now: float,
) -> None:
    r = LiveRouter("tiny", SLICES, "coord", LivePolicy(grace_ms=1000.0), local_slices=local)
    r.update_workers(workers, 0.0)
    for kind, who, x in events:
        if kind == "result":
            r.observe_result(str(who), x, verified=True)
        elif kind == "failure":
            r.observe_failure(str(who), x)
        elif kind == "down":
            r.mark_down(str(who))
        else:
            r.set_slots(int(who), 4)
    # one view per (worker, slice): a worker holds every slice it has a view of, and its
    # first view carries what is per worker (alive, load: one heartbeat says them all)
    views: dict[str, WorkerView] = {}
    slices_of: dict[str, set[str]] = {}
    for w in workers:
        views.setdefault(w.worker_id, w)
        slices_of.setdefault(w.worker_id, set()).add(w.slice_id)
    dead = {e[1] for e in events if e[0] == "down"}
    served = {e[1] for e in events if e[0] == "result" and e[1] in views}
    live = {w: v for w, v in views.items() if v.alive and w not in dead}
    held = {s for s in SLICES if s in local or any(s in slices_of[w] for w in live)}
    if held != set(SLICES):
        with pytest.raises(UncoveredSlice):
            r.route(now)
        return
    route = r.route(now)
    assert route is r.route(now) or route.trial is not None
    if not r.loaded:
        assert route.trial is None
        if local == set(SLICES):
            assert route.remote == {}
    for sid, wid in route.remote.items():
        assert wid in live and sid in slices_of[wid]
        proven = wid in served  # a checked result, never the self-reported last_serve_ms
        forced = sid not in local and not any(sid in slices_of[u] and u in served for u in live)
        assert proven or forced or wid == route.trial
    if route.trial is not None:
        assert r.loaded and now < 1000.0


def test_a_priced_out_worker_is_re_probed_and_wins_work_back() -> None:
    """One slow sample (a cold start) prices w0 out; under load it gets one job every
    `reprobe_ms`, and a fast answer to the probe brings it back into the route."""
    r = LiveRouter("tiny", SLICES, "coord", LivePolicy(grace_ms=1000.0, reprobe_ms=5000.0))
    _feed(r, _proven("w0", S0), now=0.0, latency=400.0)
    r.set_slots(4, 4)
    assert r.route(0.0).remote == {}, "priced out by its slow sample"
    assert r.route(4999.0, [S0]).remote == {}, "no probe before reprobe_ms"
    assert r.route(5000.0, [S1]).remote == {}, "a probe only goes where the layer has work"
    probe = r.route(5000.0, [S0])
    assert probe.pipeline_id == -1 and probe.trial == "w0" and probe.remote == {S0: "w0"}
    assert r.route(5001.0, [S0]).remote == {}, "one job per probe"
    r.observe_result("w0", 5.0, verified=True)  # it got faster
    assert r.route(5002.0, [S0]).remote == {S0: "w0"}, "won work back"
    assert r.describe()["probes"] == 1


def test_no_probes_at_rest_and_a_still_slow_worker_stays_out() -> None:
    r = LiveRouter("tiny", SLICES, "coord", LivePolicy(grace_ms=1000.0, reprobe_ms=1000.0))
    _feed(r, _proven("w0", S0), now=0.0, latency=400.0)
    r.set_slots(0, 4)
    assert r.route(10_000.0, [S0]).remote == {}, "at rest everything stays local (K1)"
    r.set_slots(4, 4)
    assert r.route(10_000.0, [S0]).trial == "w0"
    r.observe_result("w0", 450.0, verified=True)  # still slow: stays out until the next probe
    assert r.route(10_500.0, [S0]).remote == {}
    assert r.route(11_000.0, [S0]).trial == "w0"


def test_estimates_fade_toward_the_prior_without_samples() -> None:
    """No samples for three half-lives: a 400 ms verdict fades to ~94 ms and the worker wins
    the route under load again, without any probe."""
    r = LiveRouter("tiny", SLICES, "coord", LivePolicy(reprobe_ms=1e12, half_life_ms=10_000.0))
    w0 = _proven("w0", S0)
    _feed(r, w0, now=0.0, latency=400.0)
    r.set_slots(4, 4)
    assert r.route(0.0).remote == {}
    r.update_workers([w0], 10_000.0)  # one half-life: 400 -> 225 ms, still out
    assert r.route(10_000.0).remote == {}
    r.update_workers([w0], 30_000.0)  # three: 50 + 350 / 8 = 93.75 ms
    lat = r.state.telemetry["w0"].latency_ms
    assert lat is not None and abs(lat - 93.75) < 1e-6
    assert r.route(30_000.0).remote == {S0: "w0"}


# -- a worker serving several slices of the model (issue 10 item 4) -------------------------
def test_one_worker_serving_several_slices_takes_each_of_them() -> None:
    r = _router()
    _feed(r, _proven("multi", S0), _proven("multi", S1), _proven("multi", S2))
    r.set_slots(2, 4)
    assert r.route(0.0).remote == {S0: "multi", S1: "multi", S2: "multi"}
    rescue = r.mark_down("multi")
    assert rescue is not None
    assert r.route(0.0).remote == {}, "down: every slice it served goes local"


def test_a_trial_of_a_multi_slice_worker_uses_a_slice_with_work() -> None:
    r = _router()
    r.update_workers([WorkerView("new", S0), WorkerView("new", S2)], now_ms=0.0)
    r.set_slots(2, 4)
    trial = r.route(10.0, active={S2})
    assert trial.trial == "new" and trial.remote == {S2: "new"}


def test_uncovered_until_a_multi_slice_worker_covers_every_slice() -> None:
    r = LiveRouter("tiny", SLICES[:2], "coord", local_slices=[])
    r.update_workers([WorkerView("w", SLICES[0])], 0.0)
    with pytest.raises(UncoveredSlice):
        r.check()
    r.update_workers([WorkerView("w", SLICES[0]), WorkerView("w", SLICES[1])], 1.0)
    r.check()
    assert r.route(2.0).remote == {SLICES[0]: "w", SLICES[1]: "w"}


def _jobs_and_probes(fast_after_probe: bool) -> tuple[list[float], int]:
    """40 s of load, a layer call every 100 ms: w0 answers its probes in 5 ms and its other
    jobs in 5 ms (`fast_after_probe`: an honest worker that got faster) or in 900 ms (a
    degrader). Returns the probe times and the other jobs it got."""
    r = LiveRouter("tiny", SLICES, "coord", LivePolicy(grace_ms=1000.0, reprobe_ms=1000.0))
    _feed(r, _proven("w0", S0), now=0.0, latency=400.0)
    r.set_slots(4, 4)
    probes, jobs = [], 0
    for i in range(400):
        now = 100.0 * i
        route = r.route(now, [S0])
        if route.trial == "w0":
            probes.append(now)
            r.observe_result("w0", 5.0, verified=True)
        elif route.remote.get(S0) == "w0":
            jobs += 1
            r.observe_result("w0", 5.0 if fast_after_probe else 900.0)
    return probes, jobs


def test_a_worker_fast_only_when_probed_is_probed_ever_less_often() -> None:
    """K4 re-probes against a degrader: it answers probes at once and other jobs near the deadline.
    Each probe's promise broken doubles its wait for the next (2, 4, 8, 16 s apart: 5 probes
    and 5 slow jobs in 40 s; 36 and 36 without the backoff), so the slow jobs it gets fall
    geometrically; an honest worker that got faster keeps to its probe and keeps its share."""
    probes, slow_jobs = _jobs_and_probes(fast_after_probe=False)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(probes) <= 7 and gaps == sorted(gaps) and gaps[-1] >= 8_000, gaps
    honest_probes, jobs = _jobs_and_probes(fast_after_probe=True)
    assert len(honest_probes) == 1 and jobs > 300, (honest_probes, jobs)
    assert slow_jobs <= 2 * len(probes), "a broken promise prices it out again at once"
