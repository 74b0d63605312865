"""A bank's expert compute and routing counters, through one published SlotMap."""

from __future__ import annotations

import torch

from kvq.bank.store import LayerStore, SlotMap, Weights
from kvq.errors import BankError
from kvq.model.experts import check_inputs as check_expert_inputs
from kvq.model.experts import grouped_expert_ffn


def check_inputs(st: LayerStore, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
    """BankError on shape, dtype or device mismatches (cheap checks, no host sync)."""
    check_expert_inputs(st.hidden, x, ids, w, BankError)
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
    st: LayerStore,
    m: SlotMap,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    inside: torch.Tensor,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """`kvq.model.expert_forward`'s kernel with each expert's weights looked up through map
    `m`, so the same bits. inside: [T, k] ids within [lo, hi)."""

    def weights_of(j: int) -> Weights:
        return st.weights(m, lo - st.start + j)

    def bias_of(j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return st.bias(lo - st.start + j)

    def wait_for_copies() -> None:
        """The copies into this map's hot slots: wait on the GPU stream, not the host."""
        torch.cuda.current_stream(x.device).wait_event(m.ready)

    before = None if m.ready is None else wait_for_copies
    return grouped_expert_ffn(
        x,
        ids,
        weights,
        lo,
        hi,
        weights_of,
        st.dtype,
        before,
        inside,
        st.act,
        bias_of if st.biases is not None else None,
    )
