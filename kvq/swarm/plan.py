"""The plan (H1): which node holds which slice of which copy. Costly to compute, changes rarely.

`place` is a deterministic greedy placement: copies of each model are laid out slice by slice,
staying on one node while its memory lasts (fewer hops), and choosing the next node by its
declared cost (latency + 100/score, then most memory, then id), preferring nodes that no other
copy of the same model uses, so that one node's death leaves an intact copy (H7). Copies that
are already placed and intact are kept (growth and removal relocate as little as possible).

Memory is charged once per (node, model, slice): a node holding a slice can serve it in every
copy that names it (the live router's copies share workers that way). The placement itself gives
each new copy fresh memory, since a copy made of fragments another copy holds adds no redundancy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvq.errors import TopologyError
from kvq.swarm.telemetry import UNMEASURED_LATENCY_MS
from kvq.swarm.types import ModelSpec, NodeProfile, Pipeline

_EPS = 1e-9
_Key = tuple[str, str, int]  # (node, model, slice index)


@dataclass(frozen=True, slots=True, eq=False)
class SwarmPlan:
    """Node profiles, models, and the copies placed; `copies` is how many each model wants."""

    profiles: Mapping[str, NodeProfile]
    models: Mapping[str, ModelSpec]
    pipelines: tuple[Pipeline, ...]
    copies: int = 1
    _holders: dict[str, list[frozenset[str]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        holders: dict[str, list[set[str]]] = {
            m: [set() for _ in spec.slices] for m, spec in self.models.items()
        }
        for p in self.pipelines:
            for i, node in enumerate(p.assignment[: len(holders.get(p.model_id, ()))]):
                holders[p.model_id][i].add(node)
        object.__setattr__(
            self, "_holders", {m: [frozenset(s) for s in hs] for m, hs in holders.items()}
        )

    def of_model(self, model_id: str) -> tuple[Pipeline, ...]:
        return tuple(p for p in self.pipelines if p.model_id == model_id)

    def holders(self, model_id: str, index: int) -> frozenset[str]:
        """Nodes that hold slice `index` of the model in some copy (splice candidates)."""
        return self._holders[model_id][index]

    def problems(self) -> list[str]:
        """Everything that makes the plan invalid (empty when it validates)."""
        out: list[str] = []
        seen: set[int] = set()
        used: dict[str, float] = {}
        held: set[_Key] = set()
        for p in self.pipelines:
            if p.pipeline_id in seen:
                out.append(f"pipeline id {p.pipeline_id} is used twice")
            seen.add(p.pipeline_id)
            spec = self.models.get(p.model_id)
            if spec is None:
                out.append(f"pipeline {p.pipeline_id}: unknown model {p.model_id!r}")
                continue
            if len(p.assignment) != len(spec.slices):
                out.append(
                    f"pipeline {p.pipeline_id}: covers {len(p.assignment)} slices, "
                    f"model {p.model_id!r} has {len(spec.slices)}"
                )
            for i, (node, sl) in enumerate(zip(p.assignment, spec.slices, strict=False)):
                if node not in self.profiles:
                    out.append(f"pipeline {p.pipeline_id}: unknown node {node!r}")
                elif (node, p.model_id, i) not in held:
                    held.add((node, p.model_id, i))
                    used[node] = used.get(node, 0.0) + sl.gib
        for node, gib in sorted(used.items()):
            cap = self.profiles[node].memory_gib
            if gib > cap + _EPS:
                out.append(f"node {node!r} holds {gib:.3f} GiB > its {cap:.3f} GiB")
        for spec in self.models.values():
            if spec.fallback is not None and spec.fallback not in self.models:
                out.append(f"model {spec.model_id!r}: unknown fallback {spec.fallback!r}")
        return out

    def validate(self) -> None:
        problems = self.problems()
        if problems:
            raise TopologyError("invalid plan: " + "; ".join(problems))

    @property
    def next_id(self) -> int:
        return max((p.pipeline_id for p in self.pipelines), default=-1) + 1


class _Ledger:
    """Free memory per node and what each node already holds, with rollback."""

    __slots__ = ("free", "held")

    def __init__(self, profiles: Iterable[NodeProfile]) -> None:
        self.free = {p.node_id: p.memory_gib for p in profiles}
        self.held: set[_Key] = set()

    def fits(self, key: _Key, gib: float) -> bool:
        node = key[0]
        return node in self.free and (key in self.held or self.free[node] + _EPS >= gib)

    def fits_fresh(self, key: _Key, gib: float) -> bool:
        """A new copy takes fresh memory: a slice a node already holds for another copy of the
        same model would add no redundancy."""
        node = key[0]
        return node in self.free and key not in self.held and self.free[node] + _EPS >= gib

    def charge(self, key: _Key, gib: float, log: list[tuple[_Key, float]]) -> None:
        if key not in self.held:
            self.held.add(key)
            self.free[key[0]] -= gib
            log.append((key, gib))

    def rollback(self, log: list[tuple[_Key, float]]) -> None:
        for key, gib in reversed(log):
            self.held.discard(key)
            self.free[key[0]] += gib

    def keep(self, p: Pipeline, spec: ModelSpec) -> bool:
        """Charges an existing copy; False (and nothing charged) if it no longer fits."""
        if len(p.assignment) != len(spec.slices):
            return False
        log: list[tuple[_Key, float]] = []
        for i, (node, sl) in enumerate(zip(p.assignment, spec.slices, strict=True)):
            key = (node, spec.model_id, i)
            if not self.fits(key, sl.gib):
                self.rollback(log)
                return False
            self.charge(key, sl.gib, log)
        return True


def _rank(p: NodeProfile) -> tuple[float, float, str]:
    lat = UNMEASURED_LATENCY_MS if p.latency_ms is None else p.latency_ms
    return (lat + 100.0 / max(p.score, 0.01), -p.memory_gib, p.node_id)


def _pick(
    ranked: list[str],
    ledger: _Ledger,
    model: str,
    i: int,
    gib: float,
    avoid: set[str],
    used: set[str],
) -> str | None:
    """First fitting node by rank: outside `avoid` and `used` if possible, then relaxing."""
    second: str | None = None
    third: str | None = None
    for node in ranked:
        if not ledger.fits_fresh((node, model, i), gib):
            continue
        if node not in used and node not in avoid:
            return node
        if node not in used and second is None:
            second = node
        elif third is None:
            third = node
    return second if second is not None else third


def _place_one(
    spec: ModelSpec, ranked: list[str], ledger: _Ledger, avoid: set[str]
) -> tuple[str, ...] | None:
    log: list[tuple[_Key, float]] = []
    out: list[str] = []
    used: set[str] = set()
    cur: str | None = None
    for i, sl in enumerate(spec.slices):
        if cur is None or not ledger.fits_fresh((cur, spec.model_id, i), sl.gib):
            cur = _pick(ranked, ledger, spec.model_id, i, sl.gib, avoid, used)
            if cur is None:
                ledger.rollback(log)
                return None
            used.add(cur)
        ledger.charge((cur, spec.model_id, i), sl.gib, log)
        out.append(cur)
    return tuple(out)


def place(
    profiles: Sequence[NodeProfile],
    models: Sequence[ModelSpec],
    copies: int,
    keep: Sequence[Pipeline] = (),
    next_id: int = 0,
) -> tuple[Pipeline, ...]:
    """Up to `copies` copies per model on `profiles` (the usable nodes), keeping `keep` where
    it still fits. A model may get fewer copies than asked when memory runs out."""
    specs = {m.model_id: m for m in models}
    ledger = _Ledger(profiles)
    kept = [p for p in keep if p.model_id in specs and ledger.keep(p, specs[p.model_id])]
    ranked = [p.node_id for p in sorted(profiles, key=_rank)]
    out = list(kept)
    for spec in models:
        mine = [p for p in kept if p.model_id == spec.model_id]
        avoid = {n for p in mine for n in p.assignment}
        for _ in range(copies - len(mine)):
            a = _place_one(spec, ranked, ledger, avoid)
            if a is None:
                break
            out.append(Pipeline(next_id, spec.model_id, a))
            next_id += 1
            avoid.update(a)
    return tuple(sorted(out, key=lambda p: p.pipeline_id))
