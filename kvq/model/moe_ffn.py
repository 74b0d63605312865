"""One MoE layer's FFN as the forward pass runs it: route, hand the routed experts' work to
whoever computes it (a `MoeFn`: local experts or remote workers), add the shared expert.

The routed call is `(layer, x, ids, w)` and its answer `sum_j w[:, j] * expert_ids[:, j](x)`,
[N, H], for every family. Llama-4 weights the experts' input instead of their output
(`ArchSpec.scale_input`, llama.cpp's weight-before-FFN): row t's chosen expert j reads
`w[t, j] * x[t]`. It is sent as the same call over `N * k` rows, one per (row, choice), each
with its one expert and weight 1, and the answers of a row's k choices are summed here, so
workers, banks and slices serve it as they serve the others.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager

import torch

from kvq.errors import ModelError
from kvq.model.layers import Gating, route, swiglu
from kvq.model.loader import MoeFfn, SharedExpert
from kvq.model.rowwise import pointwise, row_matmul

# (layer, x [T, H] after ffn_norm, topk_ids [T, k] int64, topk_w [T, k] float32)
MoeCall = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


def routed_call(
    layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, scale_input: bool
) -> MoeCall:
    """The routed experts' call for rows x [N, H] routed to ids, w [N, k]."""
    if not scale_input:
        return layer, x, ids, w
    n, k = ids.shape
    xs = (x[:, None, :] * w[:, :, None].to(x.dtype)).reshape(n * k, -1)  # [N*k, H]
    return layer, xs, ids.reshape(n * k, 1), torch.ones(n * k, 1, dtype=w.dtype, device=w.device)


def moe_ffn(
    layer: int,
    ffn: MoeFfn,
    x: torch.Tensor,
    gating: Gating,
    scale_input: bool,
    small: Callable[[], AbstractContextManager[None]],
) -> Generator[MoeCall, torch.Tensor, torch.Tensor]:
    """The FFN of MoE layer `layer` on x [N, H] (after its norm): yields the routed call,
    expects its answer sent back, returns the FFN's output [N, H] (shared expert included)."""
    with small():
        ids, w = route(ffn.router, x, gating, ffn.probs_bias, ffn.router_bias)  # [N, k] each
    call = routed_call(layer, x, ids, w, scale_input)
    y = yield call
    want = tuple(call[1].shape)
    if tuple(y.shape) != want:
        raise ModelError(
            f"moe fn returned shape {tuple(y.shape)} for layer {layer}, expected {want}"
        )
    y = y.to(device=x.device, dtype=x.dtype)
    if scale_input:
        y = y.view(x.shape[0], ids.shape[1], -1).sum(1)  # [N, H]: each row's k answers
    if ffn.shared is not None:
        y = y + shared_ffn(ffn.shared, x)
    return y


def shared_ffn(sh: SharedExpert, x: torch.Tensor) -> torch.Tensor:
    """The shared expert(s), gated per row by a sigmoid where the arch has that gate
    (qwen2moe). x: [N, H]. Returns [N, H]."""
    y = swiglu(x, sh.gate, sh.up, sh.down)  # [N, H]
    if sh.gate_inp is None:
        return y
    return pointwise(torch.sigmoid, row_matmul(x, sh.gate_inp[:, None])) * y  # [N, 1] gate
