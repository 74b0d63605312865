"""The plain records of swarm routing: nodes, models and slices, pipelines, routes, options.

Everything here is immutable data. A *pipeline* (one copy of a model) assigns every slice of the
model, in the model's slice order (layer, then expert), to one node. Its *stages* are the maximal
runs of consecutive slices on one node; its *hops* are the node changes along the slice order
(`len(stages) - 1`). The all-local copy has one stage and zero hops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from kvq.errors import ConfigError, TopologyError
from kvq.slices import slice_grid

Rung = Literal["copy", "splice", "degraded"]
Status = Literal["healthy", "degraded", "failed", "stopped"]


@dataclass(frozen=True, slots=True)
class CostWeights:
    """The weights of H3: latency, load, score, hops, prompt tokens (settings, default 1.0)."""

    w_l: float = 1.0
    w_c: float = 1.0
    w_k: float = 1.0
    w_h: float = 1.0
    w_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("w_l", "w_c", "w_k", "w_h", "w_p"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 <= v <= 1000.0):
                raise ConfigError(f"cost weight {name} must be in [0, 1000], got {v!r}")


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """A node as declared: memory for slices, optional declared latency, capability score."""

    node_id: str
    memory_gib: float = math.inf
    latency_ms: float | None = None
    score: float = 1.0

    def __post_init__(self) -> None:
        if not self.node_id:
            raise TopologyError("a node needs a non-empty id")
        if not self.memory_gib >= 0:
            raise TopologyError(
                f"node {self.node_id!r}: memory_gib must be >= 0, got {self.memory_gib!r}"
            )
        if self.latency_ms is not None and not (
            math.isfinite(self.latency_ms) and self.latency_ms >= 0
        ):
            raise TopologyError(
                f"node {self.node_id!r}: latency_ms must be >= 0, got {self.latency_ms!r}"
            )
        if not (math.isfinite(self.score) and self.score >= 0):
            raise TopologyError(f"node {self.node_id!r}: score must be >= 0, got {self.score!r}")


@dataclass(frozen=True, slots=True)
class Slice:
    """One unit of placement: an id (layer range x expert range) and the memory it takes."""

    sid: str
    gib: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model: its slices in pipeline order and the model to fall back to when degrading."""

    model_id: str
    slices: tuple[Slice, ...]
    fallback: str | None = None

    def __post_init__(self) -> None:
        if not self.model_id or not self.slices:
            raise TopologyError(f"model {self.model_id!r} needs an id and at least one slice")
        if len({s.sid for s in self.slices}) != len(self.slices):
            raise TopologyError(f"model {self.model_id!r}: slice ids must be unique")
        if self.fallback == self.model_id:
            raise TopologyError(f"model {self.model_id!r} cannot fall back to itself")

    @classmethod
    def layered(
        cls,
        model_id: str,
        layers: int,
        layer_gib: float,
        experts: int = 1,
        experts_per_slice: int | None = None,
        fallback: str | None = None,
    ) -> ModelSpec:
        """`layers` layers of `layer_gib`; at expert grain each layer is cut in expert ranges."""
        if layers < 1 or experts < 1 or not layer_gib >= 0:
            raise TopologyError(
                f"model {model_id!r}: layers and experts must be >= 1 and layer_gib >= 0"
            )
        step = experts if experts_per_slice is None else experts_per_slice
        if not 1 <= step <= experts:
            raise TopologyError(f"model {model_id!r}: experts_per_slice must be in [1, {experts}]")
        slices = tuple(
            Slice(b.sid, layer_gib * (b.expert_end - b.expert_start) / experts)
            for b in slice_grid(layers, experts, 1, step)  # one layer per slice
        )
        return cls(model_id, slices, fallback)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """One copy of a model: `assignment[i]` is the node of the model's slice `i`."""

    pipeline_id: int
    model_id: str
    assignment: tuple[str, ...]
    stages: tuple[str, ...] = field(init=False, repr=False, compare=False)
    hops: int = field(init=False, repr=False, compare=False)
    nodes: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        a = self.assignment
        stages = tuple(n for i, n in enumerate(a) if i == 0 or a[i - 1] != n)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "hops", max(0, len(stages) - 1))
        object.__setattr__(self, "nodes", frozenset(a))


@dataclass(frozen=True, slots=True)
class Route:
    """The chosen copy and its cost (H3, tokens term included)."""

    pipeline: Pipeline
    cost: float

    @property
    def model_id(self) -> str:
        return self.pipeline.model_id

    @property
    def pipeline_id(self) -> int:
        return self.pipeline.pipeline_id

    def as_dict(self) -> dict[str, object]:
        p = self.pipeline
        return {
            "model": p.model_id,
            "pipeline_id": p.pipeline_id,
            "nodes": list(p.stages),
            "hops": p.hops,
            "cost": round(self.cost, 3),
        }


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What the cost needs to know about a request: its prompt length in tokens."""

    tokens: int = 0


@dataclass(frozen=True, slots=True)
class FailoverOptions:
    """Whether rung (c) may serve a fallback model; `fallback_model` overrides the model's own."""

    allow_degraded: bool = True
    fallback_model: str | None = None


@dataclass(frozen=True, slots=True)
class Replacement:
    """In a splice: slice `sid`, lost with `dead`, now computed by `node`."""

    sid: str
    dead: str
    node: str


@dataclass(frozen=True, slots=True)
class FailoverResult:
    """A valid rescue route and how it was found (H6)."""

    route: Route
    rung: Rung
    degraded: bool = False
    replaced: tuple[Replacement, ...] = ()
    fallback_model: str | None = None
