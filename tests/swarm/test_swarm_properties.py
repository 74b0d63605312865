"""Properties of routing, failover and the lifecycle on random swarms and random event sequences.

- a route never holds a down node or another model's copy, and is the reference argmin;
- two consecutive routes on the same state are identical;
- failover returns a valid route or a typed error, never an invalid route;
- status is `failed` iff zero nodes are alive;
- `mark_down` computes the rescue from the route that was lost;
- the plan validates after every growth and removal.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvq.errors import CapacityError, NoRoute, RoutingError, Unrecoverable
from kvq.swarm import (
    FailoverOptions,
    FailoverResult,
    ModelSpec,
    NodeProfile,
    Pipeline,
    Route,
    RoutingRequest,
    Swarm,
    SwarmConfig,
    SwarmPlan,
    SwarmState,
    failover_in_swarm,
    pipeline_cost,
    route_problems,
    route_request,
)

FAST = settings(max_examples=150, deadline=None, database=None)

_mem = st.sampled_from([2.0, 4.0, 8.0, 16.0, 32.0])
_lat = st.one_of(st.none(), st.floats(0, 60, allow_nan=False))
_score = st.sampled_from([0.0, 0.5, 1.0, 2.0])


@st.composite
def swarms(draw: st.DrawFn) -> Swarm:
    nodes = [
        NodeProfile(f"n{i}", draw(_mem), draw(_lat), draw(_score))
        for i in range(draw(st.integers(1, 7)))
    ]
    n_models = draw(st.integers(1, 3))
    models = []
    for j in range(n_models):
        fallback = f"m{j + 1}" if j + 1 < n_models and draw(st.booleans()) else None
        layers = draw(st.integers(1, 5))
        experts = draw(st.sampled_from([1, 4]))
        models.append(
            ModelSpec.layered(
                f"m{j}",
                layers,
                draw(st.sampled_from([0.5, 1.0, 2.0])),
                experts,
                experts // 2 or 1,
                fallback,
            )
        )
    try:
        return Swarm(nodes, models, SwarmConfig(pipelines=draw(st.integers(1, 3))))
    except CapacityError:
        assume(False)
        raise


_op = st.one_of(
    st.tuples(st.just("observe"), st.integers(0, 9), st.floats(0, 200), st.floats(0, 1)),
    st.tuples(st.just("down"), st.integers(0, 9)),
    st.tuples(st.just("alive"), st.integers(0, 9)),
    st.tuples(st.just("add"), _mem, _lat),
    st.tuples(st.just("remove"), st.integers(0, 9)),
)


def _reference(swarm: Swarm, model: str) -> tuple[float, int] | None:
    costs = [(pipeline_cost(p, swarm.state), p.pipeline_id) for p in swarm.plan.of_model(model)]
    best = min(costs, default=(math.inf, -1))
    return None if best[0] == math.inf else best


def _check_route(swarm: Swarm, model: str) -> Route | None:
    try:
        r = swarm.route(model)
    except NoRoute:
        assert _reference(swarm, model) is None
        return None
    again = swarm.route(model)
    assert (again.pipeline, again.cost) == (r.pipeline, r.cost)
    assert r.model_id == model
    assert all(swarm.state.alive(n) for n in r.pipeline.nodes)
    assert route_problems(r, swarm.state) == []
    assert _reference(swarm, model) == (r.cost, r.pipeline_id)
    return r


def _check_failover(swarm: Swarm, r: Route, dead: str) -> FailoverResult | None:
    try:
        res = failover_in_swarm(r, dead, swarm.state, swarm.config.failover)
    except Unrecoverable:
        return None
    assert route_problems(res.route, swarm.state, frozenset({dead})) == []
    assert res.degraded == (res.rung == "degraded")
    want = swarm.plan.models[r.model_id].fallback if res.degraded else r.model_id
    assert res.route.model_id == want
    assert bool(res.replaced) == (res.rung == "splice")
    return res


def _check(swarm: Swarm) -> None:
    assert swarm.plan.problems() == []
    alive = swarm.alive_nodes()
    assert (swarm.status() == "failed") == (not alive)
    for m in swarm.plan.models:
        r = _check_route(swarm, m)
        if r is not None:
            for dead in sorted(r.pipeline.nodes):
                _check_failover(swarm, r, dead)


def _mark_down(swarm: Swarm, node: str) -> None:
    expected: dict[str, Any] = {}
    if swarm.state.alive(node):
        for m in swarm.plan.models:
            try:
                lost = swarm.route(m)
            except NoRoute:
                continue
            if node in lost.pipeline.nodes:
                res = _check_failover(swarm, lost, node)
                expected[m] = (lost, None if res is None else res.route)
    got = {
        r.model_id: (r.lost, None if r.result is None else r.result.route)
        for r in swarm.mark_down(node)
    }
    assert got == expected
    assert not swarm.state.alive(node)


def _apply(swarm: Swarm, op: tuple[Any, ...], added: list[int]) -> None:
    nodes = sorted(swarm.plan.profiles)
    kind = op[0]
    if kind == "add":
        added[0] += 1
        swarm.add_node(NodeProfile(f"new{added[0]}", op[1], op[2]))
        return
    if not nodes:
        return
    node = nodes[op[1] % len(nodes)]
    if kind == "observe":
        swarm.observe(node, latency_ms=op[2], load=op[3])
    elif kind == "down":
        _mark_down(swarm, node)
    elif kind == "alive":
        swarm.mark_alive(node)
    elif kind == "remove":
        swarm.remove_node(node)


@FAST
@given(swarms(), st.lists(_op, max_size=12))
def test_every_event_sequence_keeps_the_invariants(
    swarm: Swarm, ops: list[tuple[Any, ...]]
) -> None:
    _check(swarm)
    added = [0]
    for op in ops:
        _apply(swarm, op, added)
        _check(swarm)


@FAST
@given(swarms(), st.integers(0, 9))
def test_killing_every_node_ends_failed_and_reviving_one_serves_again(swarm: Swarm, k: int) -> None:
    nodes = sorted(swarm.plan.profiles)
    for n in nodes:
        assert swarm.status() != "failed"
        _mark_down(swarm, n)
    assert swarm.status() == "failed"
    for m in swarm.plan.models:
        try:
            swarm.route(m)
            raise AssertionError("routed with every node down")
        except RoutingError:
            pass
    back = nodes[k % len(nodes)]
    swarm.mark_alive(back)
    whole = all(p.nodes == {back} for p in swarm.plan.pipelines) and all(
        len(swarm.plan.of_model(m)) == swarm.config.pipelines for m in swarm.plan.models
    )
    assert swarm.status() == ("healthy" if whole else "degraded")
    _check(swarm)


@st.composite
def raw_states(draw: st.DrawFn) -> SwarmState:
    """Hand-made plans (random assignments, shared nodes), where splices are common."""
    names = [f"n{i}" for i in range(draw(st.integers(2, 5)))]
    node = st.sampled_from(names)
    specs = {
        "m": ModelSpec.layered("m", draw(st.integers(1, 5)), 1.0, fallback="f"),
        "f": ModelSpec.layered("f", draw(st.integers(1, 3)), 1.0),
    }
    pipes: list[Pipeline] = []
    for m, spec in specs.items():
        for _ in range(draw(st.integers(1, 4))):
            a = tuple(draw(node) for _ in spec.slices)
            pipes.append(Pipeline(len(pipes), m, a))
    plan = SwarmPlan({n: NodeProfile(n) for n in names}, specs, tuple(pipes))
    state = SwarmState(plan)
    for n in names:
        state.observe(n, latency_ms=draw(st.floats(0, 100)), load=draw(st.floats(0, 1)))
        if draw(st.integers(0, 3)) == 0:
            state.set_alive(n, False)
    return state


@FAST
@given(raw_states(), st.booleans())
def test_failover_on_any_plan_is_valid_or_typed(state: SwarmState, degrade: bool) -> None:
    try:
        r = route_request("m", RoutingRequest(), state)
    except NoRoute:
        return
    for dead in sorted(r.pipeline.nodes):
        try:
            res = failover_in_swarm(r, dead, state, FailoverOptions(allow_degraded=degrade))
        except Unrecoverable:
            continue
        assert route_problems(res.route, state, frozenset({dead})) == []
        assert res.route.model_id == ("f" if res.degraded else "m")
        assert res.degraded == (res.rung == "degraded") and (degrade or not res.degraded)
        if res.rung == "splice":
            assert {x.dead for x in res.replaced} <= r.pipeline.nodes
            assert res.route.pipeline_id == r.pipeline_id
            assert res.route.cost == pipeline_cost(res.route.pipeline, state)
