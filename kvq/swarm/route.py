"""Routing (H2) and failover inside the swarm (H6, H7), as functions of the state.

The failover ladder, in this fixed order:
(a) copy: the cheapest other live copy of the same model without the dead node (the plan
    guarantees it holds every slice) → `degraded=False`;
(b) splice: each slice the route lost (on the dead node, or on any other down node) goes to the
    cheapest live node holding that slice in some copy → `degraded=False`, `replaced=[...]`;
(c) degraded: if allowed and the model names a fallback, the cheapest live copy of the fallback
    model without the dead node → `degraded=True`, `fallback_model`;
(d) `Unrecoverable`.
`dead_node` is treated as down even while the state still has it alive: `Swarm.mark_down`
computes the rescue before it marks the node (H8).
"""

from __future__ import annotations

from kvq.errors import UnknownModel, Unrecoverable
from kvq.swarm.state import SwarmState, pipeline_cost
from kvq.swarm.types import (
    FailoverOptions,
    FailoverResult,
    Pipeline,
    Replacement,
    Route,
    RoutingRequest,
)


def route_request(model_id: str, request: RoutingRequest, state: SwarmState) -> Route:
    """H2: exactly this model, no down node, lowest cost, ties by pipeline_id."""
    return state.route(model_id, request.tokens)


def _splice(route: Route, dead_node: str, state: SwarmState, tokens: int) -> FailoverResult | None:
    p = route.pipeline
    new = list(p.assignment)
    replaced: list[Replacement] = []
    for i, node in enumerate(p.assignment):
        if node != dead_node and state.alive(node):
            continue
        live = [n for n in state.plan.holders(p.model_id, i) if n != dead_node and state.alive(n)]
        if not live:
            return None
        best = min(live, key=lambda n: (state.node_cost(n), n))
        new[i] = best
        replaced.append(Replacement(state.plan.models[p.model_id].slices[i].sid, node, best))
    spliced = Pipeline(p.pipeline_id, p.model_id, tuple(new))
    cost = pipeline_cost(spliced, state, tokens)
    return FailoverResult(Route(spliced, cost), "splice", False, tuple(replaced))


def failover_in_swarm(
    route: Route,
    dead_node: str,
    state: SwarmState,
    options: FailoverOptions | None = None,
    request: RoutingRequest | None = None,
) -> FailoverResult:
    """H6 in the order of H7: a valid rescue route, or `Unrecoverable`; never an invalid route."""
    opts = options or FailoverOptions()
    tokens = (request or RoutingRequest()).tokens
    model = route.model_id
    spec = state.plan.models.get(model)
    if spec is None:
        raise UnknownModel(
            f"unknown model {model!r}; this swarm serves {sorted(state.plan.models)}"
        )
    state.node(dead_node)
    copies = [
        r for r in state.ranked(model, without=dead_node) if r.pipeline_id != route.pipeline_id
    ]
    if copies:
        best = copies[0].pipeline
        return FailoverResult(Route(best, pipeline_cost(best, state, tokens)), "copy")
    spliced = _splice(route, dead_node, state, tokens)
    if spliced is not None:
        return spliced
    fallback = opts.fallback_model or spec.fallback
    if opts.allow_degraded and fallback is not None and fallback in state.plan.models:
        survivors = state.ranked(fallback, without=dead_node)
        if survivors:
            best = survivors[0].pipeline
            return FailoverResult(
                Route(best, pipeline_cost(best, state, tokens)), "degraded", True, (), fallback
            )
    why = (
        "no fallback model"
        if fallback is None
        else (
            "degradation not allowed"
            if not opts.allow_degraded
            else f"no live copy of {fallback!r}"
        )
    )
    raise Unrecoverable(
        f"model {model!r} lost node {dead_node!r}: no other live copy, some lost slice has no "
        f"live holder, and {why}; add or revive nodes holding its slices"
    )


def route_problems(
    route: Route, state: SwarmState, dead: frozenset[str] = frozenset()
) -> list[str]:
    """Why a route is invalid on this state (empty when it is valid)."""
    p = route.pipeline
    spec = state.plan.models.get(p.model_id)
    if spec is None:
        return [f"unknown model {p.model_id!r}"]
    out: list[str] = []
    if len(p.assignment) != len(spec.slices):
        out.append(f"covers {len(p.assignment)} of {len(spec.slices)} slices")
    for i, node in enumerate(p.assignment[: len(spec.slices)]):
        if node not in state.telemetry:
            out.append(f"unknown node {node!r}")
        elif node in dead or not state.alive(node):
            out.append(f"slice {i} on down node {node!r}")
        elif node not in state.plan.holders(p.model_id, i):
            out.append(f"slice {i} on {node!r}, which does not hold it")
    return out
