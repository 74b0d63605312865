"""A decode step's attention for every sequence of a batch in one C call.

Decoding, each sequence brings one new query per head; attending it against that sequence's
cache in torch costs about ten small calls per sequence and layer, 86 us on two cores, which at
32 sequences is 9 % of an olmoe step. `csrc/attn_decode.h` writes the new keys and values into
every cache and computes every (sequence, head) in one call, reading the caches in place.

It applies to full-attention layers of float32 caches on the CPU (sinks allowed): sliding and
chunked layers, latent caches and prompts keep `layers.causal_attention`. The kernel sums in
another order than torch, so results differ from that path by float32 rounding only
(`tests/model/test_decode_attention.py`); each sequence's result is the same whatever else is in
the batch.
"""

from __future__ import annotations

import math

import torch

from kvq.model.cache import KVCache
from kvq.quant import qdot


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: list[KVCache],
    layer: int,
    scale: float = 0.0,
    sinks: torch.Tensor | None = None,
    ahead: list[int] | None = None,
) -> torch.Tensor | None:
    """Attention of one new token per sequence: q [S, heads, d], k and v [S, kv, d] its new
    key and value (stored into caches[s] at its `length`, not advanced). `scale` 0 means
    1/sqrt(d); `sinks` [heads] as in `causal_attention`. Returns [S, heads * d] float32, or
    None where the kernel does not apply (the caller runs `causal_attention` per sequence).

    `ahead[s]`: row s is at `length + ahead[s]` of its cache (a speculative pass's rows, one
    cache repeated for each): the kernel writes every new key before it reads any, so each
    row gets the bits a decode step at its position gets."""
    n, heads, d = q.shape
    kv = k.shape[1]
    tensors = (q, k, v) + (() if sinks is None else (sinks,))
    if n != len(caches) or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    if any(
        c.k.dtype != torch.float32 or c.k.device.type != "cpu" or not c.holds_keys(layer)
        for c in caches
    ):
        return None
    built = qdot.load_configured()
    if built is None:
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    sink = None if sinks is None else sinks.contiguous()
    at = ahead if ahead is not None else [0] * n
    for c, a in zip(caches, at, strict=True):
        c.decode_slot(layer, a)  # grow first: a later row's growth would move an earlier's
    slots = [c.decode_slot(layer, a) for c, a in zip(caches, at, strict=True)]
    out = torch.empty((n, heads, d), dtype=torch.float32)
    qdot.attn_decode(
        built,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        [(ks.data_ptr(), vs.data_ptr()) for ks, vs in slots],
        [c.length + a for c, a in zip(caches, at, strict=True)],
        heads,
        kv,
        d,
        scale or 1.0 / math.sqrt(d),
        0 if sink is None else sink.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out.view(n, heads * d)
