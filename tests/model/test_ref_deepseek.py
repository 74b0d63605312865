"""The DeepSeek references (``ref_deepseek.py``) against transformers' own DeepSeek-V3/V2 modules.

Each HF module is built from a small config in float64 with random weights, the same weights are
handed to the reference, and the outputs compared. A few HF steps compute in float32 whatever the
module's dtype (the RMSNorms, the router's logits and scores, V2's complex rope, the rotary
tables), so every check runs twice: HF as shipped, to float32 precision, and HF with exactly
those casts lifted to float64 (``hf_lift.as_float64``: the shipped source with
``torch.float32`` / ``.float()`` rewritten, nothing else), to 1e-10. The attention runs on
"sdpa" (eager's softmax is float32 too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hf_lift import as_float64, randomize
from ref_deepseek import (
    MlaConfig,
    mla_attention_absorbed_ref,
    mla_attention_ref,
    mla_latent_ref,
    moe_ffn_ref,
    rms_norm_ref,
    rope_attention_factor_ref,
    rope_inv_freq_ref,
    rope_ref,
    route_ref,
    softmax_scale_ref,
    yarn_inv_freq_ref,
    yarn_mscale_ref,
)
from transformers import modeling_rope_utils
from transformers.models.deepseek_v2 import configuration_deepseek_v2 as c2
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m2
from transformers.models.deepseek_v3 import configuration_deepseek_v3 as c3
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3

TIGHT = 1e-10  # float64 against float64
F32 = 2e-5  # against HF's float32 steps, relative to the output's scale

# mscale != mscale_all_dim, so the cos/sin factor is not 1; factor 40 and positions past the
# original 64, so YaRN's interpolated and blended dims are all in play
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
PLAIN = {"rope_type": "default", "rope_theta": 10000.0}
# non-square dims everywhere: a transposed matrix fails loudly
DIMS = {
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "n_routed_experts": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 12,
    "n_shared_experts": 2,
    "vocab_size": 50,
    "num_hidden_layers": 1,
    "max_position_embeddings": 64 * 40,
}


@pytest.fixture
def lift(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call to lift HF's float32 steps to float64 for the rest of the test."""

    def apply() -> None:
        for mod, cls in ((m3, m3.DeepseekV3RMSNorm), (m2, m2.DeepseekV2RMSNorm)):
            monkeypatch.setattr(cls, "forward", as_float64(cls.forward, vars(mod)))
        monkeypatch.setattr(m2, "apply_rotary_emb", as_float64(m2.apply_rotary_emb, vars(m2)))
        for mod, cls in ((m3, m3.DeepseekV3TopkRouter), (m2, m2.DeepseekV2TopkRouter)):
            monkeypatch.setattr(cls, "forward", as_float64(cls.forward, vars(mod)))

    return apply


def _mla_cfg(hf: Any) -> MlaConfig:
    rp = dict(hf.rope_parameters)
    return MlaConfig(
        n_heads=hf.num_attention_heads,
        hidden=hf.hidden_size,
        q_lora_rank=hf.q_lora_rank or 0,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        rope_theta=rp["rope_theta"],
        rms_eps=hf.rms_norm_eps,
        rope_scaling=rp if rp["rope_type"] != "default" else None,
        rope_interleave=getattr(hf, "rope_interleave", True),
    )


def _v3_config(rope: dict[str, Any], q_lora_rank: int | None = 20) -> Any:
    cfg = c3.DeepseekV3Config(
        hidden_size=40,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=q_lora_rank,
        rope_parameters=dict(rope),
        **DIMS,
    )
    cfg._attn_implementation = "sdpa"  # eager's softmax runs in float32
    return cfg


def _v2_config(rope: dict[str, Any], **kw: Any) -> Any:
    args = {
        "hidden_size": 48,
        "num_attention_heads": 4,
        "q_lora_rank": None,
        "rope_parameters": dict(rope),
        **DIMS,
        **kw,
    }
    cfg = c2.DeepseekV2Config(**args)
    cfg._attn_implementation = "sdpa"
    return cfg


def _cos_sin64(
    inv_freq: np.ndarray, positions: np.ndarray, factor: float
) -> tuple[torch.Tensor, ...]:
    """V3's position_embeddings (the cat(freqs, freqs) layout) in float64: [1, T, r] each."""
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.from_numpy(np.concatenate([freqs, freqs], -1))[None]
    return emb.cos() * factor, emb.sin() * factor


