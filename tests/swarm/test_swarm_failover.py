"""failover_in_swarm (H6) in the order of H7: copy → splice → degradation → Unrecoverable."""

from __future__ import annotations

import pytest

from kvq.errors import UnknownNode, Unrecoverable
from kvq.swarm import (
    FailoverOptions,
    ModelSpec,
    NodeProfile,
    Pipeline,
    RoutingRequest,
    SwarmPlan,
    SwarmState,
    failover_in_swarm,
    route_problems,
    route_request,
)


def _state(pipes: list[tuple[str, tuple[str, ...]]], fallback: str | None = None) -> SwarmState:
    models = {m for m, _ in pipes}
    specs = {
        m: ModelSpec.layered(
            m,
            layers=len(next(a for mm, a in pipes if mm == m)),
            layer_gib=1.0,
            fallback=fallback if m == "m" else None,
        )
        for m in models
    }
    nodes = sorted({n for _, a in pipes for n in a})
    plan = SwarmPlan(
        {n: NodeProfile(n) for n in nodes},
        specs,
        tuple(Pipeline(i, m, a) for i, (m, a) in enumerate(pipes)),
    )
    state = SwarmState(plan)
    for i, n in enumerate(nodes):
        state.observe(n, latency_ms=float(i), load=0.0)
    return state


def test_a_intact_copy_wins_first() -> None:
    state = _state([("m", ("a", "b", "c")), ("m", ("d", "b", "e")), ("m", ("x", "x", "x"))])
    state.observe("x", latency_ms=200.0)
    lost = route_request("m", RoutingRequest(), state)
    assert lost.pipeline_id == 0
    res = failover_in_swarm(lost, "b", state)  # copy 1 also uses b: copy 2 is the intact one
    assert (res.rung, res.degraded, res.replaced) == ("copy", False, ())
    assert res.route.pipeline_id == 2
    assert route_problems(res.route, state, frozenset({"b"})) == []


def test_b_splice_replaces_each_lost_slice_by_a_live_holder() -> None:
    state = _state([("m", ("a", "b", "c")), ("m", ("d", "e", "a"))])
    lost = route_request("m", RoutingRequest(), state)
    res = failover_in_swarm(lost, "a", state)  # copy 1 also uses a: no intact copy
    assert (res.rung, res.degraded) == ("splice", False)
    assert res.route.pipeline.assignment == ("d", "b", "c")
    assert [(r.dead, r.node) for r in res.replaced] == [("a", "d")]
    assert res.replaced[0].sid == state.plan.models["m"].slices[0].sid
    assert route_problems(res.route, state, frozenset({"a"})) == []


def test_splice_also_repairs_slices_on_nodes_already_down() -> None:
    state = _state([("m", ("a", "b", "c")), ("m", ("d", "e", "a"))])
    lost = route_request("m", RoutingRequest(), state)
    state.set_alive("c", False)
    with pytest.raises(Unrecoverable):  # slice 2: c is down and a is the dead node
        failover_in_swarm(lost, "a", state, FailoverOptions(allow_degraded=False))
    state.set_alive("c", True)
    state.set_alive("b", False)
    res = failover_in_swarm(lost, "a", state)
    assert res.route.pipeline.assignment == ("d", "e", "c")
    assert {(r.dead, r.node) for r in res.replaced} == {("a", "d"), ("b", "e")}


def test_c_degrades_to_the_fallback_model_when_allowed() -> None:
    state = _state([("m", ("a", "b")), ("m", ("a", "c")), ("lite", ("d",))], fallback="lite")
    lost = route_request("m", RoutingRequest(), state)
    res = failover_in_swarm(lost, "a", state)
    assert (res.rung, res.degraded, res.fallback_model) == ("degraded", True, "lite")
    assert res.route.model_id == "lite"
    with pytest.raises(Unrecoverable, match="degradation not allowed"):
        failover_in_swarm(lost, "a", state, FailoverOptions(allow_degraded=False))
    res = failover_in_swarm(lost, "a", state, FailoverOptions(fallback_model="lite"))
    assert res.fallback_model == "lite"


def test_d_unrecoverable_is_a_typed_error_naming_the_cause() -> None:
    state = _state([("m", ("a", "b"))])
    lost = route_request("m", RoutingRequest(), state)
    with pytest.raises(Unrecoverable, match="no fallback model"):
        failover_in_swarm(lost, "a", state)
    with pytest.raises(UnknownNode):
        failover_in_swarm(lost, "zz", state)


def test_dead_node_counts_as_down_before_it_is_marked() -> None:
    state = _state([("m", ("a", "a")), ("m", ("b", "b"))])
    state.observe("b", latency_ms=1000.0)
    lost = route_request("m", RoutingRequest(), state)
    assert state.alive("a") and lost.pipeline_id == 0
    res = failover_in_swarm(lost, "a", state, request=RoutingRequest(tokens=1024))
    assert res.route.pipeline_id == 1
    assert res.route.cost == pytest.approx(2 * state.node_cost("b") + 10.0)
