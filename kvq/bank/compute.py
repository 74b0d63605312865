"""A bank's expert compute and routing counters, through one published SlotMap."""

from __future__ import annotations

import torch

from kvq.bank.coldpath import ffn
from kvq.bank.store import LayerStore, SlotMap
from kvq.errors import BankError
from kvq.model.experts import check_inputs as check_expert_inputs


def check_inputs(st: LayerStore, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
    """BankError on shape, dtype or device mismatches (cheap checks, no host sync)."""
    check_expert_inputs(st.cold[0].shape[2], x, ids, w, BankError)
    if x.device.type != st.device.type or ids.device.type != st.device.type:
        raise BankError(
            f"x is on {x.device} and ids on {ids.device}; this bank computes on {st.device}"
        )


def count(st: LayerStore, ids: torch.Tensor, inside: torch.Tensor) -> None:
    """counter[local id] += 1 per routed pair inside; the others land in the spare last bin.
    Device ops only (no bincount, no boolean indexing): no host sync in the decode path."""
    idx = torch.where(inside, ids - st.start, st.n).reshape(-1)  # [T*k]
    idx = idx.to(st.counter.device)
    st.counter.index_add_(0, idx, torch.ones_like(idx))


def compute(
    st: LayerStore, m: SlotMap, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    inside: torch.Tensor, lo: int, hi: int,
) -> torch.Tensor:  # fmt: skip
    """`kvq.model.expert_forward`'s loop (same ops, same order, so the same bits) with each
    expert's weights looked up through map `m`. inside: [T, k] ids within [lo, hi)."""
    cdtype = st.dtype
    out = torch.zeros(x.shape, dtype=cdtype, device=x.device)  # [T, H]
    if not bool(inside.any()):
        return out.to(x.dtype)
    xc = x.to(cdtype)  # [T, H]
    rows = inside.nonzero()[:, 0]  # [M] token row of each pair inside the range
    local = ids[inside] - lo  # [M] expert index within [lo, hi)
    w = weights[inside].to(cdtype)  # [M]
    order = torch.argsort(local, stable=True)  # [M] grouped by expert
    rows, local, w = rows[order], local[order], w[order]
    counts = torch.bincount(local, minlength=hi - lo).tolist()  # host sync: loop bounds
    if m.ready is not None:  # copies into hot slots of this map: wait on the GPU, not the host
        torch.cuda.current_stream(x.device).wait_event(m.ready)
    start = 0
    for j, n in enumerate(counts):
        if n == 0:
            continue
        g, u, d = st.weights(m, lo - st.start + j)
        r = rows[start : start + n]  # [m]
        y = ffn(xc.index_select(0, r), g, u, d)  # [m, H]
        out.index_add_(0, r, y * w[start : start + n, None])
        start += n
    return out.to(x.dtype)
