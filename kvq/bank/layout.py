"""The hot set a bank starts with (B4): histogram counts, or a uniform prior, planned under the
resolved budget with the shared planner. Sizes are the hot bank's resident bytes (the encoded
bytes where a fused kernel computes them, else dense weights in the compute dtype), since
that is what occupies the device; the cold bank keeps the file's encoding."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvq.bank.hist import Histogram
from kvq.bank.hot_set import plan_hot_set
from kvq.bank.options import BankOptions, device_free_bytes, resolve_budget
from kvq.bank.planner import LayerTable, Plan, table
from kvq.bank.store import hot_encoded
from kvq.errors import BankError
from kvq.model.expert_slice import ExpertSlice
from kvq.model.qstack import QStack


def resident_bytes(sl: ExpertSlice, device: torch.device) -> int:
    """Bytes one expert's gate + up + down take in `device`'s hot bank: encoded, or dense in
    the compute dtype (`hot_encoded`)."""
    if hot_encoded(sl.stacks, device, sl.compute_dtype):
        return sum(t.expert_nbytes for t in sl.stacks if isinstance(t, QStack))
    per = torch.empty((), dtype=sl.compute_dtype).element_size()
    return sum(int(t.shape[1] * t.shape[2]) * per for t in sl.stacks)


def initial_plan(
    sls: dict[int, ExpertSlice],
    hist: Histogram | None,
    opts: BankOptions,
    device: torch.device,
    stock_hot_bytes: int | None,
) -> Plan:
    """The static hot set across the given layers (global expert ids)."""
    tables: list[LayerTable] = []
    for layer, sl in sorted(sls.items()):
        counts = hist_counts(hist, sl) if hist is not None else np.ones(sl.n_experts)
        tables.append(table(layer, counts, np.full(sl.n_experts, resident_bytes(sl, device))))
    total = int(sum(int(t.expert_bytes.sum()) for t in tables))
    free = device_free_bytes(device)
    budget, why = resolve_budget(opts, total, free, stock_hot_bytes, device.type != "cpu")
    plan = plan_hot_set(tables, budget)
    why = f"hot budget {budget} of {total} bytes ({why}); {plan.method}"
    if hist is None:
        why += "; no histogram: the first hot set is arbitrary until counters fill"
    starts = {layer: sl.expert_start for layer, sl in sls.items()}
    hot = {layer: [starts[layer] + e for e in ids] for layer, ids in plan.hot.items()}
    return Plan(
        hot,
        plan.bytes_used,
        plan.budget_bytes,
        plan.covered,
        plan.total,
        plan.method,
        plan.greedy_covered,
        plan.optimal,
        plan.notes,
        why,
    )


def hist_counts(hist: Histogram, sl: ExpertSlice) -> npt.NDArray[np.float64]:
    """The histogram's counts of the slice's experts (BankError if it has fewer experts)."""
    t = hist.layer(sl.layer)
    if t.counts.size < sl.expert_end:
        raise BankError(
            f"histogram layer {sl.layer} has {t.counts.size} experts; the bank holds experts "
            f"up to {sl.expert_end}; use the histogram of this model"
        )
    return t.counts[sl.expert_start : sl.expert_end]
