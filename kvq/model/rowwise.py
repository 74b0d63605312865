"""Matrix products whose every row is the same bits whatever else is in the batch (X17).

A BLAS matrix product `x @ w` picks its kernel by the shape of the call: on the CPU that
torch ships with, one row takes a matrix-vector kernel, two or three rows another, four and
more a third, and each sums a row's products in its own order. So the logits of a sequence
changed with the number of other rows in its step (11 of 24 greedy completions of the `small`
preset differed from the same prompt alone), and within a call a row's bits changed with its
place among the rows and its memory alignment. `row_matmul` computes every row in a call of a
multiple of 4 rows (zero padded, at most 256, each in a fresh buffer): MKL's product then sums
each row in one order whatever the call's row count, its place in the call, the other rows'
values or the thread count (checked over shapes, places, alignments and thread counts:
`tests/model/test_rowwise.py`).

It costs up to 3 padding rows a call, and one call per 256 rows (docs/benchmarks.md, "Batch
invariance"). `KVQ_BATCH_INVARIANT=false` turns it off
(`qdot.KernelOptions.batch_invariant`): plain products, faster prompts, batch-dependent bits.
Quantized weights go through the int8 kernels (`kvq.quant.kernels`), row-invariant already.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from kvq.model.threads import one_thread
from kvq.quant import qdot

log = logging.getLogger("kvq.model")


def invariant(x: torch.Tensor) -> bool:
    """Whether products of `x` take the row-invariant path here (CPU, float32, the setting
    on): the paths kvq guarantees; GPUs and half precision keep the plain product."""
    return qdot.options().batch_invariant and x.device.type == "cpu" and x.dtype == torch.float32


# rows per product call: every row is computed in a call of a multiple of `_QUAD` rows (the
# last block padded with zeros), at most `_BLOCK`, in a fresh buffer: MKL then takes one kernel
# whose order for a row depends neither on the call's row count, the row's place in it, the
# other rows' values nor the thread count (an odd remainder of 2-3 rows takes another).
# Below `_SMALL` weight elements the product takes other code, in which a row's place in the
# block matters (K 31 by M 3, for one): such weights multiply one row per call (cheap there)
_QUAD = 4
_BLOCK = 256
_SMALL = 1 << 16


def row_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ w [K, M] -> [N, M], each row the bits it gets alone: the rows go through
    blocks of up to `_BLOCK`, padded to a multiple of `_QUAD` (one row per call for a small
    weight); a view of a transposed weight is fine: `w` is never copied."""
    if not invariant(x):
        return x @ w
    w = w.to(x.dtype)
    n = x.shape[0]
    out = x.new_empty((n, w.shape[1]))  # [N, M]
    small = w.numel() < _SMALL or not blocks_hold()
    step = 1 if small else _BLOCK
    for s in range(0, n, step):
        e = min(s + step, n)
        rows = 1 if small else -(-(e - s) // _QUAD) * _QUAD
        block = x.new_zeros((rows, x.shape[1]))  # [B, K]: fresh, aligned, zero padded
        block[: e - s] = x[s:e]
        out[s:e] = (block @ w)[: e - s]
    return out


@functools.cache
def blocks_hold() -> bool:
    """Whether this machine's product gives a row the same bits in padded blocks of any size
    and at any place (what `row_matmul`'s blocks rely on: measured on one CPU, so probed once
    per process, on a few weight shapes). Where it does not, every row goes in a call of its
    own: slower (docs/benchmarks.md, "Batch invariance"), as invariant."""
    g = torch.Generator().manual_seed(0)
    for k, m in ((256, 512), (512, 1024), (2048, 96)):
        w = torch.randn(k, m, generator=g)
        x = torch.randn(37, k, generator=g)
        together = _padded(x, w)
        for i in (0, 5, 18, 36):
            if not torch.equal(_padded(x[i : i + 1], w)[0], together[i]):
                log.warning(
                    "this CPU's float32 products change a row's bits with its block: "
                    "batch-invariant products go one row per call (slower)"
                )
                return False
    return True


def _padded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ w in one call of N rounded up to `_QUAD` rows, in a fresh buffer."""
    block = x.new_zeros((-(-x.shape[0] // _QUAD) * _QUAD, x.shape[1]))
    block[: x.shape[0]] = x
    return (block @ w)[: x.shape[0]]


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
