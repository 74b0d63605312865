"""Slow float64 numpy references for GLM-4.5 (HF ``glm4_moe``, GGUF arch ``glm4moe``).

From Hugging Face's config semantics, checked against transformers' ``glm4_moe`` modules by
``test_ref_glm4_moe.py``; nothing here is read from kvq.

Routing is DeepSeek-V3's (``ref_deepseek.route_ref`` with ``gating="sigmoid"``): sigmoid scores
s, the choice made on ``s + e_score_correction_bias``, groups scored by the sum of their 2 best
biased scores, the ``topk_group`` best groups kept (others -inf), top_k chosen, weights the
unbiased s, normalised (``sum + 1e-20``) when ``norm_topk_prob`` (GLM-4.5: true), times
``routed_scaling_factor``. GLM-4.5's released configs use ``n_group = topk_group = 1``, so the
group step keeps every expert there.

Attention is plain GQA (head_dim ``d``, ``H`` query and ``H_kv`` key/value heads, q/k/v biases when
``attention_bias``), with, in order: optional per-head RMSNorm of q and k (``use_qk_norm``), then a
*partial* rotary embedding on the first ``d_r = int(d * partial_rotary_factor)`` dims of each head
(GLM-4.5: factor 0.5), half-split (NeoX) pairs ``(x[i], x[i + d_r/2])`` for ``i < d_r/2`` with
``inv_freq[i] = theta ** (-2i / d_r)``; the remaining ``d - d_r`` dims pass unrotated. The softmax
scale is ``d ** -0.5``; the output projection has no bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from ref_deepseek import NDArray, rms_norm_ref, rope_ref, route_ref


@dataclass(frozen=True)
class Glm4MoeAttnConfig:
    """The attention part of a GLM-4.5 config (HF field names in the comments)."""

    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int
    hidden: int
    rope_theta: float
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    rms_eps: float = 1e-5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def glm4_moe_route_ref(
    logits: NDArray,
    *,
    bias: NDArray,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[NDArray, NDArray]:
    """GLM-4.5's router: DeepSeek-V3's rule (see the module docstring). logits [T, E].

    Returns ids [T, top_k] int64 (largest weight first) and weights [T, top_k] float64.
    """
    return route_ref(
        logits,
        gating="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        top_k=top_k,
        bias=bias,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor,
        group_score="top2_sum",
    )


def _linear(x: NDArray, w: dict[str, NDArray], name: str) -> NDArray:
    y = x @ w[name].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def glm4_moe_attention_ref(
    x: NDArray, w: dict[str, Any], cfg: Glm4MoeAttnConfig, positions: NDArray | None = None
) -> NDArray:
    """Causal GQA self-attention over T tokens (positions default 0..T-1), all at once.

    x: [T, hidden] (already RMS-normed). w: q_proj [H*d, hidden], k_proj / v_proj [H_kv*d, hidden]
    (each with an optional "<name>.bias"), o_proj [hidden, H*d], and q_norm / k_norm [d] when
    use_qk_norm. The causal order is the row order of x. Returns [T, hidden].
    """
    x = np.asarray(x, np.float64)
    T, H, Hkv, d = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = np.arange(T) if positions is None else np.asarray(positions)
    q = _linear(x, w, "q_proj").reshape(T, H, d)
    k = _linear(x, w, "k_proj").reshape(T, Hkv, d)
    v = _linear(x, w, "v_proj").reshape(T, Hkv, d)
    if cfg.use_qk_norm:
        q, k = rms_norm_ref(q, w["q_norm"], cfg.rms_eps), rms_norm_ref(k, w["k_norm"], cfg.rms_eps)
    rd = cfg.rotary_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd)  # [rd/2]
    q = np.concatenate([rope_ref(q[..., :rd], pos, inv_freq, interleave=False), q[..., rd:]], -1)
    k = np.concatenate([rope_ref(k[..., :rd], pos, inv_freq, interleave=False), k[..., rd:]], -1)
    # [T, H, d]: query head h reads kv head h // (H / H_kv)
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    scores = np.einsum("thd,uhd->htu", q, k) * d**-0.5  # [H, T, T]
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("htu,uhd->thd", p, v)  # [T, H, d]
    return o.reshape(T, H * d) @ w["o_proj"].T
