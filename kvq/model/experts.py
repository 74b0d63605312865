"""Routed-expert compute for one slice: SwiGLU experts, weighted and summed per token.

Because each expert's contribution is added independently, summing `expert_forward` over any
partition of a layer's experts into slices gives the full-layer result; this is what lets the
coordinator scatter one layer's tokens over many workers and add the partial outputs.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from kvq.errors import KvqError, ModelError
from kvq.model.slices import ExpertSlice


def expert_forward(
    sl: ExpertSlice, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Sum over each row's selected experts inside `sl` of `w * down(silu(gate x) * up x)`.

    x: [T, H]; ids: [T, k] int64 global expert ids; weights: [T, k]. Experts outside
    `[sl.expert_start, sl.expert_end)` contribute 0. Returns [T, H] in x.dtype.
    """
    check_inputs(sl.gate.shape[2], x, ids, weights)
    cdtype = sl.gate.dtype
    xc = x.to(cdtype)  # [T, H]
    out = torch.zeros(x.shape, dtype=cdtype, device=x.device)  # [T, H]
    inside = (ids >= sl.expert_start) & (ids < sl.expert_end)  # [T, k]
    if not bool(inside.any()):
        return out.to(x.dtype)
    rows = inside.nonzero()[:, 0]  # [M] token row of each (row, choice) pair inside the slice
    local = ids[inside] - sl.expert_start  # [M] expert index within the slice
    w = weights[inside].to(cdtype)  # [M]
    # group pairs by expert so each expert runs three dense matmuls over all of its rows.
    # kvq.bank.compute repeats these exact ops in this order to give the same bits: change
    # both together.
    order = torch.argsort(local, stable=True)  # [M]
    rows, local, w = rows[order], local[order], w[order]
    counts = torch.bincount(local, minlength=sl.n_experts).tolist()  # host sync: loop bounds
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        r = rows[start : start + count]  # [m]
        xe = xc.index_select(0, r)  # [m, H]
        h = F.silu(xe @ sl.gate[e].T) * (xe @ sl.up[e].T)  # [m, F]
        y = h @ sl.down[e].T  # [m, H]
        out.index_add_(0, r, y * w[start : start + count, None])
        start += count
    return out.to(x.dtype)


def check_inputs(
    hidden: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    error: type[KvqError] = ModelError,
) -> None:  # fmt: skip
    """`error` on shape or dtype mismatches of an expert call (cheap checks, no host sync)."""
    if x.ndim != 2 or x.shape[1] != hidden:
        raise error(f"x has shape {tuple(x.shape)}; expected [tokens, {hidden}] (hidden size)")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or tuple(weights.shape) != tuple(ids.shape):
        raise error(
            f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
            f"[{x.shape[0]}, k] to match x"
        )
    if ids.dtype != torch.int64:
        raise error(f"expert ids must be int64, got {ids.dtype}")


def expert_forward_reference(
    gate: npt.ArrayLike,
    up: npt.ArrayLike,
    down: npt.ArrayLike,
    expert_start: int,
    x: npt.ArrayLike,
    ids: npt.ArrayLike,
    weights: npt.ArrayLike,
) -> npt.NDArray[np.float64]:
    """Slow float64 loop version of `expert_forward` for tests (gate/up [n, F, H], down [n, H, F])."""
    g, u, d = (np.asarray(a, dtype=np.float64) for a in (gate, up, down))
    xs = np.asarray(x, dtype=np.float64)  # [T, H]
    idx = np.asarray(ids, dtype=np.int64)  # [T, k]
    ws = np.asarray(weights, dtype=np.float64)  # [T, k]
    out = np.zeros_like(xs)  # [T, H]
    for t in range(xs.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j]) - expert_start
            if not 0 <= e < g.shape[0]:
                continue
            a = g[e] @ xs[t]  # [F]
            h = a / (1.0 + np.exp(-a)) * (u[e] @ xs[t])  # [F] silu(gate) * up
            out[t] += ws[t, j] * (d[e] @ h)  # [H]
    return out
