"""Telemetry, the cost of H3, the H4 penalty, and route_request (H2) on hand-built plans."""

from __future__ import annotations

import math

import pytest

from kvq.errors import NoRoute, UnknownModel, UnknownNode
from kvq.swarm import (
    CostWeights,
    ModelSpec,
    NodeProfile,
    NodeTelemetry,
    Pipeline,
    RoutingRequest,
    SwarmPlan,
    SwarmState,
    node_cost,
    pipeline_cost,
    route_request,
)
from kvq.swarm.telemetry import UNMEASURED_LATENCY_MS, UNMEASURED_LOAD


def _plan(*assignments: tuple[str, ...], model: str = "m") -> SwarmPlan:
    n = len(assignments[0])
    spec = ModelSpec.layered(model, layers=n, layer_gib=1.0)
    nodes = sorted({x for a in assignments for x in a})
    pipes = tuple(Pipeline(i, model, a) for i, a in enumerate(assignments))
    return SwarmPlan({x: NodeProfile(x) for x in nodes}, {model: spec}, pipes)


def test_node_cost_is_the_formula_of_h3() -> None:
    t = NodeTelemetry(latency_ms=12.0, load=0.5, score=4.0)
    assert node_cost(t, CostWeights()) == pytest.approx(12 + 0.5 * 120 + 100 / 4)
    w = CostWeights(w_l=2.0, w_c=0.5, w_k=3.0)
    assert node_cost(t, w) == pytest.approx(24 + 0.25 * 120 + 3 * 25)
    assert node_cost(NodeTelemetry(latency_ms=0.0, load=0.0, score=0.0), CostWeights()) == 10_000


def test_unmeasured_node_is_penalised_not_ignored() -> None:
    cold = NodeTelemetry()
    assert cold.effective() == (UNMEASURED_LATENCY_MS, UNMEASURED_LOAD, 1.0)
    declared = NodeTelemetry(declared_latency_ms=3.0)
    assert declared.effective() == (3.0, UNMEASURED_LOAD, 1.0)
    declared.observe(0.5, load=0.0)  # measured now: the load penalty goes
    assert declared.effective() == (3.0, 0.0, 1.0)
    measured_best = node_cost(NodeTelemetry(latency_ms=3.0, load=0.0), CostWeights())
    assert node_cost(NodeTelemetry(declared_latency_ms=3.0), CostWeights()) > measured_best


def test_ewma_first_sample_sets_then_blends() -> None:
    t = NodeTelemetry()
    t.observe(0.25, latency_ms=40.0, load=2.0)
    assert (t.latency_ms, t.load) == (40.0, 1.0)  # load is clamped to [0, 1]
    t.observe(0.25, latency_ms=80.0, load=0.0)
    assert t.latency_ms == pytest.approx(50.0)
    assert t.load == pytest.approx(0.75)
    t.observe(0.25, latency_ms=math.nan, load=math.inf, score=math.nan)  # ignored
    assert t.latency_ms == pytest.approx(50.0) and t.load == pytest.approx(0.75) and t.score == 1.0


def test_pipeline_cost_counts_each_slice_hops_and_tokens() -> None:
    state = SwarmState(_plan(("a", "a", "b", "a")))
    for n, lat in (("a", 10.0), ("b", 20.0)):
        state.observe(n, latency_ms=lat, load=0.0)
    p = state.plan.pipelines[0]
    want = 3 * (10 + 100) + (20 + 100) + 2 * 15 + 10 * 2048 / 1024
    assert pipeline_cost(p, state, tokens=2048) == pytest.approx(want)
    assert route_request("m", RoutingRequest(tokens=2048), state).cost == pytest.approx(want)


def test_lowest_cost_wins_and_load_moves_traffic() -> None:
    state = SwarmState(_plan(("a", "a"), ("b", "b")))
    for n in "ab":
        state.observe(n, latency_ms=10.0, load=0.0)
    assert route_request("m", RoutingRequest(), state).pipeline_id == 0  # tie → lowest id
    state.observe("a", load=1.0)
    assert route_request("m", RoutingRequest(), state).pipeline_id == 1
    state.observe("b", load=1.0)
    state.observe("b", load=1.0)
    state.observe("a", load=0.0)
    assert route_request("m", RoutingRequest(), state).pipeline_id == 0


def test_ties_are_broken_by_pipeline_id_not_by_order() -> None:
    spec = ModelSpec.layered("m", layers=1, layer_gib=1.0)
    pipes = (Pipeline(9, "m", ("a",)), Pipeline(4, "m", ("b",)))
    plan = SwarmPlan({n: NodeProfile(n) for n in "ab"}, {"m": spec}, pipes)
    assert route_request("m", RoutingRequest(), SwarmState(plan)).pipeline_id == 4


def test_down_nodes_discard_copies_and_unknown_names_are_typed() -> None:
    state = SwarmState(_plan(("a", "b"), ("c", "c")))
    for n in "abc":
        state.observe(n, latency_ms=1.0 if n != "c" else 50.0, load=0.0)
    assert route_request("m", RoutingRequest(), state).pipeline_id == 0
    state.set_alive("b", False)
    assert route_request("m", RoutingRequest(), state).pipeline_id == 1
    state.set_alive("c", False)
    with pytest.raises(NoRoute, match="every copy"):
        route_request("m", RoutingRequest(), state)
    with pytest.raises(UnknownModel, match="'zz'"):
        route_request("zz", RoutingRequest(), state)
    with pytest.raises(UnknownNode, match="'zz'"):
        state.observe("zz", latency_ms=1.0)


def test_from_plan_is_cold_and_from_profiles_adds_declared_latency() -> None:
    spec = ModelSpec.layered("m", layers=1, layer_gib=1.0)
    plan = SwarmPlan(
        {"a": NodeProfile("a", latency_ms=2.0)}, {"m": spec}, (Pipeline(0, "m", ("a",)),)
    )
    assert SwarmState.from_plan(plan).node("a").effective()[0] == UNMEASURED_LATENCY_MS
    assert SwarmState.from_profiles(plan).node("a").effective()[0] == 2.0


def test_models_are_never_mixed() -> None:
    specs = {m: ModelSpec.layered(m, layers=2, layer_gib=1.0) for m in ("base", "expert")}
    pipes = (Pipeline(0, "base", ("slow", "slow")), Pipeline(1, "expert", ("fast", "fast")))
    plan = SwarmPlan({n: NodeProfile(n) for n in ("slow", "fast")}, specs, pipes)
    state = SwarmState(plan)
    state.observe("slow", latency_ms=500.0, load=1.0)
    state.observe("fast", latency_ms=1.0, load=0.0)  # the expert model is idle and cheap
    assert route_request("base", RoutingRequest(), state).pipeline.model_id == "base"
    state.set_alive("slow", False)
    with pytest.raises(NoRoute):
        route_request("base", RoutingRequest(), state)
