"""The topology format of `kvq swarm-sim` (see docs/routing.md), parsed from plain JSON data.

    {"nodes":  [{"id": "gpu", "memory_gib": 48, "latency_ms": 4, "score": 2.0}, ...],
     "models": [{"id": "base", "layers": 12, "layer_gib": 2.0, "experts": 8,
                 "experts_per_slice": 4, "fallback": null}, ...],
     "pipelines": 2}

A growth file is `{"nodes": [...]}` (or a bare list of nodes). Unknown fields are errors, so a
typo does not silently fall back to a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvq.errors import TopologyError
from kvq.swarm.types import ModelSpec, NodeProfile

_NODE_FIELDS = {"id", "memory_gib", "latency_ms", "score"}
_MODEL_FIELDS = {"id", "layers", "layer_gib", "experts", "experts_per_slice", "fallback"}


@dataclass(frozen=True, slots=True)
class Topology:
    nodes: tuple[NodeProfile, ...]
    models: tuple[ModelSpec, ...]
    pipelines: int | None = None


def _num(d: dict[str, Any], key: str, where: str, default: float | None = None) -> float | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TopologyError(f"{where}: {key} must be a number, got {v!r}")
    return float(v)


def _int(d: dict[str, Any], key: str, where: str, default: int | None = None) -> int | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TopologyError(f"{where}: {key} must be an integer, got {v!r}")
    return v


def _fields(d: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise TopologyError(f"{where} must be an object, got {type(d).__name__}")
    extra = set(d) - allowed
    if extra:
        raise TopologyError(f"{where}: unknown fields {sorted(extra)}; allowed: {sorted(allowed)}")
    if not isinstance(d.get("id"), str) or not d["id"]:
        raise TopologyError(f"{where}: needs a non-empty string id")
    return d


def parse_node(d: Any, where: str = "node") -> NodeProfile:
    d = _fields(d, _NODE_FIELDS, where)
    where = f"node {d['id']!r}"
    mem = _num(d, "memory_gib", where)
    if mem is None:
        raise TopologyError(f"{where}: memory_gib is required")
    score = _num(d, "score", where, 1.0)
    return NodeProfile(d["id"], mem, _num(d, "latency_ms", where), 1.0 if score is None else score)


def parse_model(d: Any, where: str = "model") -> ModelSpec:
    d = _fields(d, _MODEL_FIELDS, where)
    where = f"model {d['id']!r}"
    layers = _int(d, "layers", where)
    gib = _num(d, "layer_gib", where)
    if layers is None or gib is None:
        raise TopologyError(f"{where}: layers and layer_gib are required")
    experts = _int(d, "experts", where, 1) or 1
    fallback = d.get("fallback")
    if fallback is not None and not isinstance(fallback, str):
        raise TopologyError(f"{where}: fallback must be a model id or null, got {fallback!r}")
    return ModelSpec.layered(
        d["id"], layers, gib, experts, _int(d, "experts_per_slice", where), fallback
    )


def _list(data: Any, key: str) -> list[Any]:
    v = data.get(key) if isinstance(data, dict) else None
    if not isinstance(v, list) or not v:
        raise TopologyError(f"topology: {key!r} must be a non-empty list")
    return v


def parse_topology(data: Any) -> Topology:
    """Nodes, models and the optional default copies per model, validated."""
    if not isinstance(data, dict):
        raise TopologyError("topology must be a JSON object with 'nodes' and 'models'")
    extra = set(data) - {"nodes", "models", "pipelines"}
    if extra:
        raise TopologyError(f"topology: unknown fields {sorted(extra)}")
    nodes = tuple(parse_node(n, f"nodes[{i}]") for i, n in enumerate(_list(data, "nodes")))
    models = tuple(parse_model(m, f"models[{i}]") for i, m in enumerate(_list(data, "models")))
    for kind, ids in (
        ("node", [n.node_id for n in nodes]),
        ("model", [m.model_id for m in models]),
    ):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise TopologyError(f"topology: duplicate {kind} ids {dup}")
    known = {m.model_id for m in models}
    for m in models:
        if m.fallback is not None and m.fallback not in known:
            raise TopologyError(
                f"model {m.model_id!r}: fallback {m.fallback!r} is not a model here"
            )
    return Topology(nodes, models, _int(data, "pipelines", "topology"))


def parse_nodes(data: Any) -> tuple[NodeProfile, ...]:
    """A growth file: `{"nodes": [...]}` or a bare list."""
    items = data if isinstance(data, list) else _list(data, "nodes")
    return tuple(parse_node(n, f"nodes[{i}]") for i, n in enumerate(items))
