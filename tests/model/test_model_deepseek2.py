"""kvq's deepseek2 against the float64 references of `ref_deepseek.py` (written from the
DeepSeek papers and Hugging Face's config semantics, checked against transformers' own modules,
never from kvq's code): MLA attention through the latent cache, prefill and decode, with and
without YaRN and q's LoRA, and the grouped sigmoid routing with its selection bias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ref_deepseek import MlaConfig, mla_attention_ref, route_ref

from kvq.gguf.reader import numpy_shape, open_reader, tensor_map
from kvq.model import Backbone
from kvq.model.attention import Rows
from kvq.model.layers import Gating, route
from kvq.tools.synth import make_tiny

DIMS = {"layers": 2, "experts": 8, "hidden": 64, "expert_ffn": 32, "heads": 4, "head_dim": 16}


def _file(tmp_path: Path, variant: str, rope: str) -> Path:
    path = tmp_path / f"ds-{variant}-{rope}.gguf"
    make_tiny(
        path,
        arch="deepseek2",
        variant=variant,
        rope_scaling=rope,
        rope_scaling_factor=4.0 if rope == "yarn" else 1.0,
        **DIMS,
    )  # type: ignore[arg-type]
    return path


def _hf_weights(path: Path, layer: int) -> dict[str, np.ndarray]:
    """The layer's attention under Hugging Face's names, kv_b rebuilt from k_b and v_b."""
    t = tensor_map(open_reader(path))

    def get(name: str) -> np.ndarray:
        x = t[f"blk.{layer}.{name}.weight"]
        return np.asarray(x.data, np.float64).reshape(numpy_shape(x))

    w = {
        "kv_a_proj_with_mqa": get("attn_kv_a_mqa"),
        "kv_a_layernorm": get("attn_kv_a_norm"),
        "o_proj": get("attn_output"),
    }
    if f"blk.{layer}.attn_q_a.weight" in t:
        w.update(
            q_a_proj=get("attn_q_a"), q_a_layernorm=get("attn_q_a_norm"), q_b_proj=get("attn_q_b")
        )
    else:
        w["q_proj"] = get("attn_q")
    k_b, v_b = get("attn_k_b"), get("attn_v_b")  # [h, r, nope], [h, v, r]
    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [h, nope + v, r]
    w["kv_b_proj"] = kv_b.reshape(-1, kv_b.shape[-1])
    return w


def _config(bb: Backbone) -> MlaConfig:
    m = bb.meta
    scaling: dict[str, Any] | None = None
    if m.rope_scaling_type == "yarn":
        scaling = {
            "type": "yarn",
            "factor": m.rope_scaling_factor,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": m.rope_original_context_length,
        }
    return MlaConfig(
        n_heads=m.head_count,
        hidden=m.embedding_length,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.head_dim - m.rope_dims,
        qk_rope_head_dim=m.rope_dims,
        v_head_dim=m.value_head_dim,
        rope_theta=m.rope_freq_base,
        rms_eps=m.rms_eps,
        rope_scaling=scaling,
    )


@pytest.mark.parametrize(("variant", "rope"), [("v3", "none"), ("v3", "yarn"), ("v2-lite", "yarn")])
def test_mla_through_the_latent_cache_equals_the_float64_reference(
    tmp_path: Path, variant: str, rope: str
) -> None:
    path = _file(tmp_path, variant, rope)
    bb = Backbone.from_gguf(path, dtype=torch.float64)
    layer, t = 1, 40  # layer 1: the first is dense
    x = torch.randn(
        t, bb.meta.embedding_length, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    want = mla_attention_ref(x.numpy(), _hf_weights(path, layer), _config(bb))  # [T, H]
    pos = torch.arange(t)
    cache = bb.new_cache()
    got = bb.attention(layer, bb.layers[layer], x, Rows([cache], [t], pos))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the cache holds one latent of r + rope values per token, no per-head K or V
    assert cache.k.shape[2:] == (1, bb.meta.kv_lora_rank + bb.meta.rope_dims)
    assert cache.v.numel() == 0
    # decode: the first t - 1 rows as a prefill, then the last row alone against the cache
    cache = bb.new_cache()
    bb.attention(layer, bb.layers[layer], x[:-1], Rows([cache], [t - 1], pos[:-1]))
    cache.advance(t - 1)
    last = bb.attention(layer, bb.layers[layer], x[-1:], Rows([cache], [1], pos[-1:]))
    np.testing.assert_allclose(last.numpy()[0], want[-1], rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(
    ("gating", "groups", "used", "bias", "norm", "scale"),
    [
        ("sigmoid", 4, 2, True, True, 2.5),
        ("sigmoid", 1, 1, True, True, 1.0),
        ("softmax", 1, 1, False, False, 1.0),
        ("sigmoid", 8, 3, True, False, 1.5),
    ],
)
def test_grouped_routing_equals_the_float64_reference(
    gating: str, groups: int, used: int, bias: bool, norm: bool, scale: float
) -> None:
    gen = torch.Generator().manual_seed(3)
    e, h, t, k = 16, 32, 64, 4
    router = torch.randn(e, h, generator=gen) / h**0.5  # [E, H]
    x = torch.randn(t, h, generator=gen)  # [T, H]
    b = torch.randn(e, generator=gen) * 0.3 if bias else None  # negative entries included
    ids, w = route(router, x, Gating(k, gating, norm, scale, groups, used), b)
    logits = x.double().numpy() @ router.double().numpy().T
    want_ids, want_w = route_ref(
        logits,
        gating=gating,
        n_group=groups,
        topk_group=used,
        top_k=k,
        bias=None if b is None else b.double().numpy(),
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    # the same experts with the same weights; kvq (as llama.cpp) lists them by biased score,
    # the reference by weight, so compare each row in expert order
    order, want_order = ids.numpy().argsort(1), want_ids.argsort(1)
    got_ids, got_w = (
        np.take_along_axis(ids.numpy(), order, 1),
        np.take_along_axis(w.numpy(), order, 1),
    )
    np.testing.assert_array_equal(got_ids, np.take_along_axis(want_ids, want_order, 1))
    np.testing.assert_allclose(got_w, np.take_along_axis(want_w, want_order, 1), rtol=1e-5)
    if groups > 1:  # the experts come from at most `used` groups
        assert (np.array([len(set(r)) for r in got_ids // (e // groups)]) <= used).all()
