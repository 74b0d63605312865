"""Micro-batched forward: hide the experts' round trip behind another micro-batch's attention.

A forward over one batch waits, at every MoE layer, for the remote experts' results before the
next layer's attention can start. Cut the batch's sequences into micro-batches and interleave
their passes (`Backbone.layer_calls`) round-robin: micro-batch A sends its layer-i jobs and
computes its local slices (`SplitMoe.start`), then B runs its attention and starts its own
layer i, then A collects its results — which arrived meanwhile — and goes on to layer i+1.

Each micro-batch computes exactly what `Backbone.forward` computes for its sequences alone:
the same functions on the same rows. It is not bit-identical to one forward over all the
sequences, because kvq's kernels are not row-independent: a matrix product's float32 sums
run in a different order for one row than for several (`kvq.quant.kernels`), and a batch's
expert calls group rows differently when the batch is cut. `tests/model/test_microbatch.py`
states both: bit-identical per micro-batch, and logits within float32 rounding (greedy tokens
equal on its models) of the single batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from kvq.model.backbone import Backbone, LayerCalls, SeqStep

Finish = Callable[[], torch.Tensor]  # collects one started MoE call's result [N, H]


@runtime_checkable
class SplitMoe(Protocol):
    """A MoeFn that can also be started and finished apart, and says how many micro-batches
    it wants for this step (1: no split)."""

    microbatches: int

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor: ...

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Finish: ...


def split_rows(rows: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `rows` (token rows per sequence) cut into at most `parts` non-empty groups
    of about equal rows (largest first onto the lightest group; ties to the earliest); each
    group keeps the original order."""
    parts = max(1, min(parts, len(rows)))
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += rows[i]
    return [sorted(g) for g in groups if g]


@torch.no_grad()
def forward_microbatched(
    bb: Backbone, groups: Sequence[list[SeqStep]], start: Callable[..., Finish]
) -> list[torch.Tensor]:
    """The logits `[len(group), V]` of each group, computed as interleaved passes; caches
    advance only if every pass succeeds."""
    passes: list[LayerCalls] = [bb.layer_calls(list(g)) for g in groups]
    waiting: list[Finish | None] = [start(*next(p)) for p in passes]
    out: list[torch.Tensor | None] = [None] * len(passes)
    try:
        while any(f is not None for f in waiting):
            for j, p in enumerate(passes):
                finish = waiting[j]
                if finish is None:
                    continue
                try:
                    waiting[j] = start(*p.send(finish()))
                except StopIteration as done:
                    out[j], waiting[j] = done.value, None
    finally:
        for p in passes:
            p.close()
    for g in groups:
        bb.advance(list(g))
    return [o for o in out if o is not None]
