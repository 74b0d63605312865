"""The decode-attention kernel (`kvq.model.decode_attention`, `csrc/attn_decode.h`) against
torch's per-sequence `causal_attention`, the path it replaces for decode steps."""

from __future__ import annotations

import pytest
import torch

from kvq.errors import ModelError
from kvq.model import Backbone
from kvq.model import decode_attention as da
from kvq.model.cache import KVCache, SeqStep
from kvq.model.layers import causal_attention

LAYERS, KV, D = 2, 2, 64


def _cache(length: int, seed: int, windows: tuple[int, ...] = ()) -> KVCache:
    """A cache of `length` random positions in every layer."""
    c = KVCache(LAYERS, 512, KV, D, initial=8, windows=windows or [0] * LAYERS)
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        if length:
            c.append(
                layer,
                torch.randn(length, KV, D, generator=g),
                torch.randn(length, KV, D, generator=g),
            )
    c.length = length
    return c


def _new(n: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, heads, D, generator=g),
        torch.randn(n, KV, D, generator=g),
        torch.randn(n, KV, D, generator=g),
    )


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: list[KVCache],
    layer: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """What the backbone's loop computes: append, then causal_attention, per sequence."""
    outs = []
    for i, c in enumerate(caches):
        keys, values = c.append(layer, k[i : i + 1], v[i : i + 1])
        outs.append(causal_attention(q[i : i + 1], keys, values, c.length, 0.0, sinks))
    return torch.cat(outs)


@pytest.mark.parametrize("heads", [2, 8])  # one query head per kv head, and groups of 4
@pytest.mark.parametrize("with_sinks", [False, True])
def test_matches_causal_attention_per_sequence(heads: int, with_sinks: bool) -> None:
    lengths = [0, 1, 7, 8, 100, 300]  # an empty cache, and ones that must grow for the new one
    q, k, v = _new(len(lengths), heads, 1)
    sinks = torch.randn(heads) if with_sinks else None
    mine = [_cache(n, s) for s, n in enumerate(lengths)]
    ref = [_cache(n, s) for s, n in enumerate(lengths)]
    got = da.decode_attention(q, k, v, mine, 1, 0.0, sinks)
    want = _reference(q, k, v, ref, 1, sinks)
    assert got is not None and got.shape == (len(lengths), heads * D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    for a, b, n in zip(mine, ref, lengths, strict=True):  # the new key and value are stored
        torch.testing.assert_close(a.k[1, : n + 1], b.k[1, : n + 1], rtol=0, atol=0)
        torch.testing.assert_close(a.v[1, : n + 1], b.v[1, : n + 1], rtol=0, atol=0)
        assert a.length == n  # not advanced: the pass does that


def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch() -> None:
    q, k, v = _new(5, 4, 2)
    batch = da.decode_attention(q, k, v, [_cache(10 * s + 3, s) for s in range(5)], 0)
    assert batch is not None
    for s in range(5):
        alone = da.decode_attention(
            q[s : s + 1], k[s : s + 1], v[s : s + 1], [_cache(10 * s + 3, s)], 0
        )
        assert alone is not None and torch.equal(alone[0], batch[s])


def test_declines_what_it_does_not_cover() -> None:
    q, k, v = _new(1, 4, 3)
    sliding = _cache(4, 0, windows=(0, 16))
    assert da.decode_attention(q, k, v, [sliding], 1) is None  # a sliding layer
    assert da.decode_attention(q.double(), k.double(), v.double(), [_cache(4, 0)], 0) is None
    assert (
        da.decode_attention(q, k, v, [_cache(4, 0), _cache(4, 1)], 0) is None
    )  # 1 query, 2 caches


def test_a_full_cache_is_refused_before_anything_is_written() -> None:
    c = KVCache(LAYERS, 8, KV, D, initial=8)
    c.length = 8  # every position of the context used
    c.k.zero_()
    q, k, v = _new(1, 4, 5)
    before = c.k.clone()
    with pytest.raises(ModelError, match="exceeds the context length"):
        da.decode_attention(q, k, v, [c], 0)
    assert torch.equal(c.k, before)


def test_heads_that_do_not_group_are_refused_with_a_reason() -> None:
    from kvq.quant import qdot

    built = qdot.load_configured()
    if built is None:
        pytest.skip("no C compiler")
    q, k, v = _new(1, 3, 4)
    with pytest.raises(ValueError, match="heads not a multiple of kv heads"):
        qdot.attn_decode(
            built,
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            [(0, 0)],
            [0],
            3,
            2,
            D,
            0.125,
            0,
            q.data_ptr(),
            1,
        )


def test_backbone_decode_matches_the_per_sequence_loop(
    backbone: Backbone, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sequences of different lengths decode 4 steps: the kernel's logits are the loop's
    within float32 rounding, and the greedy tokens are the same."""
    prompts = [[1, 5, 9], [2, 7, 11, 13, 17, 19], [3]]

    def run() -> tuple[list[torch.Tensor], list[list[int]]]:
        caches = [backbone.new_cache() for _ in prompts]
        logits = backbone.forward([SeqStep(p, c) for p, c in zip(prompts, caches, strict=True)])
        got, toks = [logits], [logits.argmax(-1).tolist()]
        for _ in range(4):
            logits = backbone.forward(
                [SeqStep([t], c) for t, c in zip(toks[-1], caches, strict=True)]
            )
            got.append(logits)
            toks.append(logits.argmax(-1).tolist())
        return got, toks

    calls: list[int] = []
    real = da.decode_attention

    def counted(*a: object, **kw: object) -> torch.Tensor | None:
        out = real(*a, **kw)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr("kvq.model.attention.decode_attention", counted)
    fast, fast_toks = run()
    assert calls and all(calls)  # every decode layer took the kernel
    monkeypatch.setattr("kvq.model.attention.decode_attention", lambda *a, **kw: None)
    loop, loop_toks = run()
    assert fast_toks == loop_toks
    for a, b in zip(fast, loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
