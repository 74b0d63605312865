"""Matrix products whose every row is the same bits whatever else is in the batch (X17).

A BLAS matrix product `x @ w` picks its kernel by the shape of the call: on the CPU that
torch ships with, one row takes a matrix-vector kernel, two or three rows another, four and
more a third, and each sums a row's products in its own order. So the logits of a sequence
changed with the number of other rows in its step (11 of 24 greedy completions of the `small`
preset differed from the same prompt alone), and within a call a row's bits changed with its
place among the rows and its memory alignment. `row_matmul` multiplies each row on its own,
the same one-row call every time: its order depends on the row and the weight only
(checked over shapes, places and thread counts: `tests/model/test_rowwise.py`).

It costs nothing at one row and little where the weight fits the caches (routers, gates);
a large float weight read once per row is slower at many rows (a prompt through a float32
or float16 file's projections: docs/models.md). `KVQ_BATCH_INVARIANT=false` turns it off
(`qdot.KernelOptions.batch_invariant`): plain products, faster prompts, batch-dependent bits.
Quantized weights go through the int8 kernels (`kvq.quant.kernels`), row-invariant already.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvq.model.threads import one_thread
from kvq.quant import qdot


def invariant(x: torch.Tensor) -> bool:
    """Whether products of `x` take the row-invariant path here (CPU, float32, the setting
    on): the paths kvq guarantees; GPUs and half precision keep the plain product."""
    return qdot.options().batch_invariant and x.device.type == "cpu" and x.dtype == torch.float32


def row_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ w [K, M] -> [N, M], each row computed as if it were alone (a view of a
    transposed weight is fine: `w` is never copied)."""
    if not invariant(x):
        return x @ w
    w = w.to(x.dtype)
    out = x.new_empty((x.shape[0], w.shape[1]))  # [N, M]
    for i in range(x.shape[0]):
        # the same call every time: one row, in its own fresh (aligned) buffer, by the same
        # weight; a BLAS kernel's order may change with the rows' count, place or alignment
        out[i] = (x[i : i + 1].clone() @ w)[0]
    return out


def heads_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [heads, N, K] @ w [heads, K, M] -> [heads, N, M] (`torch.bmm`), each head's rows as
    `row_matmul` computes them (MLA's absorbed projections)."""
    if not invariant(x):
        return torch.bmm(x, w)
    return torch.stack([row_matmul(x[h], w[h]) for h in range(x.shape[0])])


# torch's CPU loops take 2 vectors (32 float32 on AVX-512) per step and leave the rest to
# scalar code, whose exp/sin/cos round otherwise than the vector ones; above the grain
# (32768 elements) threads split the range anywhere
_STEP = 32
_GRAIN = 32768


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn` (an elementwise function) of x [..., W], each row's bits those it gets alone:
    rows padded to whole loop steps and, where torch would split the range among threads,
    on one thread, so every element takes the vector code whatever its place in the batch."""
    if not invariant(x):
        return fn(x)
    w = x.shape[-1]
    pad = -w % _STEP
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x.contiguous()
    if xp.numel() <= _GRAIN:
        return fn(xp)[..., :w]
    with one_thread():
        return fn(xp)[..., :w]
