"""Swarm state (H1) = plan + telemetry, and the fast cost evaluation routing reads.

Per model the state keeps, for each copy, what never changes between plans (its distinct nodes,
how many slices each serves, its hop cost) and a cached cost. A telemetry sample recomputes one
node's cost and marks the copies that use it dirty; a route recomputes only the dirty copies and
takes the argmin. So routing costs microseconds and never re-plans.

The cost of a copy P (H3) with `n in P` ranging over P's slices, i.e. a node serving `k` slices
counts `k` times (its cost is per unit of work, so copies of one model compare on equal terms):
`sum(k_n * cost(n)) + w_h*15*hops + w_p*10*tokens/1024`, summed over P's distinct nodes in order
of first appearance (`pipeline_cost` is the same sum, computed from scratch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvq.errors import NoRoute, UnknownModel, UnknownNode
from kvq.swarm.plan import SwarmPlan
from kvq.swarm.telemetry import NodeTelemetry, hops_cost, node_cost, tokens_cost
from kvq.swarm.types import CostWeights, Pipeline, Route

_INF = math.inf


def _distinct(p: Pipeline) -> tuple[tuple[str, ...], tuple[int, ...]]:
    counts: dict[str, int] = {}
    for n in p.assignment:
        counts[n] = counts.get(n, 0) + 1
    return tuple(counts), tuple(counts.values())


class _Copies:
    """One model's copies in pipeline_id order, with their cached costs."""

    __slots__ = ("best", "cost", "counts", "dirty", "down", "nodes", "pipes", "static")

    def __init__(self, pipes: list[Pipeline]) -> None:
        self.pipes = pipes
        self.nodes: list[tuple[int, ...]] = []
        self.counts: list[tuple[int, ...]] = []
        self.static: list[float] = []
        self.down = [0] * len(pipes)
        self.cost = [_INF] * len(pipes)
        self.dirty: set[int] = set(range(len(pipes)))
        self.best = -1


