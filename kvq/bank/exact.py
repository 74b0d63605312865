"""Exact hot-set solvers for mixed expert sizes, and the exhaustive oracle of the tests (numpy).

Experts of the same size differ only by their counts, so an optimal plan takes, from each size
class, that class's most-routed experts; what remains is how many to take per class:
- one class: as many as fit (greedy is optimal);
- two classes: try every count of the first, fill with the second (O(N), any budget);
- more: dynamic programming over the budget in units of the sizes' gcd, only while
  items x units stays under `max_cells` (otherwise `exact_plan` returns None).
Real models have one size per quantization type, so two or three classes is the usual case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvq.bank.planner import (
    F64,
    I64,
    Items,
    LayerTable,
    Plan,
    check_budget,
    check_tables,
    greedy_mask,
)
from kvq.errors import BankError

MAX_CELLS = 4_000_000
ORACLE_MAX_ITEMS = 16


@dataclass(frozen=True, slots=True)
class _SizeClass:
    """Experts of one byte size, most-routed first."""

    nbytes: int
    order: I64  # [n] item indices, by count desc (ties: expert, layer)
    prefix: F64  # [n + 1] covered count of the first k


def _classes(it: Items) -> list[_SizeClass]:
    out = []
    for size in np.unique(it.nbytes).tolist():
        idx = np.flatnonzero(it.nbytes == size)
        idx = idx[np.lexsort((it.layer[idx], it.expert[idx], -it.counts[idx]))]
        prefix = np.concatenate([[0.0], np.cumsum(it.counts[idx])])
        out.append(_SizeClass(int(size), idx, prefix))
    return out


def exact_plan(
    tables: Sequence[LayerTable], budget_bytes: int, max_cells: int = MAX_CELLS
) -> Plan | None:
    """An optimal plan, or None when the dynamic program would exceed `max_cells`."""
    tables = check_tables(tables)
    budget = check_budget(budget_bytes)
    it = Items.of(tables)
    classes = _classes(it)
    if len(classes) <= 2:
        ks = _two_classes(classes, budget)
    else:
        found = _dynamic_program(classes, budget, max_cells)
        if found is None:
            return None
        ks = found
    chosen = np.zeros(it.counts.size, dtype=bool)
    for c, k in zip(classes, ks, strict=True):
        chosen[c.order[:k]] = True
    greedy_cov = float(it.counts[greedy_mask(it, budget)].sum())
    return it.plan(chosen, budget, "exact", greedy_cov, True, (t.layer for t in tables))


def _two_classes(classes: list[_SizeClass], budget: int) -> list[int]:
    """Best (k1, k2) for at most two classes: every k1, the largest k2 that still fits."""
    if not classes:
        return []
    a = classes[0]
    k1 = np.arange(min(a.order.size, budget // a.nbytes) + 1)  # [K]
    if len(classes) == 1:
        return [int(k1[-1])]
    b = classes[1]
    k2 = np.minimum(b.order.size, (budget - k1 * a.nbytes) // b.nbytes)  # [K]
    value = a.prefix[k1] + b.prefix[k2]  # [K]
    used = k1 * a.nbytes + k2 * b.nbytes  # [K]
    best = int(np.lexsort((k1, used, -value))[0])  # most covered, then fewest bytes
    return [int(k1[best]), int(k2[best])]


def _dynamic_program(classes: list[_SizeClass], budget: int, max_cells: int) -> list[int] | None:
    """Per-class counts maximising coverage, by DP over capacity units (None if too costly)."""
    unit = int(np.gcd.reduce(np.array([c.nbytes for c in classes], dtype=np.int64)))
    cap = budget // unit
    n_items = sum(c.order.size for c in classes)
    if n_items * (cap + 1) > max_cells:
        return None
    dp = np.zeros(cap + 1)  # [cap + 1] best coverage using at most that many units
    choices: list[npt.NDArray[np.int32]] = []
    for c in classes:
        u = c.nbytes // unit
        new, choice = dp.copy(), np.zeros(cap + 1, dtype=np.int32)
        for k in range(1, min(c.order.size, cap // u) + 1):
            off = k * u
            cand = dp[: cap + 1 - off] + c.prefix[k]  # [cap + 1 - off]
            better = cand > new[off:]  # strict: ties keep the smaller k
            new[off:][better] = cand[better]
            choice[off:][better] = k
        dp = new
        choices.append(choice)
    ks, r = [], cap
    for c, choice in zip(reversed(classes), reversed(choices), strict=True):
        k = int(choice[r])
        ks.append(k)
        r -= k * (c.nbytes // unit)
    return ks[::-1]


def oracle(tables: Sequence[LayerTable], budget_bytes: int) -> Plan:
    """Try every subset (at most ORACLE_MAX_ITEMS experts): the reference for tests."""
    tables = check_tables(tables)
    budget = check_budget(budget_bytes)
    it = Items.of(tables)
    n = it.counts.size
    if n > ORACLE_MAX_ITEMS:
        raise BankError(f"oracle takes at most {ORACLE_MAX_ITEMS} experts, got {n}")
    masks = ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(bool)  # [2^n, n]
    used = masks.astype(np.int64) @ it.nbytes  # [2^n]
    cov = masks.astype(np.float64) @ it.counts  # [2^n]
    cov = np.where(used <= budget, cov, -1.0)
    best = int(np.lexsort((used, -cov))[0])  # most covered, then fewest bytes
    greedy_cov = float(it.counts[greedy_mask(it, budget)].sum())
    return it.plan(masks[best], budget, "oracle", greedy_cov, True, (t.layer for t in tables))
