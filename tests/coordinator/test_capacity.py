"""The capacity assignment: never slower than all-local under its own estimates, close to the
exhaustive optimum on small cases, and estimates fed the way dispatch feeds them."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.coordinator.capacity import Capacity, CostFit, assign, makespan

C = "coord"


def _linear(rate: dict[str, float]):
    """compute_ms of nodes that cost `rate[node]` ms per row."""
    return lambda node, rows: rate[node] * rows


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
    return work, cands, _linear(rate), over


@settings(max_examples=300, deadline=None, derandomize=True)
@given(layers(max_slices=10, max_workers=4))
def test_never_slower_than_all_local(case) -> None:
    work, cands, rate, over = case
    got = assign(work, cands, rate, over.__getitem__)
    assert set(got) == set(work) and all(got[s] in cands[s] for s in work)
    local = makespan({s: C for s in work}, work, rate, over.__getitem__)
    assert makespan(got, work, rate, over.__getitem__) <= local + 1e-9


@settings(max_examples=300, deadline=None, derandomize=True)
@given(layers(max_workers=3))
def test_within_the_stated_gap_of_the_exhaustive_optimum(case) -> None:
    work, cands, rate, over = case
    r, o = rate, over.__getitem__
    sids = sorted(work)
    best = min(
        makespan(dict(zip(sids, choice, strict=True)), work, r, o)
        for choice in itertools.product(*(cands[s] for s in sids))
    )
    assert makespan(assign(work, cands, r, o), work, r, o) <= GAP * best + 1e-9


def test_a_fast_cheap_worker_takes_about_half_of_equal_slices() -> None:
    work = {f"s{i}": 10 for i in range(8)}
    cands = {s: [C, "w"] for s in work}
    got = assign(work, cands, _linear({C: 1.0, "w": 1.0}), {C: 0.0, "w": 5.0}.__getitem__)
    assert sum(n == "w" for n in got.values()) in (3, 4)  # 40 ms + 5 overhead vs 40-50 local


def test_a_round_trip_dearer_than_the_work_keeps_everything_local() -> None:
    work = {"a": 2, "b": 3}
    cands = {s: [C, "w"] for s in work}
    got = assign(work, cands, _linear({C: 0.05, "w": 0.01}), {C: 0.0, "w": 3.0}.__getitem__)
    assert set(got.values()) == {C}


def test_estimates_come_from_what_dispatch_measures() -> None:
    cap = Capacity(C, alpha=0.5, prior_overhead_ms=50.0, prior_ms_per_row=0.1)
    assert cap.compute_ms("w", 10) == 1.0 and cap.overhead_ms("w") == 50.0  # priors
    cap.observe_local(rows=10, ms=5.0)  # one row count: 0.5 ms per row
    assert cap.compute_ms(C, 20) == 10.0 and cap.compute_ms("w", 20) == 10.0  # unmeasured: ours
    cap.observe_remote("w", rows=10, latency_ms=12.0, compute_ms=2.0)
    assert cap.compute_ms("w", 10) == 2.0 and cap.overhead_ms("w") == 10.0
    cap.observe_remote("w", rows=10, latency_ms=4.0, compute_ms=4.0)  # EWMA, alpha 0.5
    assert cap.overhead_ms("w") == 5.0
    cap.observe_remote("w", rows=0, latency_ms=1.0, compute_ms=1.0)  # no rows: no sample
    assert cap.overhead_ms("w") == 5.0
    cap.forget("w")
    assert cap.overhead_ms("w") == 50.0 and cap.overhead_ms(C) == 0.0


def test_cost_fit_separates_the_fixed_part_from_the_per_row_part() -> None:
    """An 8-row decode call and a 200-row prefill call of one slice: a per-row rate would be
    4x off for one of them; the fit gets both."""
    fit = CostFit(alpha=0.2)
    for _ in range(20):
        fit.add(8, 6.0 + 0.25 * 8)
        fit.add(200, 6.0 + 0.25 * 200)
    fixed, per_row = fit.terms()
    assert abs(fixed - 6.0) < 1e-6 and abs(per_row - 0.25) < 1e-6
    assert abs(fit.ms(64) - 22.0) < 1e-6
    flat = CostFit(alpha=0.2)
    flat.add(8, 1.0)
    flat.add(8, 3.0)
    assert flat.terms()[0] == 0.0 and abs(flat.ms(8) - flat.sy / flat.n) < 1e-9
    neg = CostFit(alpha=0.5)  # samples whose line would cross below 0: fitted through 0
    neg.add(10, 1.0)
    neg.add(100, 100.0)
    assert neg.terms()[0] == 0.0 and neg.terms()[1] > 0