def _freqs_cis64(cfg: MlaConfig, positions: np.ndarray) -> torch.Tensor:
    """V2's position_embeddings (complex) in complex128, from the reference."""
    freqs = torch.from_numpy(positions[:, None] * rope_inv_freq_ref(cfg)[None, :])[None]
    return torch.polar(torch.ones_like(freqs), freqs) * rope_attention_factor_ref(cfg)


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


# ---------------------------------------------------------------- rope, yarn, norm


@pytest.mark.parametrize("factor", [1.0, 0.5, 4.0, 40.0])
@pytest.mark.parametrize("m", [0.707, 1.0])
def test_yarn_mscale_is_hf(factor: float, m: float) -> None:
    assert yarn_mscale_ref(factor, m) == modeling_rope_utils.yarn_get_mscale(factor, m)


@pytest.mark.parametrize("rope", [YARN, {**YARN, "mscale_all_dim": 0.0}, PLAIN])
def test_scales_are_hf(rope: dict[str, Any]) -> None:
    """The softmax scale and the cos/sin factor are HF's, bit for bit."""
    hf = _v3_config(rope)
    cfg = _mla_cfg(hf)
    assert softmax_scale_ref(cfg) == m3.DeepseekV3Attention(hf, 0).scaling
    assert rope_attention_factor_ref(cfg) == m3.DeepseekV3RotaryEmbedding(hf).attention_scaling


# (8, 100.0, 65536): high clamped to dim - 1; (8, 1e4, 64): low clamped to 0
@pytest.mark.parametrize(
    "dim,base,orig", [(8, 10000.0, 64), (64, 10000.0, 4096), (64, 1e6, 4096), (8, 100.0, 65536)]
)
@pytest.mark.parametrize("factor", [4.0, 40.0])
def test_yarn_inv_freq_is_hf(dim: int, base: float, orig: int, factor: float) -> None:
    """HF computes its table in float32: agreement to float32's precision."""
    rope = {**YARN, "rope_theta": base, "factor": factor, "original_max_position_embeddings": orig}
    hf = c3.DeepseekV3Config(
        **{
            **DIMS,
            "qk_rope_head_dim": dim,
            "rope_parameters": rope,
            "max_position_embeddings": int(orig * factor),
        }
    )
    ours = yarn_inv_freq_ref(dim, base, factor, orig, 32.0, 1.0)
    theirs, _ = modeling_rope_utils._compute_yarn_parameters(hf)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=2e-6, atol=0)
    assert ours[0] == 1.0  # the fastest dim is never interpolated


def test_rope_layouts() -> None:
    """Interleaved rope rotates pairs (2i, 2i+1) in place; HF's V3 form returns the same values
    evens-then-odds; V2's complex form is in place; the half-split form is HF's rotate_half."""
    rng = np.random.default_rng(0)
    cfg = _mla_cfg(_v3_config(YARN))
    pos = np.arange(7) + 100.0
    x = rng.standard_normal((7, 3, 8))
    inv = rope_inv_freq_ref(cfg)
    ours = rope_ref(x, pos, inv, interleave=True, factor=1.3)
    cos, sin = _cos_sin64(inv, pos, 1.3)  # [1, T, r]
    xt = torch.from_numpy(x).transpose(0, 1)[None]  # [1, H, T, r]
    hf_v3, _ = m3.apply_rotary_pos_emb_interleave(xt, xt, cos, sin)
    perm = np.r_[0:8:2, 1:8:2]
    assert _max_err(ours[..., perm], hf_v3[0].transpose(0, 1).numpy()) < TIGHT
    half, _ = m3.apply_rotary_pos_emb(xt, xt, cos, sin)
    ours_half = rope_ref(x, pos, inv, interleave=False, factor=1.3)
    assert _max_err(ours_half, half[0].transpose(0, 1).numpy()) < TIGHT
    # a rotation: norms of each pair kept (times factor**2)
    pair = lambda y: y[..., 0::2] ** 2 + y[..., 1::2] ** 2  # noqa: E731
    np.testing.assert_allclose(pair(ours), 1.3**2 * pair(x), rtol=1e-12)


def test_rms_norm_is_hf(lift: Callable[[], None]) -> None:
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 16)) * 3, 1 + 0.1 * rng.standard_normal(16)
    norm = m3.DeepseekV3RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        shipped = norm(torch.from_numpy(x)).numpy()
        lift()
        lifted = norm(torch.from_numpy(x)).numpy()
    ours = rms_norm_ref(x, w, 1e-6)
    assert _max_err(ours, lifted) < TIGHT
    assert _max_err(ours, shipped) < F32 and _max_err(ours, shipped) > 0  # HF's float32 step


