"""Routed-expert compute for one slice: SwiGLU experts, weighted and summed per token.

An expert is `down(act(gate x + bg, up x + bu)) + bd`: `act` is silu(g) * u, or gpt-oss's
clamped form (`swiglu_oai`); the biases exist only where the arch has them (gpt-oss) and come
with the slice, so a worker computes exactly what the coordinator would.

A token's experts are added from 0 in ascending expert id, each term `w * y` a float32
product of the same bits however the call is grouped: where a layer's experts are computed in
several places (a coordinator's slices, local or on workers), each gives its pairs' terms
(`slice_terms`) and `kvq.model.moe_sum.combine` adds them in that order, the same bits as one
`expert_forward` over the layer (X17).

`grouped_expert_ffn` is the one loop both the model's reference path and the bank run; they
differ only in where an expert's weights come from (`weights_of`), so their outputs are the same
bits.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvq.errors import KvqError, ModelError
from kvq.gguf.arch import ACT_SILU, ACT_SWIGLU_OAI
from kvq.model.expert_slice import ExpertSlice
from kvq.model.layers import OAI_ALPHA, OAI_LIMIT, gated, linear, swiglu
from kvq.model.moe_sum import expert_terms
from kvq.model.qstack import QMatrix, Weight
from kvq.quant import kernels

ExpertWeights = tuple[Weight, Weight, Weight]  # gate [F, H], up, down [H, F]: dense or encoded
WeightsOf = Callable[[int], ExpertWeights]  # expert index within [lo, hi) -> its weights
ExpertBias = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [F], up [F], down [H]
BiasOf = Callable[[int], ExpertBias | None]  # expert index within [lo, hi) -> its biases


def expert_ffn(
    x: torch.Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
    act: str = ACT_SILU,
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """One expert on rows x: `down(act(gate x + bg, up x + bu)) + bd`. x: [m, H] -> [m, H]."""
    if act == ACT_SILU and bias is None:
        return swiglu(x, gate, up, down)
    g, u = linear(x, gate), linear(x, up)  # [m, F] each
    if bias is not None:
        g, u = g + bias[0].to(g.dtype), u + bias[1].to(u.dtype)
    y = linear(gated(g, u, act), down)  # [m, H]
    return y if bias is None else y + bias[2].to(y.dtype)


def expert_forward(
    sl: ExpertSlice, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Sum over each row's selected experts inside `sl` of `w * down(silu(gate x) * up x)`.

    x: [T, H]; ids: [T, k] int64 global expert ids; weights: [T, k]. Experts outside
    `[sl.expert_start, sl.expert_end)` contribute 0. Returns [T, H] in x.dtype.
    """
    check_inputs(sl.hidden, x, ids, weights)
    return grouped_expert_ffn(
        x,
        ids,
        weights,
        sl.expert_start,
        sl.expert_end,
        sl.expert,
        sl.compute_dtype,
        act=sl.act,
        bias_of=sl.bias if sl.biases is not None else None,
    )


