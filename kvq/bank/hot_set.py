"""The hot set for one budget: the greedy plan, or the exact solver's where it is worth it.

Above both `planner` (greedy, swaps) and `exact` (the solver built on the planner's tables), so
that neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvq.bank.exact import exact_plan
from kvq.bank.planner import ExactMode, LayerTable, Plan, greedy


def plan_hot_set(
    tables: Sequence[LayerTable], budget_bytes: int, exact: ExactMode = "auto"
) -> Plan:
    """The hot set for one budget across all layers: greedy, or the exact solver's plan when
    sizes are mixed and it is cheap enough (the result then reports the gap to greedy)."""
    base = greedy(tables, budget_bytes)
    if base.optimal or exact == "never":
        return base
    best = exact_plan(tables, budget_bytes)
    if best is None:
        base.notes.append("mixed sizes; exact solver skipped (too costly), greedy may be short")
        return base
    return Plan(
        best.hot,
        best.bytes_used,
        best.budget_bytes,
        best.covered,
        best.total,
        best.method,
        base.covered,
        True,
    )