# ---------------------------------------------------------------- attention

T = 9
V3_CASES = {
    "yarn": ({"rope": YARN}, 100),
    "plain": ({"rope": PLAIN}, 0),
    "no-q-lora": ({"rope": YARN, "q_lora_rank": None}, 3),
    "half-split-rope": ({"rope": YARN, "rope_interleave": False}, 50),
}


def _v3_attention(case: str, seed: int = 0) -> tuple[Any, MlaConfig, dict[str, np.ndarray]]:
    kw, _ = V3_CASES[case]
    hf = _v3_config(kw["rope"], kw.get("q_lora_rank", 20))
    hf.rope_interleave = kw.get("rope_interleave", True)
    att = m3.DeepseekV3Attention(hf, 0)
    return att, _mla_cfg(hf), randomize(att, seed)


def _x(hidden: int, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, hidden))


@pytest.mark.parametrize("case", list(V3_CASES))
def test_mla_is_hf_v3(case: str, lift: Callable[[], None]) -> None:
    att, cfg, w = _v3_attention(case)
    pos = np.arange(T) + float(V3_CASES[case][1])
    x = _x(cfg.hidden)
    ours = mla_attention_ref(x, w, cfg, pos)
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():  # as shipped: HF's own float32 rotary table and norms
        rot = m3.DeepseekV3RotaryEmbedding(att.config)
        shipped = att(xt, rot(xt, torch.from_numpy(pos).long()[None]), None)[0][0].numpy()
        lift()
        inv, a = rope_inv_freq_ref(cfg), rope_attention_factor_ref(cfg)
        lifted = att(xt, _cos_sin64(inv, pos, a), None)[0][0].numpy()
    scale = np.abs(ours).max()
    assert _max_err(ours, lifted) < TIGHT * scale
    assert _max_err(ours, shipped) < F32 * scale


@pytest.mark.parametrize("rope,offset", [(YARN, 100), (PLAIN, 0)])
def test_mla_is_hf_v2_lite(rope: dict[str, Any], offset: int, lift: Callable[[], None]) -> None:
    """V2-Lite's form: no q LoRA, V2's complex (in-place interleaved) rope."""
    hf = _v2_config(rope)
    att = m2.DeepseekV2Attention(hf, 0)
    cfg, w = _mla_cfg(hf), randomize(att, 1)
    assert cfg.q_lora_rank == 0 and "q_proj" in w
    pos = np.arange(T) + float(offset)
    x = _x(cfg.hidden)
    ours = mla_attention_ref(x, w, cfg, pos)
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():
        rot = m2.DeepseekV2RotaryEmbedding(hf)
        shipped = att(xt, None, position_embeddings=rot(xt, torch.from_numpy(pos).long()[None]))
        lift()
        freqs = torch.from_numpy(pos[:, None] * rope_inv_freq_ref(cfg)[None, :])[None]
        cis = torch.polar(torch.ones_like(freqs), freqs) * rope_attention_factor_ref(cfg)
        lifted = att(xt, None, position_embeddings=cis)[0][0].numpy()
    scale = np.abs(ours).max()
    assert _max_err(ours, lifted) < TIGHT * scale
    assert _max_err(ours, shipped[0][0].numpy()) < F32 * scale


@pytest.mark.parametrize("case", list(V3_CASES))
def test_absorbed_mla_is_mla(case: str) -> None:
    """The latent-cache form computes the same attention."""
    _, cfg, w = _v3_attention(case, seed=2)
    pos = np.arange(T) + float(V3_CASES[case][1])
    x = _x(cfg.hidden, seed=6)
    naive = mla_attention_ref(x, w, cfg, pos)
    assert _max_err(mla_attention_absorbed_ref(x, w, cfg, pos), naive) < 1e-12 * np.abs(naive).max()