class SwarmState:
    """The plan, each node's telemetry, and cached copy costs."""

    __slots__ = ("_cost", "_index", "_models", "_users", "alpha", "plan", "telemetry", "weights")

    def __init__(
        self,
        plan: SwarmPlan,
        telemetry: Mapping[str, NodeTelemetry] | None = None,
        weights: CostWeights | None = None,
        alpha: float = 0.3,
        declared: bool = True,
    ) -> None:
        """`telemetry` is reused where given (replans keep what was measured); other nodes start
        cold, with their declared latency when `declared` (H1: from_profiles vs from_plan)."""
        self.plan, self.weights, self.alpha = plan, weights or CostWeights(), alpha
        old = telemetry or {}
        self.telemetry: dict[str, NodeTelemetry] = {}
        for nid, prof in plan.profiles.items():
            t = old.get(nid)
            if t is None:
                t = NodeTelemetry(prof.latency_ms if declared else None, prof.score)
            self.telemetry[nid] = t
        self._index = {nid: i for i, nid in enumerate(self.telemetry)}
        self._cost = [node_cost(t, self.weights) for t in self.telemetry.values()]
        self._users: list[list[tuple[_Copies, int]]] = [[] for _ in self._index]
        self._models = {m: self._compile(plan.of_model(m)) for m in plan.models}

    @classmethod
    def from_plan(cls, plan: SwarmPlan, weights: CostWeights | None = None) -> SwarmState:
        """Cold telemetry: nothing declared, nothing measured (every node penalised, H4)."""
        return cls(plan, None, weights, declared=False)

    @classmethod
    def from_profiles(cls, plan: SwarmPlan, weights: CostWeights | None = None) -> SwarmState:
        """Cold telemetry plus each node's declared latency."""
        return cls(plan, None, weights, declared=True)

    def _compile(self, pipes: tuple[Pipeline, ...]) -> _Copies:
        c = _Copies(sorted(pipes, key=lambda p: p.pipeline_id))
        for j, p in enumerate(c.pipes):
            names, counts = _distinct(p)
            idx = tuple(self._index[n] for n in names)
            c.nodes.append(idx)
            c.counts.append(counts)
            c.static.append(hops_cost(p.hops, self.weights))
            c.down[j] = sum(1 for n in names if not self.telemetry[n].alive)
            for i in idx:
                self._users[i].append((c, j))
        return c

    # -- telemetry --------------------------------------------------------------------------
    def node(self, node_id: str) -> NodeTelemetry:
        t = self.telemetry.get(node_id)
        if t is None:
            raise UnknownNode(f"unknown node {node_id!r}; known: {sorted(self.telemetry)}")
        return t

    def observe(
        self,
        node_id: str,
        latency_ms: float | None = None,
        load: float | None = None,
        score: float | None = None,
        alpha: float | None = None,
    ) -> None:
        """Blends one telemetry sample into the node's EWMAs (H5); `alpha` overrides the
        state's weight of the new sample (1: it replaces the estimate)."""
        t = self.node(node_id)
        t.observe(self.alpha if alpha is None else alpha, latency_ms, load, score)
        self._touch(self._index[node_id], t)

    def relax(self, node_id: str, fraction: float) -> None:
        """The node's latency estimate moved `fraction` of the way to the prior."""
        t = self.node(node_id)
        t.relax(fraction)
        self._touch(self._index[node_id], t)

    def set_load(self, node_id: str, load: float) -> None:
        """Sets a load that is known exactly (the coordinator's own slots), not blended."""
        t = self.node(node_id)
        t.load = min(1.0, max(0.0, load))
        self._touch(self._index[node_id], t)

    def _touch(self, i: int, t: NodeTelemetry) -> None:
        new = node_cost(t, self.weights)
        if new != self._cost[i]:
            self._cost[i] = new
            for c, j in self._users[i]:
                c.dirty.add(j)

    def set_alive(self, node_id: str, alive: bool) -> bool:
        """Marks a node up or down; False if it already was."""
        t = self.node(node_id)
        if t.alive == alive:
            return False
        t.alive = alive
        step = -1 if alive else 1
        for c, j in self._users[self._index[node_id]]:
            c.down[j] += step
            c.dirty.add(j)
        return True

    def alive(self, node_id: str) -> bool:
        return self.node(node_id).alive

    def node_cost(self, node_id: str) -> float:
        self.node(node_id)
        return self._cost[self._index[node_id]]

    # -- routing ----------------------------------------------------------------------------
    def _copies(self, model_id: str) -> _Copies:
        c = self._models.get(model_id)
        if c is None:
            raise UnknownModel(
                f"unknown model {model_id!r}; this swarm serves {sorted(self._models)}"
            )
        if c.dirty:
            cost, ncost = c.cost, self._cost
            for j in c.dirty:
                if c.down[j]:
                    cost[j] = _INF
                    continue
                total = 0.0
                for i, k in zip(c.nodes[j], c.counts[j], strict=True):
                    total += k * ncost[i]
                cost[j] = total + c.static[j]
            c.dirty.clear()
            low = min(cost, default=_INF)
            c.best = -1 if low == _INF else cost.index(low)  # first = lowest pipeline_id
        return c

    def route(self, model_id: str, tokens: int = 0) -> Route:
        """H2: the cheapest copy of exactly this model with no down node; ties by pipeline_id."""
        c = self._copies(model_id)
        if c.best < 0:
            raise NoRoute(
                f"model {model_id!r}: every copy ({len(c.pipes)}) has a down node; "
                "fail over, bring nodes back or add nodes"
            )
        return Route(c.pipes[c.best], c.cost[c.best] + tokens_cost(tokens, self.weights))

    def ranked(self, model_id: str, without: str | None = None) -> list[Route]:
        """Every live copy of the model not using node `without`, cheapest first."""
        c = self._copies(model_id)
        skip = -1 if without is None else self._index.get(without, -1)
        out = [
            Route(c.pipes[j], c.cost[j])
            for j in range(len(c.pipes))
            if c.cost[j] < _INF and skip not in c.nodes[j]
        ]
        return sorted(out, key=lambda r: (r.cost, r.pipeline_id))


def pipeline_cost(p: Pipeline, state: SwarmState, tokens: int = 0) -> float:
    """The reference cost of a copy from scratch (inf when a node is down); see module doc."""
    names, counts = _distinct(p)
    if any(not state.alive(n) for n in names):
        return _INF
    total = 0.0
    for n, k in zip(names, counts, strict=True):
        total += k * node_cost(state.node(n), state.weights)
    return total + hops_cost(p.hops, state.weights) + tokens_cost(tokens, state.weights)
