"""The shared hot-set planner (B2): numpy only, no torch, used by static and dynamic banks.

Static: `plan_hot_set(tables, budget_bytes)` picks, across all layers under one byte budget,
the experts that cover the most routed tokens. Greedy by count per byte is optimal when every
expert has the same size; with mixed sizes an exact solver (`kvq.bank.exact`) runs when it is
cheap enough and the plan reports how far greedy was from it.

Dynamic: `plan_swaps(layer, scores, hot, ...)` picks at most `max_swaps` (out, in) pairs of one
layer, each only if the incoming score beats the outgoing one by the margin.

Every input is validated first: NaN, infinite, negative or non-integral counts, non-positive
expert sizes, mismatched lengths and duplicate layers are BankErrors naming the layer and expert.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvq.errors import BankError

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
ExactMode = Literal["auto", "never"]


@dataclass(frozen=True, slots=True)
class LayerTable:
    """Routing counts and byte sizes of every expert of one layer (validated by `table`)."""

    layer: int
    counts: F64  # [E] routed (token, expert) pairs per expert, integral, >= 0
    expert_bytes: I64  # [E] bytes per expert, > 0


@dataclass(frozen=True)
class Plan:
    """A hot set: `hot[layer]` lists expert ids (ascending); sizes and coverage included."""

    hot: dict[int, list[int]]
    bytes_used: int
    budget_bytes: int
    covered: float  # routed pairs of the hot experts
    total: float  # routed pairs of all experts
    method: str  # "greedy", "greedy (optimal: equal sizes)", "exact", "oracle", ...
    greedy_covered: float  # what greedy alone covers (== covered when greedy was used)
    optimal: bool  # proven optimal (equal sizes, exact solver or oracle)
    notes: list[str] = field(default_factory=list)
    chosen: str = ""  # how the budget and method were chosen, for the bank's log line

    @property
    def covered_share(self) -> float:
        """Share of routed pairs served by the hot bank (0 when nothing was routed)."""
        return self.covered / self.total if self.total > 0 else 0.0

    @property
    def greedy_gap(self) -> float:
        """Covered share this plan gains over greedy (0 when greedy is optimal or used)."""
        return (self.covered - self.greedy_covered) / self.total if self.total > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """The `kvq balance plan --json` object."""
        return {
            "hot": {str(layer): ids for layer, ids in sorted(self.hot.items())},
            "bytes_used": self.bytes_used,
            "covered_share": self.covered_share,
            "budget_bytes": self.budget_bytes,
            "method": self.method,
            "optimal": self.optimal,
            "greedy_gap": self.greedy_gap,
        }


# -- validation -----------------------------------------------------------------------------


def table(layer: int, counts: npt.ArrayLike, expert_bytes: npt.ArrayLike) -> LayerTable:
    """A validated LayerTable, or BankError naming the layer and the first bad expert."""
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
        raise BankError(f"layer id {layer!r} must be an int >= 0")
    c = _as_array(counts, f"layer {layer} counts")
    b = _as_array(expert_bytes, f"layer {layer} expert_bytes")
    if c.shape != b.shape:
        raise BankError(
            f"layer {layer}: {c.shape[0]} counts but {b.shape[0]} expert sizes; "
            "give one count and one size per expert"
        )
    check_counts(int(layer), c)
    bad = np.flatnonzero(~np.isfinite(b) | (b <= 0) | (b != np.round(b)))
    if bad.size:
        e = int(bad[0])
        raise BankError(f"layer {layer} expert {e}: size {b[e]!r} bytes is not a positive integer")
    return LayerTable(int(layer), c, b.astype(np.int64))


def check_counts(layer: int, counts: F64) -> None:
    """BankError naming the first expert whose count is NaN, infinite, negative or fractional."""
    for bad, what in (
        (np.isnan(counts), "is NaN"),
        (np.isinf(counts), "is infinite"),
        (counts < 0, "is negative"),
        (counts != np.floor(counts), "is not an integer"),
    ):
        idx = np.flatnonzero(bad)
        if idx.size:
            e = int(idx[0])
            raise BankError(
                f"layer {layer} expert {e}: routing count {counts[e]!r} {what}; "
                "counts are routed (token, expert) pairs"
            )


def _as_array(values: npt.ArrayLike, label: str) -> F64:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise BankError(f"{label} must be a list of numbers: {exc}") from None
    if arr.ndim != 1:
        raise BankError(f"{label} must be a flat list, got shape {arr.shape}")
    return arr


def check_tables(tables: Iterable[LayerTable]) -> list[LayerTable]:
    """The tables sorted by layer; BankError on a duplicate layer."""
    out = sorted(tables, key=lambda t: t.layer)
    for a, b in zip(out, out[1:], strict=False):
        if a.layer == b.layer:
            raise BankError(f"layer {a.layer} appears twice; give each layer once")
    return out


def check_budget(budget_bytes: int) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | np.integer):
        raise BankError(f"budget {budget_bytes!r} must be an int number of bytes")
    if budget_bytes < 0:
        raise BankError(f"budget {budget_bytes} bytes is negative; use 0 for no hot bank")
    return int(budget_bytes)


# -- flattened view ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Items:
    """Every (layer, expert) of a table set as parallel flat arrays."""

    layer: I64  # [N]
    expert: I64  # [N]
    counts: F64  # [N]
    nbytes: I64  # [N]

    @classmethod
    def of(cls, tables: Sequence[LayerTable]) -> Items:
        if not tables:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, np.zeros(0), empty)
        return cls(
            np.concatenate([np.full(t.counts.size, t.layer, np.int64) for t in tables]),
            np.concatenate([np.arange(t.counts.size, dtype=np.int64) for t in tables]),
            np.concatenate([t.counts for t in tables]),
            np.concatenate([t.expert_bytes for t in tables]),
        )

    def plan(
        self,
        chosen: npt.NDArray[np.bool_],
        budget: int,
        method: str,
        greedy_covered: float,
        optimal: bool,
        layers: Iterable[int],
    ) -> Plan:
        """A Plan of the chosen items; BankError if it overflows the budget."""
        used = int(self.nbytes[chosen].sum())
        if used > budget:
            raise BankError(f"{method} plan uses {used} bytes, over the {budget}-byte budget")
        hot: dict[int, list[int]] = {int(layer): [] for layer in layers}
        for layer, e in zip(self.layer[chosen].tolist(), self.expert[chosen].tolist(), strict=True):
            hot[layer].append(e)
        for ids in hot.values():
            ids.sort()
        covered = float(self.counts[chosen].sum())
        return Plan(
            hot, used, budget, covered, float(self.counts.sum()), method, greedy_covered, optimal
        )


# -- static planning ----------------------------------------------------------------------------


def greedy(tables: Sequence[LayerTable], budget_bytes: int) -> Plan:
    """Take experts by count per byte (ties: higher count, lower expert id, lower layer), each
    one that still fits. Optimal when all experts have the same size."""
    tables = check_tables(tables)
    budget = check_budget(budget_bytes)
    it = Items.of(tables)
    chosen = greedy_mask(it, budget)
    equal = np.unique(it.nbytes).size <= 1
    method = "greedy (optimal: equal sizes)" if equal else "greedy"
    covered = float(it.counts[chosen].sum())
    return it.plan(chosen, budget, method, covered, equal, (t.layer for t in tables))


def greedy_mask(it: Items, budget: int) -> npt.NDArray[np.bool_]:
    """[N] bool: the greedy choice. Vectorised prefix, then a short loop over what is left."""
    density = it.counts / it.nbytes  # [N]
    order = np.lexsort((it.layer, it.expert, -it.counts, -density))  # last key is primary
    cum = np.cumsum(it.nbytes[order])  # [N]
    n_prefix = int(np.searchsorted(cum, budget, side="right"))
    chosen = np.zeros(it.counts.size, dtype=bool)
    chosen[order[:n_prefix]] = True
    left = budget - (int(cum[n_prefix - 1]) if n_prefix else 0)
    rest = order[n_prefix:]
    if rest.size and left >= int(it.nbytes[rest].min()):
        for i in rest.tolist():  # skip what does not fit, keep filling with smaller experts
            if it.nbytes[i] <= left:
                chosen[i] = True
                left -= int(it.nbytes[i])
    return chosen


def tables_from(
    counts: Mapping[int, npt.ArrayLike], expert_bytes: Mapping[int, npt.ArrayLike]
) -> list[LayerTable]:
    """Validated tables from per-layer mappings (same layer keys in both)."""
    if set(counts) != set(expert_bytes):
        missing = sorted(set(counts) ^ set(expert_bytes))
        raise BankError(f"layers {missing} have counts or sizes but not both")
    return check_tables(table(layer, counts[layer], expert_bytes[layer]) for layer in counts)


# -- dynamic planning ---------------------------------------------------------------------------


def plan_swaps(
    layer: int, scores: npt.ArrayLike, hot: npt.ArrayLike, max_swaps: int, margin: float
) -> list[tuple[int, int]]:
    """At most `max_swaps` (out, in) expert pairs: the weakest hot experts for the strongest
    cold ones, each pair only if incoming score > `margin` x outgoing score.

    scores: [E] decayed routing counts (>= 0, finite); hot: [E] bool. Ties go to lower ids.
    """
    s = _as_array(scores, f"layer {layer} scores")
    h = np.asarray(hot, dtype=bool)
    if h.shape != s.shape:
        raise BankError(f"layer {layer}: {s.size} scores but {h.size} hot flags")
    bad = np.flatnonzero(~np.isfinite(s) | (s < 0))
    if bad.size:
        e = int(bad[0])
        raise BankError(f"layer {layer} expert {e}: score {s[e]!r} is not a finite count >= 0")
    if max_swaps < 0 or not margin >= 1.0:
        raise BankError(f"max_swaps {max_swaps} must be >= 0 and margin {margin} >= 1")
    hot_ids = np.flatnonzero(h)
    cold_ids = np.flatnonzero(~h)
    outs = hot_ids[np.lexsort((-hot_ids, s[hot_ids]))]  # weakest first, ties: higher id out
    ins = cold_ids[np.lexsort((cold_ids, -s[cold_ids]))]  # strongest first, ties: lower id in
    pairs: list[tuple[int, int]] = []
    for o, i in zip(outs[:max_swaps].tolist(), ins[:max_swaps].tolist(), strict=False):
        if not s[i] > margin * s[o]:
            break
        pairs.append((o, i))
    return pairs