def test_latent_cache_is_hf_cache(lift: Callable[[], None]) -> None:
    """HF's cache holds c_kv and k_pe as ours (k_pe evens-then-odds); a cached decode step
    after a prefill gives the last row of the all-at-once reference."""
    from transformers import DynamicCache

    att, cfg, w = _v3_attention("yarn", seed=3)
    lift()
    pos = np.arange(T) + 100.0
    x = _x(cfg.hidden, seed=7)
    inv, a = rope_inv_freq_ref(cfg), rope_attention_factor_ref(cfg)
    cache = DynamicCache(config=att.config)
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():
        att(xt[:, :-1], _cos_sin64(inv, pos[:-1], a), None, cache=cache)
        step = att(xt[:, -1:], _cos_sin64(inv, pos[-1:], a), None, cache=cache)[0][0, 0].numpy()
    ours = mla_attention_ref(x, w, cfg, pos)
    assert _max_err(ours[-1], step) < TIGHT * np.abs(ours).max()
    c_kv, k_pe = mla_latent_ref(x, w, cfg, pos)  # the cache after the step: all T tokens
    layer = cache.layers[0]
    assert _max_err(c_kv, layer.keys[0, 0].numpy()) < TIGHT
    assert _max_err(k_pe[:, np.r_[0:8:2, 1:8:2]], layer.values[0, 0].numpy()) < TIGHT


# ---------------------------------------------------------------- routing and experts

N_TOK = 64


def _by_weight(ids: torch.Tensor, weights: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """HF's top-k (unsorted) ordered as ours: largest weight first."""
    order = torch.argsort(weights, dim=-1, descending=True, stable=True)
    return ids.gather(1, order).numpy(), weights.gather(1, order).double().numpy()


def _v3_router(hf: Any, seed: int, bias_shift: float = 0.0) -> Any:
    gate = m3.DeepseekV3TopkRouter(hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        gate.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=g) + bias_shift)
    return gate


