"""`causal_attention` against a float64 reference written head by head, the plain way: each
query head h reads kv head h // (heads / kv), masked to positions <= its own."""

from __future__ import annotations

import math

import pytest
import torch

from kvq.model.layers import causal_attention


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float
) -> torch.Tensor:
    t, heads, d = q.shape
    group = heads // k.shape[1]
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.zeros(t, heads, d, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k64[:, h // group], v64[:, h // group]  # [S, d]
        for i in range(t):
            seen = q_start + i + 1  # positions 0..q_start+i
            s = (kh[:seen] @ q64[i, h]) * (scale or 1.0 / math.sqrt(d))
            out[i, h] = torch.softmax(s, dim=0) @ vh[:seen]
    return out.reshape(t, heads * d)


@pytest.mark.parametrize(
    ("heads", "kv", "t", "past", "scale"),
    [
        (4, 4, 1, 9, 0.0),  # decode, one kv head per query head
        (8, 2, 1, 0, 0.0),  # decode at position 0 (GQA 4:1)
        (8, 2, 5, 3, 0.0),  # several new tokens after a cached prefix: the mask matters
        (6, 1, 7, 0, 0.25),  # multi-query, a prompt from scratch, an explicit scale
        (32, 4, 1, 63, 0.0),  # qwen3's 8:1 grouping
    ],
)
def test_matches_the_float64_reference(
    heads: int, kv: int, t: int, past: int, scale: float
) -> None:
    g = torch.Generator().manual_seed(heads * 100 + t)
    d = 16
    q = torch.randn(t, heads, d, generator=g)
    k = torch.randn(past + t, kv, d, generator=g)
    v = torch.randn(past + t, kv, d, generator=g)
    got = causal_attention(q, k, v, past, scale)
    assert got.shape == (t, heads * d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, k, v, past, scale), rtol=1e-5, atol=1e-5)


def test_a_new_token_never_sees_later_positions() -> None:
    """Changing a key or value after a query's position leaves that query's output unchanged."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(4, 8, 16, generator=g),
        torch.randn(4, 2, 16, generator=g),
        torch.randn(4, 2, 16, generator=g),
    )
    a = causal_attention(q, k, v, 0)
    k2, v2 = k.clone(), v.clone()
    k2[3], v2[3] = 100.0, -100.0
    b = causal_attention(q, k2, v2, 0)
    assert torch.equal(a[:3], b[:3]) and not torch.equal(a[3], b[3])
