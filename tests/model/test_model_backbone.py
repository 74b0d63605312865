"""Backbone: batching, KV cache, greedy generation, remote-style MoE, router skew."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from kvq.errors import ModelError
from kvq.model import Backbone, ExpertSlice, KVCache, SeqStep, expert_forward
from kvq.model.generate import generate
from kvq.text import ByteTokenizer

ALL_BACKBONES = ["backbone", "odd_backbone", "qwen2_backbone", "mixtral_backbone"]
PROMPTS = [
    "abc",
    "The quick brown fox",
    "zzzz",
    "12345",
    "once upon a time",
    "Redis streams are great",
]


def _ids(bb: Backbone, text: str) -> list[int]:
    return ByteTokenizer.from_meta(bb.meta).encode(text)


def _alone(bb: Backbone, tokens: list[int]) -> torch.Tensor:
    return bb.forward([SeqStep(tokens, bb.new_cache())])[0]  # [V]


@pytest.mark.parametrize("which", ALL_BACKBONES)
def test_batched_forward_equals_each_alone(which: str, request: pytest.FixtureRequest) -> None:
    bb: Backbone = request.getfixturevalue(which)
    a, b = _ids(bb, "hello there"), _ids(bb, "MoE")
    ca, cb = bb.new_cache(), bb.new_cache()
    got = bb.forward([SeqStep(a, ca), SeqStep(b, cb)])  # prefill both together
    assert got.shape == (2, bb.meta.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got[0], _alone(bb, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], _alone(bb, b), rtol=1e-5, atol=1e-5)
    # a mixed batch: decode step of one sequence next to the prefill of another
    c = _ids(bb, "third")
    mixed = bb.forward([SeqStep([65], ca), SeqStep(c, bb.new_cache())])
    torch.testing.assert_close(mixed[0], _alone(bb, [*a, 65]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1], _alone(bb, c), rtol=1e-5, atol=1e-5)
    assert (ca.length, cb.length) == (len(a) + 1, len(b))


@pytest.mark.parametrize("which", ALL_BACKBONES)
def test_cached_decode_equals_full_recompute(which: str, request: pytest.FixtureRequest) -> None:
    bb: Backbone = request.getfixturevalue(which)
    seq = _ids(bb, "kv caches must not change the answer")
    cache = bb.new_cache()
    bb.forward([SeqStep(seq[:5], cache)])
    bb.forward([SeqStep(seq[5:9], cache)])  # a second chunked prefill
    for i in range(9, len(seq)):
        got = bb.forward([SeqStep([seq[i]], cache)])[0]
        torch.testing.assert_close(got, _alone(bb, seq[: i + 1]), rtol=1e-5, atol=1e-5)
    assert cache.length == len(seq)


def test_logits_are_sane(backbone: Backbone) -> None:
    logits = backbone.forward([SeqStep(_ids(backbone, "sanity"), backbone.new_cache())])
    assert bool(torch.isfinite(logits).all())
    assert float(logits.std()) > 0.5


def test_generate_is_deterministic_and_depends_on_prompt(backbone: Backbone) -> None:
    outs = [generate(backbone, _ids(backbone, p), 12, stop_at_eos=False) for p in PROMPTS]
    assert all(len(o) == 12 for o in outs)
    assert outs[0] == generate(backbone, _ids(backbone, PROMPTS[0]), 12, stop_at_eos=False)
    assert len({tuple(o) for o in outs}) >= len(PROMPTS) - 1
    assert all(len(set(o)) > 2 for o in outs)  # not a single repeated token
    assert generate(backbone, _ids(backbone, "x"), 0) == []


def _split_moe(bb: Backbone, cut: int):  # type: ignore[no-untyped-def]
    """A MoeFn that computes two slices separately and adds them, as remote workers would."""

    def moe(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        full = bb.experts[layer]
        n = full.n_experts
        lo = ExpertSlice(layer, 0, cut, full.gate[:cut], full.up[:cut], full.down[:cut])
        hi = ExpertSlice(layer, cut, n, full.gate[cut:], full.up[cut:], full.down[cut:])
        return expert_forward(lo, x, ids, w) + expert_forward(hi, x, ids, w)

    return moe


@pytest.mark.parametrize("which", ALL_BACKBONES)
def test_split_moe_gives_identical_greedy_tokens(
    which: str, request: pytest.FixtureRequest
) -> None:
    bb: Backbone = request.getfixturevalue(which)
    moe = _split_moe(bb, bb.meta.expert_count // 2)
    for p in PROMPTS[:3]:
        want = generate(bb, _ids(bb, p), 10, stop_at_eos=False)
        assert generate(bb, _ids(bb, p), 10, moe=moe, stop_at_eos=False) == want


def test_one_moe_call_per_layer_covers_the_batch(backbone: Backbone) -> None:
    calls: list[tuple[int, int]] = []

    def moe(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append((layer, x.shape[0]))
        assert ids.dtype == torch.int64 and w.dtype == torch.float32
        assert ids.shape == w.shape == (x.shape[0], backbone.meta.expert_used_count)
        torch.testing.assert_close(w.sum(-1), torch.ones(x.shape[0]))  # renormalised top-k
        return backbone.local_moe(layer, x, ids, w)

    steps = [SeqStep(_ids(backbone, t), backbone.new_cache()) for t in ("ab", "cde", "f")]
    backbone.forward(steps, moe=moe)
    n = sum(len(s.tokens) for s in steps)
    assert calls == [(layer, n) for layer in range(backbone.meta.block_count)]


def test_router_popularity_is_skewed(backbone: Backbone) -> None:
    counts: Counter[int] = Counter()

    def record(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        counts.update(ids.flatten().tolist())
        return backbone.local_moe(layer, x, ids, w)

    for p in PROMPTS:
        generate(backbone, _ids(backbone, p), 8, moe=record, stop_at_eos=False)
    ranked = sorted(counts.values(), reverse=True)
    top = max(1, backbone.meta.expert_count // 4)
    assert sum(ranked[:top]) > 0.5 * sum(ranked)
    assert len(ranked) == backbone.meta.expert_count  # ...yet every expert gets some work


def test_bfloat16_backbone_runs(tiny_path: Path) -> None:
    bb = Backbone.from_gguf(tiny_path, dtype=torch.bfloat16)
    assert bb.experts[0].compute_dtype == torch.bfloat16
    assert len(generate(bb, _ids(bb, "bf16"), 4, stop_at_eos=False)) == 4


def test_bad_steps_raise_and_leave_caches_alone(backbone: Backbone) -> None:
    cache = backbone.new_cache()
    with pytest.raises(ModelError, match="at least one SeqStep"):
        backbone.forward([])
    with pytest.raises(ModelError, match="no tokens"):
        backbone.forward([SeqStep([], cache)])
    with pytest.raises(ModelError, match=r"\[258\]"):
        backbone.forward([SeqStep([1, 258], cache)])
    with pytest.raises(ModelError, match="share a KVCache"):
        backbone.forward([SeqStep([1], cache), SeqStep([2], cache)])
    with pytest.raises(ModelError, match="context length 512"):
        backbone.forward([SeqStep([1] * 513, cache)])

    def bad_moe(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x[:, :3]

    with pytest.raises(ModelError, match="moe fn returned shape"):
        backbone.forward([SeqStep([1, 2], cache)], moe=bad_moe)
    assert cache.length == 0


def test_kv_cache_grows_without_changing_the_answer(odd_backbone: Backbone) -> None:
    bb, seq = odd_backbone, _ids(odd_backbone, "a cache that starts small and doubles")
    small = KVCache(
        bb.meta.block_count,
        bb.meta.context_length,
        bb.meta.head_count_kv,
        bb.meta.head_dim,
        initial=3,
    )
    bb.forward([SeqStep(seq[:5], small)])  # 3 -> 6
    for t in seq[5:]:
        got = bb.forward([SeqStep([t], small)])[0]
    assert small.capacity < bb.meta.context_length
    assert small.capacity >= len(seq) and small.length == len(seq)
    torch.testing.assert_close(got, _alone(bb, seq), rtol=1e-5, atol=1e-5)
    assert bb.new_cache().capacity == 256  # not the whole 512-position context up front