def slice_terms(
    sl: ExpertSlice, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, lo: int, hi: int
) -> torch.Tensor:
    """Each pair's term of `sl`'s experts in `[lo, hi)` (`kvq.model.moe_sum.expert_terms`):
    what a coordinator's slice over that range gives, local or remote. x: [T, H]; ids,
    weights: [T, k]. Returns [P, H], the pairs inside in row-major (row, choice) order."""
    check_inputs(sl.hidden, x, ids, weights)
    first = sl.expert_start

    def forward(xp: torch.Tensor, ip: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
        return grouped_expert_ffn(
            xp,
            ip,
            wp,
            lo,
            hi,
            lambda e: sl.expert(e + lo - first),
            sl.compute_dtype,
            act=sl.act,
            bias_of=None if sl.biases is None else (lambda e: sl.bias(e + lo - first)),
        )

    return expert_terms(x, ids, weights, lo, hi, forward)  # [P, H]


def grouped_expert_ffn(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    lo: int,
    hi: int,
    weights_of: WeightsOf,
    cdtype: torch.dtype,
    before_compute: Callable[[], None] | None = None,
    inside: torch.Tensor | None = None,
    act: str = ACT_SILU,
    bias_of: BiasOf | None = None,
) -> torch.Tensor:
    """Sum over each row's selected experts in `[lo, hi)` of
    `w * expert_ffn(x, *weights_of(e), act, bias_of(e))`, computed in `cdtype` and returned
    in x.dtype.

    x: [T, H]; ids: [T, k] int64 global expert ids; weights: [T, k]. `weights_of` gets the
    expert's index within `[lo, hi)`. `before_compute` runs once before the first matmul, and
    only if some pair falls inside. `inside` ([T, k] bool): the mask of ids in `[lo, hi)`, if
    the caller already has it.
    """
    if x.device.type == "cpu" and cdtype == torch.float32 and kernels.int8_active():
        weights_of = _looked_up_once(weights_of)  # the loop below reuses what the call saw
        fused = _int8_call(x, ids, weights, lo, hi, weights_of, before_compute, act, bias_of)
        if fused is not None:
            return fused.to(x.dtype)  # [T, H]
    out = torch.zeros(x.shape, dtype=cdtype, device=x.device)  # [T, H]
    if inside is None:
        inside = (ids >= lo) & (ids < hi)  # [T, k]
    if not bool(inside.any()):
        return out.to(x.dtype)
    xc = x.to(cdtype)  # [T, H]
    rows = inside.nonzero()[:, 0]  # [M] token row of each (row, choice) pair inside the range
    local = ids[inside] - lo  # [M] expert index within [lo, hi)
    w = weights[inside].to(cdtype)  # [M]
    # group pairs by expert so each expert runs three dense matmuls over all of its rows
    order = torch.argsort(local, stable=True)  # [M]
    rows, local, w = rows[order], local[order], w[order]
    counts = torch.bincount(local, minlength=hi - lo).tolist()  # host sync: loop bounds
    if before_compute is not None:
        before_compute()
    start, cpu = 0, x.device.type == "cpu"
    for e, n in enumerate(counts):
        if n == 0:
            continue
        r = rows[start : start + n]  # [m]
        bias = None if bias_of is None else bias_of(e)
        y = expert_ffn(xc.index_select(0, r), *weights_of(e), act, bias)  # [m, H]
        if n == 1 and cpu:  # decode: the same sum; index_add_ would start torch's thread team
            out[int(r[0])].add_(y[0] * w[start])
        else:
            out.index_add_(0, r, y * w[start : start + n, None])
        start += n
    return out.to(x.dtype)


def _looked_up_once(weights_of: WeightsOf) -> WeightsOf:
    """`weights_of` that looks each expert up once (a bank's lookup may load it)."""
    seen: dict[int, ExpertWeights] = {}

    def once(e: int) -> ExpertWeights:
        if e not in seen:
            seen[e] = weights_of(e)
        return seen[e]

    return once


def _int8_call(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    lo: int,
    hi: int,
    weights_of: WeightsOf,
    before_compute: Callable[[], None] | None,
    act: str = ACT_SILU,
    bias_of: BiasOf | None = None,
) -> torch.Tensor | None:
    """The CPU case with int8 activations: every row's experts in `[lo, hi)` in one C call,
    one token (decode at batch 1, `kernels.moe_int8`) or several (`kernels.moe_int8_batch`,
    each expert's weights unpacked once for all of its rows). Each row gets the same bits
    whatever else is in the batch, added in the order of the loop it replaces (by expert, each
    term `w * y` added to a sum that starts at 0). x: [T, H]; ids, weights: [T, k]. `act` and
    `bias_of`: gpt-oss's form, computed in the same call. Returns [T, H] float32, or None
    where the kernel does not cover these experts (the loop runs)."""
    if not kernels.int8_active():
        return None
    pairs = sorted(
        (
            (e - lo, t, w)
            for t, (es, ws) in enumerate(zip(ids.tolist(), weights.tolist(), strict=True))
            for e, w in zip(es, ws, strict=True)
            if lo <= e < hi
        ),
        key=lambda p: p[:2],
    )  # (expert, row, weight), by expert then row
    if not pairs:
        return torch.zeros(x.shape, dtype=torch.float32)
    experts = sorted({e for e, _, _ in pairs})
    packed = _packed_weights(experts, weights_of)
    if packed is None:
        return None
    raws, types = packed
    if not kernels.moe_covers(types, int(x.shape[1]), int(raws[0][0].shape[0])):
        return None
    biases = None
    if bias_of is not None:
        got = [bias_of(e) for e in experts]
        if any(b is None or not all(t.device.type == "cpu" for t in b) for b in got):
            return None
        biases = [tuple(t.float().contiguous() for t in b) for b in got if b is not None]
    if before_compute is not None:
        before_compute()
    xf = x.to(torch.float32)
    # gpt-oss's form where it applies (the plain call stays the plain one)
    form: dict[str, Any] = {}
    if act == ACT_SWIGLU_OAI or biases is not None:
        form = {"oai": act == ACT_SWIGLU_OAI, "biases": biases}
    if x.shape[0] == 1:
        return kernels.moe_int8(xf[0], raws, types, [w for _, _, w in pairs], **form)[None]
    counts = collections.Counter(e for e, _, _ in pairs)
    start = list(itertools.accumulate((counts[e] for e in experts), initial=0))  # [n + 1]
    rows, wts = [t for _, t, _ in pairs], [w for _, _, w in pairs]
    return kernels.moe_int8_batch(xf, raws, types, start, rows, wts, **form)


Raws = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _packed_weights(
    experts: list[int], weights_of: WeightsOf
) -> tuple[Raws, tuple[int, int, int]] | None:
    """Each expert's gate, up and down blocks as stored (contiguous CPU tensors) and their
    three ggml types, or None unless every expert is quantized alike (the kernel's input)."""
    raws: Raws = []
    types: tuple[int, int, int] | None = None
    for e in experts:
        g, u, d = weights_of(e)
        if not (isinstance(g, QMatrix) and isinstance(u, QMatrix) and isinstance(d, QMatrix)):
            return None
        types = types or (g.qtype, u.qtype, d.qtype)
        if (g.qtype, u.qtype, d.qtype) != types or not all(
            m.raw.is_contiguous() and m.raw.device.type == "cpu" for m in (g, u, d)
        ):
            return None
        raws.append((g.raw, u.raw, d.raw))
    return (raws, types) if types is not None else None


def check_inputs(
    hidden: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    error: type[KvqError] = ModelError,
) -> None:
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
    biases: tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike] | None = None,
    act: str = ACT_SILU,
) -> npt.NDArray[np.float64]:
    """Slow float64 loop version of `expert_forward` for tests (gate/up [n, F, H], down
    [n, H, F]; biases [n, F], [n, F], [n, H])."""
    g, u, d = (np.asarray(a, dtype=np.float64) for a in (gate, up, down))
    n, f, h = g.shape
    bg, bu, bd = (
        (np.zeros((n, f)), np.zeros((n, f)), np.zeros((n, h)))
        if biases is None
        else (np.asarray(b, dtype=np.float64) for b in biases)
    )
    xs = np.asarray(x, dtype=np.float64)  # [T, H]
    idx = np.asarray(ids, dtype=np.int64)  # [T, k]
    ws = np.asarray(weights, dtype=np.float64)  # [T, k]
    out = np.zeros_like(xs)  # [T, H]
    for t in range(xs.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j]) - expert_start
            if not 0 <= e < g.shape[0]:
                continue
            a, b = g[e] @ xs[t] + bg[e], u[e] @ xs[t] + bu[e]  # [F] each
            if act == ACT_SWIGLU_OAI:
                a, b = np.minimum(a, OAI_LIMIT), np.clip(b, -OAI_LIMIT, OAI_LIMIT) + 1.0
                hid = a / (1.0 + np.exp(-OAI_ALPHA * a)) * b  # [F]
            else:
                hid = a / (1.0 + np.exp(-a)) * b  # [F] silu(gate) * up
            out[t] += ws[t, j] * (d[e] @ hid + bd[e])  # [H]
    return out