V3_ROUTES = {
    "norm": {"norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "no-norm": {"norm_topk_prob": False, "routed_scaling_factor": 1.0},
    "one-group": {
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
}


def _route_v3(gate: Any, logits: torch.Tensor, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    return route_ref(
        logits.double().numpy(),
        gating="sigmoid",
        n_group=gate.num_group,
        topk_group=gate.topk_group,
        top_k=gate.top_k,
        bias=gate.e_score_correction_bias.double().numpy(),
        norm_topk_prob=gate.norm_topk_prob,
        routed_scaling_factor=gate.routed_scaling_factor,
        **kw,
    )


@pytest.mark.parametrize("case", list(V3_ROUTES))
def test_route_is_hf_v3(case: str, lift: Callable[[], None]) -> None:
    hf = c3.DeepseekV3Config(**{**DIMS, "hidden_size": 40, **V3_ROUTES[case]})
    gate = _v3_router(hf, seed=11)
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((N_TOK, 40)))
    with torch.no_grad():
        logits, weights, ids = gate(x)  # as shipped: float32 logits, scores and weights
        ours_ids, ours_w = _route_v3(gate, logits)
        hf_ids, hf_w = _by_weight(ids, weights)
        assert (ours_ids == hf_ids).all()
        np.testing.assert_allclose(ours_w, hf_w, rtol=1e-6)
        lift()
        gate.double()
        logits, weights, ids = gate(x)
    assert logits.dtype == torch.float64
    ours_ids, ours_w = _route_v3(gate, logits)
    hf_ids, hf_w = _by_weight(ids, weights)
    assert (ours_ids == hf_ids).all() and _max_err(ours_w, hf_w) < TIGHT


def test_route_masked_groups_are_minus_inf_in_hf_v3() -> None:
    """With a bias that makes every biased score negative, HF (-inf masking) still chooses only
    from the kept groups; masking with 0.0 (HF's V2, older HF V3) would choose dropped ones."""
    hf = c3.DeepseekV3Config(**{**DIMS, "hidden_size": 40})
    gate = _v3_router(hf, seed=12, bias_shift=-2.0)
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((N_TOK, 40)))
    with torch.no_grad():
        logits, weights, ids = gate(x)
    ours_ids, _ = _route_v3(gate, logits)
    zero_ids, _ = _route_v3(gate, logits, masked_score=0.0)
    assert (ours_ids == _by_weight(ids, weights)[0]).all()
    assert (zero_ids != ours_ids).any()


def _v2_router(hf: Any, seed: int) -> Any:
    gate = m2.DeepseekV2TopkRouter(hf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
    return gate


@pytest.mark.parametrize("method", ["group_limited_greedy", "greedy"])
def test_route_is_hf_v2(method: str, lift: Callable[[], None]) -> None:
    """V2's router: softmax, groups scored by their best expert, no normalisation (HF's V2
    router ignores norm_topk_prob), scaled; "greedy" is one group."""
    hf = _v2_config(PLAIN, topk_method=method, routed_scaling_factor=16.0)
    gate = _v2_router(hf, seed=13)
    x = torch.from_numpy(np.random.default_rng(10).standard_normal((N_TOK, 48)))
    groups = (4, 2) if method == "group_limited_greedy" else (1, 1)

    def ours(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return route_ref(
            logits.double().numpy(),
            gating="softmax",
            n_group=groups[0],
            topk_group=groups[1],
            top_k=4,
            bias=None,
            norm_topk_prob=False,
            routed_scaling_factor=16.0,
            group_score="max",
        )

    with torch.no_grad():
        logits, weights, ids = gate(x)
        ours_ids, ours_w = ours(logits)
        hf_ids, hf_w = _by_weight(ids, weights)
        assert (ours_ids == hf_ids).all()
        np.testing.assert_allclose(ours_w, hf_w, rtol=1e-6)
        lift()
        gate.double()
        logits, weights, ids = gate(x)
    ours_ids, ours_w = ours(logits)
    hf_ids, hf_w = _by_weight(ids, weights)
    assert (ours_ids == hf_ids).all() and _max_err(ours_w, hf_w) < TIGHT


def test_route_group_scores_by_hand() -> None:
    """Group A = experts {0, 1} with biased scores (0.9, 0.1), group B = {2, 3} with (0.6, 0.6):
    V3's top2_sum keeps B (1.2 > 1.0), V2's max keeps A. Weights come from the unbiased
    scores (all 0.5 here), normalised with HF's 1e-20 and then scaled."""
    logits = np.zeros((1, 8))  # sigmoid 0.5 everywhere
    bias = np.array([0.4, -0.4, 0.1, 0.1, -0.45, -0.45, -0.45, -0.45])
    kw = {
        "gating": "sigmoid",
        "n_group": 4,
        "topk_group": 1,
        "top_k": 2,
        "bias": bias,
        "norm_topk_prob": True,
        "routed_scaling_factor": 3.0,
    }
    ids, w = route_ref(logits, **kw)  # type: ignore[arg-type]
    assert sorted(ids[0].tolist()) == [2, 3]
    np.testing.assert_array_equal(w, [[1.5 / (1 + 1e-20), 1.5 / (1 + 1e-20)]])
    ids, _ = route_ref(logits, **{**kw, "group_score": "max"})  # type: ignore[arg-type]
    assert sorted(ids[0].tolist()) == [0, 1]


def _moe_weights(moe: Any, w: dict[str, np.ndarray]) -> dict[str, Any]:
    F = moe.experts.intermediate_dim
    gate_up = w["experts.gate_up_proj"]  # [E, 2F, hidden]: gate rows, then up rows
    shared = {k: w[f"shared_experts.{k}_proj"] for k in ("gate", "up", "down")}
    return {
        "experts_gate": gate_up[:, :F],
        "experts_up": gate_up[:, F:],
        "experts_down": w["experts.down_proj"],
        "shared": shared,
    }


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_moe_is_hf(version: str, lift: Callable[[], None]) -> None:
    """The whole MoE block (router, routed experts, shared experts) with ours routing."""
    if version == "v3":
        hf = c3.DeepseekV3Config(**{**DIMS, "hidden_size": 40, "routed_scaling_factor": 2.5})
        moe = m3.DeepseekV3MoE(hf)
    else:
        hf = _v2_config(PLAIN, topk_method="group_limited_greedy", routed_scaling_factor=16.0)
        moe = m2.DeepseekV2Moe(hf)
    w = randomize(moe, seed=14)
    if version == "v3":
        with torch.no_grad():
            moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 16))
    x = np.random.default_rng(11).standard_normal((N_TOK, hf.hidden_size))
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():
        shipped = moe(xt)[0].numpy()
        lift()
        moe.gate.double()
        lifted = moe(xt)[0].numpy()
        logits = moe.gate(xt)[0]
    if version == "v3":
        ids, weights = _route_v3(moe.gate, logits)
    else:
        ids, weights = route_ref(
            logits.numpy(),
            gating="softmax",
            n_group=4,
            topk_group=2,
            top_k=4,
            bias=None,
            norm_topk_prob=False,
            routed_scaling_factor=16.0,
            group_score="max",
        )
    ours = moe_ffn_ref(x, ids=ids, weights=weights, **_moe_weights(moe, w))
    scale = np.abs(ours).max()
    assert _max_err(ours, lifted) < TIGHT * scale
    assert _max_err(ours, shipped) < F32 * scale
