"""`kvq swarm-sim` (H9): the whole lifecycle in memory, as one JSON-ready document.

Steps, in this order: `start`; one `failover` per killed node; one `growth` per grown node; one
`removal` per removed node. Seeded traffic (`kvq.swarm.traffic`) runs between steps so that the
routes after the first are chosen on measured telemetry. Each step records the swarm status
after it, the route of the focus model (with `degraded` / `replaced` after a failover), and the
route of every model (H10: each model only ever gets its own copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvq.errors import RoutingError, UnknownModel, UnknownNode
from kvq.swarm.swarm import Replan, Rescue, Swarm, SwarmConfig
from kvq.swarm.topology import Topology
from kvq.swarm.traffic import Traffic
from kvq.swarm.types import FailoverOptions, NodeProfile


@dataclass(frozen=True, slots=True)
class SimOptions:
    """What to do to the swarm; `pipelines` None takes the topology's, else 1."""

    kills: tuple[str, ...] = ()
    grow: tuple[NodeProfile, ...] = ()
    removes: tuple[str, ...] = ()
    pipelines: int | None = None
    seed: int = 0
    requests: int = 64
    model: str | None = None
    allow_degraded: bool = True


def _check(topo: Topology, opts: SimOptions) -> str:
    """Unknown names fail before anything runs; returns the focus model."""
    models = [m.model_id for m in topo.models]
    model = opts.model or models[0]
    if model not in models:
        raise UnknownModel(f"unknown model {model!r}; the topology has {models}")
    nodes = {n.node_id for n in topo.nodes}
    for p in opts.grow:
        if p.node_id in nodes:
            raise UnknownNode(f"grown node {p.node_id!r} is already in the topology")
        nodes.add(p.node_id)
    for n in (*opts.kills, *opts.removes):
        if n not in nodes:
            raise UnknownNode(f"unknown node {n!r}; the topology has {sorted(nodes)}")
    return model


def _routes(swarm: Swarm) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in swarm.plan.models:
        try:
            out[m] = swarm.route(m).as_dict()
        except RoutingError as exc:
            out[m] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _record(step: str, swarm: Swarm, model: str, **extra: Any) -> dict[str, Any]:
    routes = _routes(swarm)
    rec: dict[str, Any] = {"step": step, "status": swarm.status()}
    if "route" in extra:
        rec["route"] = extra.pop("route")
    elif "error" in routes[model]:
        rec["route"], rec["error"] = None, routes[model]["error"]
    else:
        rec["route"] = routes[model]
    rec.update(extra)
    rec["routes"] = routes
    return rec


def _failover(swarm: Swarm, node: str, model: str) -> dict[str, Any]:
    rescues: dict[str, Rescue] = {r.model_id: r for r in swarm.mark_down(node)}
    r = rescues.get(model)
    if r is None:  # the focus model's route did not use the node: nothing was lost
        return _record("failover", swarm, model, node=node, rung=None, degraded=False, replaced=[])
    if r.result is None:
        return _record(
            "failover",
            swarm,
            model,
            node=node,
            route=None,
            rung=None,
            degraded=None,
            replaced=[],
            error=str(r.error),
        )
    res = r.result
    return _record(
        "failover",
        swarm,
        model,
        node=node,
        lost=r.lost.as_dict(),
        route=res.route.as_dict(),
        rung=res.rung,
        degraded=res.degraded,
        fallback_model=res.fallback_model,
        replaced=[{"slice": x.sid, "dead": x.dead, "node": x.node} for x in res.replaced],
    )


def _replan(step: str, swarm: Swarm, model: str, node: str, rp: Replan) -> dict[str, Any]:
    return _record(
        step,
        swarm,
        model,
        node=node,
        replan={"dropped": list(rp.dropped), "added": list(rp.added), "missing": rp.missing},
    )


def simulate(topo: Topology, opts: SimOptions) -> dict[str, Any]:
    """Runs the lifecycle and returns the report (`steps`, `final_plan_valid`, ...)."""
    model = _check(topo, opts)
    copies = opts.pipelines or topo.pipelines or 1
    config = SwarmConfig(pipelines=copies, failover=FailoverOptions(opts.allow_degraded))
    swarm = Swarm(topo.nodes, topo.models, config)
    traffic = Traffic(swarm, opts.seed)
    steps = [_record("start", swarm, model)]
    for node in opts.kills:
        traffic.run(opts.requests)
        steps.append(_failover(swarm, node, model))
    for prof in opts.grow:
        traffic.run(opts.requests)
        steps.append(_replan("growth", swarm, model, prof.node_id, swarm.add_node(prof)))
    for node in opts.removes:
        traffic.run(opts.requests)
        steps.append(_replan("removal", swarm, model, node, swarm.remove_node(node)))
    plan = swarm.plan
    final = [
        {"pipeline_id": p.pipeline_id, "model": p.model_id, "nodes": list(p.stages), "hops": p.hops}
        for p in plan.pipelines
    ]
    return {
        "model": model,
        "pipelines": copies,
        "seed": opts.seed,
        "requests_per_step": opts.requests,
        "steps": steps,
        "final_status": swarm.status(),
        "final_plan": final,
        "final_plan_valid": not plan.problems(),
        "traffic": {
            "requests": traffic.steps,
            "routed": traffic.routed,
            "unroutable": traffic.unroutable,
        },
    }
