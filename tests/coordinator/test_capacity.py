"""The capacity assignment: never slower than all-local under its own estimates, close to the
exhaustive optimum on small cases, and estimates fed the way dispatch feeds them."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.coordinator.capacity import Capacity, assign, makespan

C = "coord"
GAP = 1.5  # stated bound (docs/routing.md): the worst of 60,000 random cases was 1.40


@st.composite
def layers(draw: st.DrawFn, max_slices: int = 6, max_workers: int = 2):
    n = draw(st.integers(1, max_slices))
    work = {f"s{i}": draw(st.integers(1, 64)) for i in range(n)}
    workers = [f"w{i}" for i in range(draw(st.integers(0, max_workers)))]
    rate = {C: draw(st.floats(0.01, 2.0))} | {w: draw(st.floats(0.01, 2.0)) for w in workers}
    over = {C: 0.0} | {w: draw(st.floats(0.0, 50.0)) for w in workers}
    cands = {
        s: [C] + [w for w in workers if draw(st.booleans())] for s in work
    }  # the coordinator holds every slice (KVQ_COORDINATOR_EXPERTS=all)
    return work, cands, rate, over


@settings(max_examples=300, deadline=None, derandomize=True)
@given(layers(max_slices=10, max_workers=4))
def test_never_slower_than_all_local(case) -> None:
    work, cands, rate, over = case
    got = assign(work, cands, rate.__getitem__, over.__getitem__)
    assert set(got) == set(work) and all(got[s] in cands[s] for s in work)
    local = makespan({s: C for s in work}, work, rate.__getitem__, over.__getitem__)
    assert makespan(got, work, rate.__getitem__, over.__getitem__) <= local + 1e-9


@settings(max_examples=300, deadline=None, derandomize=True)
@given(layers(max_workers=3))
def test_within_the_stated_gap_of_the_exhaustive_optimum(case) -> None:
    work, cands, rate, over = case
    r, o = rate.__getitem__, over.__getitem__
    sids = sorted(work)
    best = min(
        makespan(dict(zip(sids, choice, strict=True)), work, r, o)
        for choice in itertools.product(*(cands[s] for s in sids))
    )
    assert makespan(assign(work, cands, r, o), work, r, o) <= GAP * best + 1e-9


def test_a_fast_cheap_worker_takes_about_half_of_equal_slices() -> None:
    work = {f"s{i}": 10 for i in range(8)}
    cands = {s: [C, "w"] for s in work}
    got = assign(work, cands, {C: 1.0, "w": 1.0}.__getitem__, {C: 0.0, "w": 5.0}.__getitem__)
    assert sum(n == "w" for n in got.values()) in (3, 4)  # 40 ms + 5 overhead vs 40-50 local


def test_a_round_trip_dearer_than_the_work_keeps_everything_local() -> None:
    work = {"a": 2, "b": 3}
    cands = {s: [C, "w"] for s in work}
    got = assign(work, cands, {C: 0.05, "w": 0.01}.__getitem__, {C: 0.0, "w": 3.0}.__getitem__)
    assert set(got.values()) == {C}


def test_estimates_come_from_what_dispatch_measures() -> None:
    cap = Capacity(C, alpha=0.5, prior_overhead_ms=50.0, prior_ms_per_row=0.1)
    assert cap.ms_per_row("w") == 0.1 and cap.overhead_ms("w") == 50.0  # priors
    cap.observe_local(rows=10, ms=5.0)  # 0.5 ms per row
    assert cap.ms_per_row(C) == 0.5 and cap.ms_per_row("w") == 0.5  # unmeasured: own rate
    cap.observe_remote("w", rows=10, latency_ms=12.0, compute_ms=2.0)
    assert cap.ms_per_row("w") == 0.2 and cap.overhead_ms("w") == 10.0
    cap.observe_remote("w", rows=10, latency_ms=4.0, compute_ms=4.0)  # EWMA, alpha 0.5
    assert cap.ms_per_row("w") == 0.30000000000000004 or abs(cap.ms_per_row("w") - 0.3) < 1e-12
    assert cap.overhead_ms("w") == 5.0
    cap.observe_remote("w", rows=0, latency_ms=1.0, compute_ms=1.0)  # no rows: no sample
    assert cap.overhead_ms("w") == 5.0
    cap.forget("w")
    assert cap.overhead_ms("w") == 50.0
    assert cap.overhead_ms(C) == 0.0
