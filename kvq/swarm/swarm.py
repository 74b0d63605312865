"""The swarm lifecycle (H8): new, route, mark_down, mark_alive, add_node, remove_node, status.

Synchronous and pure: the caller owns time and I/O. Status:
- `stopped` after `stop()`;
- `failed` iff no node is alive (zero live nodes, not zero copies);
- `healthy` when every model has all the copies asked for and none has a down node;
- `degraded` otherwise: survivors keep serving (failover, fewer copies).
`add_node` and `remove_node` re-plan, keeping every intact copy and placing new copies on live
nodes only; a copy with a down node is dropped then (its node's memory is not trusted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvq.errors import (
    CapacityError,
    NoRoute,
    RoutingError,
    TopologyError,
    UnknownNode,
    Unrecoverable,
)
from kvq.swarm.plan import SwarmPlan, place
from kvq.swarm.route import failover_in_swarm
from kvq.swarm.state import SwarmState
from kvq.swarm.types import (
    CostWeights,
    FailoverOptions,
    FailoverResult,
    ModelSpec,
    NodeProfile,
    Route,
    RoutingRequest,
    Status,
)


@dataclass(frozen=True, slots=True)
class SwarmConfig:
    """Copies per model, EWMA weight of a new sample, cost weights, failover options."""

    pipelines: int = 1
    alpha: float = 0.3
    weights: CostWeights = field(default_factory=CostWeights)
    failover: FailoverOptions = field(default_factory=FailoverOptions)

    def __post_init__(self) -> None:
        if self.pipelines < 1:
            raise TopologyError(f"pipelines must be >= 1, got {self.pipelines}")
        if not 0.0 < self.alpha <= 1.0:
            raise TopologyError(f"alpha must be in (0, 1], got {self.alpha}")


@dataclass(frozen=True, slots=True)
class Rescue:
    """What `mark_down` computed for one model whose route held the node."""

    model_id: str
    lost: Route
    result: FailoverResult | None
    error: Unrecoverable | None = None


@dataclass(frozen=True, slots=True)
class Replan:
    """What a re-plan changed: copies dropped and added, and copies still missing per model."""

    dropped: tuple[int, ...]
    added: tuple[int, ...]
    missing: dict[str, int]


class Swarm:
    """Several models on one set of nodes, each request routed to a copy of its own model."""

    def __init__(
        self,
        profiles: Sequence[NodeProfile],
        models: Sequence[ModelSpec],
        config: SwarmConfig | None = None,
    ) -> None:
        self.config = config or SwarmConfig()
        ids = [p.node_id for p in profiles]
        if len(set(ids)) != len(ids):
            raise TopologyError(f"node ids must be unique: {sorted(ids)}")
        if len({m.model_id for m in models}) != len(models):
            raise TopologyError("model ids must be unique")
        self._profiles = {p.node_id: p for p in profiles}
        self._models = {m.model_id: m for m in models}
        self._stopped = False
        pipes = place(profiles, models, self.config.pipelines)
        plan = SwarmPlan(self._profiles, self._models, pipes, self.config.pipelines)
        plan.validate()
        for m in models:
            if not plan.of_model(m.model_id):
                need = sum(s.gib for s in m.slices)
                raise CapacityError(
                    f"model {m.model_id!r} needs {need:.2f} GiB per copy; the nodes' memory "
                    f"({sum(p.memory_gib for p in profiles):.2f} GiB in all) cannot place one"
                )
        self._next_id = plan.next_id
        self.state = SwarmState(plan, None, self.config.weights, self.config.alpha)

    @property
    def plan(self) -> SwarmPlan:
        return self.state.plan

    def route(self, model_id: str, request: RoutingRequest | None = None) -> Route:
        if self._stopped:
            raise RoutingError("the swarm is stopped")
        return self.state.route(model_id, (request or RoutingRequest()).tokens)

    def observe(
        self,
        node_id: str,
        latency_ms: float | None = None,
        load: float | None = None,
        score: float | None = None,
    ) -> None:
        self.state.observe(node_id, latency_ms, load, score)

    def mark_down(self, node_id: str) -> tuple[Rescue, ...]:
        """Computes each affected model's rescue from the route it was using, then marks the
        node down (in that order: the failover must know what was lost)."""
        if not self.state.alive(node_id):
            return ()
        rescues: list[Rescue] = []
        for model in self._models:
            try:
                lost = self.state.route(model)
            except NoRoute:
                continue
            if node_id not in lost.pipeline.nodes:
                continue
            try:
                res = failover_in_swarm(lost, node_id, self.state, self.config.failover)
                rescues.append(Rescue(model, lost, res))
            except Unrecoverable as exc:
                rescues.append(Rescue(model, lost, None, exc))
        self.state.set_alive(node_id, False)
        return tuple(rescues)

    def mark_alive(self, node_id: str) -> None:
        self.state.set_alive(node_id, True)

    def add_node(self, profile: NodeProfile) -> Replan:
        """Growth without restart: the newcomer's memory joins the next placement."""
        if profile.node_id in self._profiles:
            raise TopologyError(f"node {profile.node_id!r} is already in the swarm")
        self._profiles[profile.node_id] = profile
        return self._replan()

    def remove_node(self, node_id: str) -> Replan:
        """Retires a node: copies using it are dropped and relocated where memory allows."""
        if node_id not in self._profiles:
            raise UnknownNode(f"unknown node {node_id!r}; known: {sorted(self._profiles)}")
        del self._profiles[node_id]
        return self._replan()

    def _replan(self) -> Replan:
        old = self.state
        live = [
            p for n, p in self._profiles.items() if n not in old.telemetry or old.telemetry[n].alive
        ]
        live_ids = {p.node_id for p in live}
        keep = [p for p in old.plan.pipelines if p.nodes <= live_ids]
        pipes = place(live, list(self._models.values()), self.config.pipelines, keep, self._next_id)
        plan = SwarmPlan(dict(self._profiles), self._models, pipes, self.config.pipelines)
        plan.validate()
        self._next_id = max(self._next_id, plan.next_id)
        telemetry = {n: t for n, t in old.telemetry.items() if n in self._profiles}
        self.state = SwarmState(plan, telemetry, self.config.weights, self.config.alpha)
        before = {p.pipeline_id for p in old.plan.pipelines}
        after = {p.pipeline_id for p in pipes}
        missing = {
            m: self.config.pipelines - len(plan.of_model(m))
            for m in self._models
            if len(plan.of_model(m)) < self.config.pipelines
        }
        return Replan(tuple(sorted(before - after)), tuple(sorted(after - before)), missing)

    def alive_nodes(self) -> list[str]:
        return [n for n, t in self.state.telemetry.items() if t.alive]

    def status(self) -> Status:
        if self._stopped:
            return "stopped"
        if not any(t.alive for t in self.state.telemetry.values()):
            return "failed"
        plan = self.state.plan
        for m in self._models:
            copies = plan.of_model(m)
            if len(copies) < self.config.pipelines:
                return "degraded"
            if any(not self.state.alive(n) for p in copies for n in p.nodes):
                return "degraded"
        return "healthy"

    def stop(self) -> None:
        self._stopped = True
