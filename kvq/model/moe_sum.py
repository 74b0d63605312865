"""A token's MoE output in one summation order wherever its experts ran (X17).

Every path adds a token's routed experts the same way: its terms `w_e * expert_e(x)` (each a
float32 product, the same bits however many rows or experts share the call that computed it)
added from 0 in ascending expert id. A call that holds all of a token's experts does that
itself: the C kernels (`kvq.quant.qdot`, `moe_batch` adds a token's pairs by expert) and the
torch loop of `grouped_expert_ffn` (one `index_add_` per expert, ascending) both start from 0
and add `w * y` expert by expert. Where a token's experts are computed in several places (a
coordinator's slices, local or remote), each place returns the token's terms, one row per
(row, expert) pair (`expert_terms`), and `combine` adds them in that order. So a token's bits
do not depend on the slice grid (`KVQ_SLICE_EXPERTS`), on which slices ran where, or on the
grain: a stage holder's one call over a layer gives what expert grain gives.

Pairs that no part computed count as 0: adding +0.0 to a sum that starts at +0.0 never changes
its bits (round to nearest gives +0.0 for x + (-x)), and a term of -0.0 adds like +0.0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# (x [P, H], ids [P, 1], weights [P, 1]) -> [P, H]: the grouped sum over one expert range
RangeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def inside(ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The (row, choice) pairs of `ids` [T, k] whose expert is in `[lo, hi)`: [T, k] bool."""
    return (ids >= lo) & (ids < hi)  # [T, k]


def expert_terms(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    lo: int,
    hi: int,
    forward: RangeForward,
) -> torch.Tensor:
    """Each pair's term `w * expert(x_row)` for the pairs of `ids` inside `[lo, hi)`, in
    row-major (row, choice) order: [P, H]. `forward` computes the grouped sum over the range;
    it is given one pair per row (a row repeated for each of its experts inside), so each row
    of its answer is that pair's term alone, added to 0. x: [T, H]; ids, weights: [T, k]."""
    mask = inside(ids, lo, hi)  # [T, k]
    rows = mask.nonzero()[:, 0]  # [P] row of each pair, row-major
    if not rows.numel():
        return x.new_zeros((0, x.shape[1]))  # [0, H]
    return forward(x[rows], ids[mask][:, None], weights[mask][:, None])  # [P, H]


def combine(
    ids: torch.Tensor,
    hidden: int,
    dtype: torch.dtype,
    parts: Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The MoE output of rows with experts `ids` [T, k] from terms computed in parts: each
    part `(mask [T, k] bool, terms [P, H])`, its pairs in `mask`'s row-major order (as
    `expert_terms` of the rows gives them). Returns [T, H]: each row's terms added from 0 in
    ascending expert id (`fixed_sum`)."""
    t, k = ids.shape
    terms = torch.zeros(t, k, hidden, dtype=dtype, device=ids.device)  # [T, k, H]
    for mask, part in parts:
        terms[mask] = part.to(dtype)
    return fixed_sum(terms, ids)


def fixed_sum(terms: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """terms [T, k, H] (choice j of row t: its expert `ids[t, j]`'s term) added per row from 0
    in ascending expert id, the order every one-call path adds in. Returns [T, H]."""
    order = ids.argsort(dim=1)  # [T, k]
    rows = torch.arange(ids.shape[0], device=ids.device)  # [T]
    out = torch.zeros(terms.shape[0], terms.shape[2], dtype=terms.dtype, device=terms.device)
    for j in range(ids.shape[1]):
        out = out + terms[rows, order[:, j]]  # [T, H]
    return out
