"""The byte layout of expert slices inside a GGUF file.

A slice is experts `[expert_start, expert_end)` of one layer. The stacked expert tensors
`ffn_{gate,up,down}_exps` have experts as their outermost (numpy dim 0) axis, and each expert's
rows are whole quant blocks, so the slice of each tensor is one contiguous, block-aligned byte
range: `offset + e0 * per_expert`, `(e1 - e0) * per_expert` bytes, for every quant type. A
worker can therefore fetch a slice with three HTTP range requests (six where the experts
have biases, gpt-oss: `ffn_*_exps.bias` [E, F or H] are stacked the same way) and decode it
from the published layout alone (see `meta_to_dict`).
"""

from __future__ import annotations

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf import reader as gio
from kvq.slices import STACKED_KINDS, TensorRange


def _check_slice(meta: ModelMeta, layer: int, expert_start: int, expert_end: int) -> None:
    """ModelError unless `layer` exists and `[expert_start, expert_end)` is a non-empty range."""
    for label, v in (("layer", layer), ("expert_start", expert_start), ("expert_end", expert_end)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ModelError(f"{label} must be an int, got {v!r}")
    if not 0 <= layer < meta.block_count:
        raise ModelError(
            f"layer {layer} is out of range; the model has layers 0..{meta.block_count - 1}"
        )
    if not 0 <= expert_start < expert_end <= meta.expert_count:
        raise ModelError(
            f"expert range [{expert_start}, {expert_end}) is invalid; need "
            f"0 <= start < end <= {meta.expert_count} (the layer's expert count)"
        )
    if layer not in meta.expert_tensors:
        raise ModelError(f"layer {layer} has no expert tensor layout in this ModelMeta")


def slice_layout(
    meta: ModelMeta, layer: int, expert_start: int, expert_end: int
) -> list[TensorRange]:
    """Byte ranges of experts `[expert_start, expert_end)` of `layer` in gate, up, down order,
    then their biases where the layer has them (`STACKED_KINDS`)."""
    _check_slice(meta, layer, expert_start, expert_end)
    out: list[TensorRange] = []
    tensors = meta.expert_tensors[layer]
    for kind in (k for k in STACKED_KINDS if k in tensors):
        full = tensors[kind]
        per_expert = gio.nbytes_for(full.ggml_type, full.expert_shape)  # whole quant blocks
        if per_expert * meta.expert_count != full.nbytes:
            raise ModelError(
                f"{full.name}: {full.nbytes} bytes is not {meta.expert_count} experts of "
                f"{per_expert} bytes; the published layout is inconsistent, republish the model"
            )
        out.append(
            TensorRange(
                name=full.name,
                kind=kind,
                offset=full.offset + expert_start * per_expert,
                nbytes=(expert_end - expert_start) * per_expert,
                ggml_type=full.ggml_type,
                expert_shape=full.expert_shape,
            )
        )
    return out


def slice_nbytes(meta: ModelMeta, layer: int, expert_start: int, expert_end: int) -> int:
    """Total bytes a worker downloads for this slice (sum of the three ranges)."""
    return sum(r.nbytes for r in slice_layout(meta, layer, expert_start, expert_end))
