"""Hot and cold expert banks (B1-B8): a shared planner, routing histograms, and the Bank.

- `planner` / `exact` (numpy only): which experts go hot under one byte budget, and which to
  swap at run time. `hist`: the HIST.json format and re-ranking. `collect`: histograms from a
  traffic sample.
- `Bank`: a node's experts split hot (device) and cold (host), `forward` as
  `kvq.model.expert_forward`, `step` once per engine step for dynamic updates.

The torch parts load on first use, so `import kvq.bank.planner` (or `from kvq.bank import
plan_hot_set`) stays numpy-only. See `docs/bank.md`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvq.bank.dynamic import HitRates, UpdateReport
from kvq.bank.hist import Histogram, hist_from_json, load_hist, rerank, save_hist
from kvq.bank.hot_set import plan_hot_set
from kvq.bank.planner import LayerTable, Plan, plan_swaps, table

if TYPE_CHECKING:
    from kvq.bank.bank import Bank
    from kvq.bank.options import GIB, BankOptions

_LAZY = {"Bank": "kvq.bank.bank", "BankOptions": "kvq.bank.options", "GIB": "kvq.bank.options"}

__all__ = [
    "GIB",
    "Bank",
    "BankOptions",
    "Histogram",
    "HitRates",
    "LayerTable",
    "Plan",
    "UpdateReport",
    "hist_from_json",
    "load_hist",
    "plan_hot_set",
    "plan_swaps",
    "rerank",
    "save_hist",
    "table",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvq.bank' has no attribute {name!r}")
