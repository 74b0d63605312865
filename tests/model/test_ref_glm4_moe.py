"""The GLM-4.5 references (``ref_glm4_moe.py``) against transformers' ``glm4_moe`` modules.

As in ``test_ref_deepseek.py``: random float64 weights copied into both; HF as shipped to float32
precision (its RMSNorm, router and rotary table compute in float32), and with those float32 casts
lifted to float64 (``hf_lift.as_float64``) to 1e-10.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hf_lift import as_float64, randomize
from ref_deepseek import moe_ffn_ref
from ref_glm4_moe import Glm4MoeAttnConfig, glm4_moe_attention_ref, glm4_moe_route_ref
from transformers.models.glm4_moe import configuration_glm4_moe as cg
from transformers.models.glm4_moe import modeling_glm4_moe as mg

TIGHT, F32 = 1e-10, 2e-5
T, N_TOK = 9, 64


@pytest.fixture
def lift(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    def apply() -> None:
        for cls in (mg.Glm4MoeRMSNorm, mg.Glm4MoeTopkRouter):
            monkeypatch.setattr(cls, "forward", as_float64(cls.forward, vars(mg)))

    return apply


def _config(**kw: Any) -> Any:
    # non-square: hidden 40, 4 heads of 12 (48), 2 kv heads; rotary on 6 of the 12 dims
    args = {
        "hidden_size": 40,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.5,
        },
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 12,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "vocab_size": 50,
        "num_hidden_layers": 1,
        **kw,
    }
    cfg = cg.Glm4MoeConfig(**args)
    cfg._attn_implementation = "sdpa"  # eager's softmax runs in float32
    return cfg


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("offset", [0, 1000])
def test_attention_is_hf(qk_norm: bool, offset: int, lift: Callable[[], None]) -> None:
    hf = _config(use_qk_norm=qk_norm)
    att = mg.Glm4MoeAttention(hf, 0)
    w = randomize(att, seed=1)
    assert "q_proj.bias" in w and ("q_norm" in w) == qk_norm
    cfg = Glm4MoeAttnConfig(
        n_heads=4,
        n_kv_heads=2,
        head_dim=12,
        hidden=40,
        rope_theta=1e6,
        partial_rotary_factor=0.5,
        use_qk_norm=qk_norm,
        rms_eps=hf.rms_norm_eps,
    )
    pos = np.arange(T) + float(offset)
    x = np.random.default_rng(2).standard_normal((T, 40))
    ours = glm4_moe_attention_ref(x, w, cfg, pos)
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():
        rot = mg.Glm4MoeRotaryEmbedding(hf)
        assert rot.inv_freq.shape == (cfg.rotary_dim // 2,)
        shipped = att(xt, rot(xt, torch.from_numpy(pos).long()[None]), None)[0][0].numpy()
        lift()
        rd = cfg.rotary_dim
        freqs = pos[:, None] / 1e6 ** (np.arange(0, rd, 2) / rd)[None, :]
        emb = torch.from_numpy(np.concatenate([freqs, freqs], -1))[None]
        lifted = att(xt, (emb.cos(), emb.sin()), None)[0][0].numpy()
    scale = np.abs(ours).max()
    assert _max_err(ours, lifted) < TIGHT * scale
    assert _max_err(ours, shipped) < F32 * scale


@pytest.mark.parametrize("groups", [(4, 2), (1, 1)])
def test_moe_is_hf(groups: tuple[int, int], lift: Callable[[], None]) -> None:
    """The whole MoE block: GLM's router (V3's rule), routed and shared experts."""
    hf = _config(n_group=groups[0], topk_group=groups[1])
    moe = mg.Glm4MoeMoE(hf)
    w = randomize(moe, seed=3)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 16))
    x = np.random.default_rng(4).standard_normal((N_TOK, 40))
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():
        shipped = moe(xt)[0].numpy()
        lift()
        moe.gate.double()
        lifted = moe(xt)[0].numpy()
        logits, hf_w, hf_ids = moe.gate(xt)
    ids, weights = glm4_moe_route_ref(
        logits.numpy(),
        bias=moe.gate.e_score_correction_bias.double().numpy(),
        n_group=groups[0],
        topk_group=groups[1],
        top_k=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    order = torch.argsort(hf_w, dim=-1, descending=True)
    assert (ids == hf_ids.gather(1, order).numpy()).all()
    assert _max_err(weights, hf_w.gather(1, order).numpy()) < TIGHT
    gate_up, F = w["experts.gate_up_proj"], hf.moe_intermediate_size
    shared = {k: w[f"shared_experts.{k}_proj"] for k in ("gate", "up", "down")}
    ours = moe_ffn_ref(
        x, gate_up[:, :F], gate_up[:, F:], w["experts.down_proj"], ids, weights, shared
    )
    scale = np.abs(ours).max()
    assert _max_err(ours, lifted) < TIGHT * scale
    assert _max_err(ours, shipped) < F32 * scale
