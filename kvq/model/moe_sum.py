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
BLOCK_ELEMENTS = 1 << 20  # floats of terms `combine` gathers at once (4 MB in float32)


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
    ascending expert id, a pair no part computed counting as 0."""
    t, k = ids.shape
    rank = ids.argsort(dim=1).argsort(dim=1)  # [T, k] place of each choice by expert id
    slot = torch.arange(t, device=ids.device)[:, None] * k + rank  # [T, k] its row of [T*k]
    got = []
    for mask, part in parts:  # its slots [P], terms [P, H], pairs before each row [T + 1]
        before = [0, *mask.sum(dim=1).cumsum(0).tolist()]
        got.append((slot[mask], part.to(dtype), before))
    out = torch.zeros(t, hidden, dtype=dtype, device=ids.device)  # [T, H]
    block = max(1, min(t, BLOCK_ELEMENTS // max(1, k * hidden)))
    ranked = torch.empty(block * k, hidden, dtype=dtype, device=ids.device)  # [B*k, H]
    for a in range(0, t, block):
        b = min(a + block, t)
        placed = 0
        for slots, part, before in got:  # each term copied once, to its place by rank
            lo, hi = before[a], before[b]
            if hi > lo:
                _place(ranked, slots[lo:hi] - a * k, part[lo:hi])
                placed += hi - lo
        rows = ranked[: (b - a) * k].view(b - a, k, hidden)  # [B, k, H]
        if placed < (b - a) * k:  # some pairs missing: they count as 0
            rows.zero_()
            for slots, part, before in got:
                lo, hi = before[a], before[b]
                _place(ranked, slots[lo:hi] - a * k, part[lo:hi])
        acc = out[a:b]  # [B, H]
        for j in range(k):
            acc.add_(rows[:, j])  # acc + term: one rounding, from 0
    return out


def _place(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst[rows] = src (dst [N, H], rows [P], src [P, H]): numpy's row copies on the CPU, 3x
    torch's `index_copy_` there."""
    if dst.device.type == "cpu":
        dst.numpy()[rows.numpy()] = src.numpy()
    else:
        dst.index_copy_(0, rows, src)
