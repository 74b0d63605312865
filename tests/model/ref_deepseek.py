"""Slow float64 numpy references for DeepSeek-V2/V3 (GGUF arch ``deepseek2``).

Written from the DeepSeek-V2 paper (arXiv 2405.04434, section 2.1, MLA), the DeepSeek-V3 paper
(arXiv 2412.19437, section 2.1.2, auxiliary-loss-free routing) and Hugging Face's config
semantics; checked against transformers' own ``deepseek_v3`` / ``deepseek_v2`` modules by
``test_ref_deepseek.py``. Nothing here is read from kvq: these are what kvq is checked against.
Every array is float64 (ids int64); weights use Hugging Face names and shapes ``[out, in]``.

Notation: ``T`` tokens, ``H`` heads, ``n = qk_nope_head_dim``, ``r = qk_rope_head_dim``,
``d_v = v_head_dim``, ``c = kv_lora_rank``, ``q_head_dim = n + r``.

Multi-head latent attention (per token t, head h)::

    q_t      = W_qb RMSNorm(W_qa x_t)          (or W_q x_t when q_lora_rank == 0)   [H, n + r]
    q_nope, q_pe = q_t[:, :n], q_t[:, n:]
    [c_kv; k_pe] = W_kva x_t                    c_kv: [c],  k_pe: [r] (one head, shared)
    c_kv     = RMSNorm(c_kv)
    [k_nope; v] = W_kvb c_kv                    [H, n + d_v]
    q_pe, k_pe  = RoPE(q_pe, pos_t), RoPE(k_pe, pos_t)
    s_{t,u}  = scale * (q_nope . k_nope_u + q_pe . k_pe_u),  u <= t (causal)
    o_t      = W_o concat_h( sum_u softmax_u(s_{t,u}) v_u )

Absorbed form (what a latent KV cache computes; the cache holds only c_kv [T, c] and the roped
k_pe [T, r]). With ``W_kvb`` viewed as [H, n + d_v, c], ``W_uk = W_kvb[:, :n]`` [H, n, c] and
``W_uv = W_kvb[:, n:]`` [H, d_v, c]: ``q_nope . k_nope_u = (W_uk^T q_nope) . c_kv_u``, and
``sum_u p_u v_u = W_uv (sum_u p_u c_kv_u)``.

Softmax scale::

    scale = q_head_dim ** -0.5                                     (no rope_scaling)
    scale = q_head_dim ** -0.5 * yarn_mscale(factor, mscale_all_dim) ** 2   (yarn, mscale_all_dim
                                                                     set and nonzero)
    yarn_mscale(s, m) = 0.1 * m * ln(s) + 1   if s > 1 else 1

RoPE cos/sin (YaRN): ``cos = cos(pos * inv_freq) * a``, ``sin = sin(pos * inv_freq) * a`` with the
attention factor ``a = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` (HF,
when both are set and nonzero; else ``a = yarn_mscale(factor, 1)``; ``a = 1`` without yarn). For
DeepSeek-V2/V3's released configs mscale == mscale_all_dim, so a == 1 and all the YaRN
magnitude correction sits in the softmax scale (applied to the nope part too). ``a`` multiplies
both q_pe and k_pe, so the rope part of a score carries ``a ** 2``.

RoPE pairing. Interleaved (DeepSeek's, ``rope_interleave=True``): the pairs are
``(x[2i], x[2i+1])`` for ``i < r/2``, rotated by ``theta_i = pos * inv_freq[i]``::

    y[2i]   = x[2i] cos(theta_i) - x[2i+1] sin(theta_i)
    y[2i+1] = x[2i] sin(theta_i) + x[2i+1] cos(theta_i)

This is llama.cpp's ``LLAMA_ROPE_TYPE_NORM``. HF's ``apply_rotary_pos_emb_interleave`` first
permutes x to ``[x[0], x[2], ..., x[1], x[3], ...]`` and then applies the half-split rotation, so
its output is ``y`` in that permuted order; q.k is unchanged (q and k share the permutation), the
stored k_pe layout is not. ``rope_interleave=False`` is the half-split (NeoX) pairing
``(x[i], x[i + r/2])``. ``rope_ref`` returns y in place order (not HF's permuted order).

YaRN inverse frequencies (``dim = r``, ``f = factor``, ``L = original_max_position_embeddings``)::

    inv_freq_extra[i] = base ** (-2i / dim),  inv_freq_inter[i] = inv_freq_extra[i] / f
    corr(b)  = dim * ln(L / (2 pi b)) / (2 ln base)
    low  = max(floor(corr(beta_fast)), 0),  high = min(ceil(corr(beta_slow)), dim - 1)
    ramp[i]  = clip((i - low) / (high - low), 0, 1)          (high += 0.001 when low == high)
    inv_freq = inv_freq_inter * ramp + inv_freq_extra * (1 - ramp)

Routing: see ``route_ref``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

NDArray = np.ndarray[Any, Any]

NORM_EPS = 1e-20  # added to the sum of the chosen weights before normalising (HF and DeepSeek)


@dataclass(frozen=True)
class MlaConfig:
    """The attention part of a DeepSeek-V2/V3 config (HF field names)."""

    n_heads: int
    hidden: int
    q_lora_rank: int  # 0 = no q LoRA (DeepSeek-V2-Lite): q_proj directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rms_eps: float
    rope_scaling: dict[str, Any] | None  # HF form, "type"/"rope_type": "yarn"
    rope_interleave: bool = True

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# ---------------------------------------------------------------- norms, rope, yarn


def rms_norm_ref(x: NDArray, w: NDArray, eps: float) -> NDArray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * w``. x: [..., d], w: [d]."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def yarn_mscale_ref(scale: float, mscale: float) -> float:
    """YaRN's magnitude factor: ``0.1 * mscale * ln(scale) + 1`` for scale > 1, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq_ref(
    dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
) -> NDArray:
    """YaRN's blended inverse frequencies for a rope of ``dim`` dims. Returns [dim // 2]."""

    def corr(n_rot: float) -> float:  # the dim index whose wavelength makes n_rot turns in L
        return (
            dim
            * math.log(original_max_position_embeddings / (n_rot * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    extra = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [dim/2]
    inter = extra / factor
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inter * ramp + extra * (1.0 - ramp)  # ramp 0: high-frequency dims kept


def _yarn(cfg: MlaConfig) -> dict[str, Any] | None:
    rs = cfg.rope_scaling
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r}: only 'yarn' (or None) is referenced here")
    return rs


def rope_inv_freq_ref(cfg: MlaConfig) -> NDArray:
    """The rope's inverse frequencies for ``cfg`` (plain or YaRN). Returns [r // 2]."""
    r, rs = cfg.qk_rope_head_dim, _yarn(cfg)
    if rs is None:
        return 1.0 / cfg.rope_theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
    return yarn_inv_freq_ref(
        r,
        cfg.rope_theta,
        float(rs["factor"]),
        int(rs["original_max_position_embeddings"]),
        float(rs.get("beta_fast") or 32),
        float(rs.get("beta_slow") or 1),
    )


def rope_attention_factor_ref(cfg: MlaConfig) -> float:
    """The factor on cos and sin (HF's ``attention_factor``); 1 without YaRN."""
    rs = _yarn(cfg)
    if rs is None:
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor, m, m_all = float(rs["factor"]), rs.get("mscale"), rs.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale_ref(factor, float(m)) / yarn_mscale_ref(factor, float(m_all))
    return yarn_mscale_ref(factor, 1.0)


def softmax_scale_ref(cfg: MlaConfig) -> float:
    """The factor on q.k before the softmax (see the module docstring)."""
    scale = cfg.q_head_dim**-0.5
    rs = _yarn(cfg)
    if rs is not None and rs.get("mscale_all_dim"):
        m = yarn_mscale_ref(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale *= m * m
    return scale


def rope_ref(
    x: NDArray, positions: NDArray, inv_freq: NDArray, *, interleave: bool, factor: float = 1.0
) -> NDArray:
    """Rotate the last axis of x. x: [T, ..., r], positions: [T], inv_freq: [r/2].

    Interleaved: pairs (2i, 2i+1); else pairs (i, i + r/2). cos and sin are multiplied by
    ``factor`` (the YaRN attention factor). The output keeps x's element order.
    """
    x = np.asarray(x, dtype=np.float64)
    theta = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]  # [T, r/2]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (theta.shape[1],)
    cos, sin = (factor * np.cos(theta)).reshape(shape), (factor * np.sin(theta)).reshape(shape)
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    ya, yb = a * cos - b * sin, a * sin + b * cos
    y = np.empty_like(x)
    if interleave:
        y[..., 0::2], y[..., 1::2] = ya, yb
    else:
        y[..., :half], y[..., half:] = ya, yb
    return y


# ---------------------------------------------------------------- multi-head latent attention


def _positions(T: int, positions: NDArray | None) -> NDArray:
    return np.arange(T, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)


def mla_query_ref(x: NDArray, w: dict[str, NDArray], cfg: MlaConfig, positions: NDArray) -> NDArray:
    """The queries, rope part roped. x: [T, hidden]. Returns [T, H, n + r]."""
    x = np.asarray(x, np.float64)
    if cfg.q_lora_rank:
        c_q = rms_norm_ref(x @ w["q_a_proj"].T, w["q_a_layernorm"], cfg.rms_eps)  # [T, q_lora]
        q = c_q @ w["q_b_proj"].T
    else:
        q = x @ w["q_proj"].T
    q = q.reshape(x.shape[0], cfg.n_heads, cfg.q_head_dim)  # [T, H, n + r]
    n = cfg.qk_nope_head_dim
    q_pe = rope_ref(
        q[..., n:],
        positions,
        rope_inv_freq_ref(cfg),
        interleave=cfg.rope_interleave,
        factor=rope_attention_factor_ref(cfg),
    )
    return np.concatenate([q[..., :n], q_pe], axis=-1)


def mla_latent_ref(
    x: NDArray, w: dict[str, NDArray], cfg: MlaConfig, positions: NDArray | None = None
) -> tuple[NDArray, NDArray]:
    """What a latent KV cache stores per token: the normed ``c_kv`` [T, c] and the roped,
    single-head ``k_pe`` [T, r] (rope pairs in place order, see the module docstring)."""
    x = np.asarray(x, np.float64)
    pos = _positions(x.shape[0], positions)
    kv_a = x @ w["kv_a_proj_with_mqa"].T  # [T, c + r]
    c = cfg.kv_lora_rank
    c_kv = rms_norm_ref(kv_a[:, :c], w["kv_a_layernorm"], cfg.rms_eps)
    k_pe = rope_ref(
        kv_a[:, c:],
        pos,
        rope_inv_freq_ref(cfg),
        interleave=cfg.rope_interleave,
        factor=rope_attention_factor_ref(cfg),
    )
    return c_kv, k_pe


def _causal_softmax(scores: NDArray) -> NDArray:
    """Softmax over the last axis of scores [H, T, T], token t seeing tokens u <= t."""
    T = scores.shape[-1]
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    return p / p.sum(axis=-1, keepdims=True)


def mla_attention_ref(
    x: NDArray, w: dict[str, NDArray], cfg: MlaConfig, positions: NDArray | None = None
) -> NDArray:
    """Causal MLA self-attention over T tokens (positions default 0..T-1), all at once.

    x: [T, hidden] (already RMS-normed input of the attention block).
    w: dict with q_a_proj [q_lora, hidden], q_a_layernorm [q_lora], q_b_proj [H*(n+r), q_lora]
       (or q_proj [H*(n+r), hidden] when q_lora_rank == 0), kv_a_proj_with_mqa [c+r, hidden],
       kv_a_layernorm [c], kv_b_proj [H*(n+d_v), c], o_proj [hidden, H*d_v].
    The causal order is the row order of x; positions [T] only feed the rope.
    Returns [T, hidden].
    """
    x = np.asarray(x, np.float64)
    T, H, n = x.shape[0], cfg.n_heads, cfg.qk_nope_head_dim
    pos = _positions(T, positions)
    q = mla_query_ref(x, w, cfg, pos)  # [T, H, n + r]
    c_kv, k_pe = mla_latent_ref(x, w, cfg, pos)  # [T, c], [T, r]
    kv = (c_kv @ w["kv_b_proj"].T).reshape(T, H, n + cfg.v_head_dim)  # [T, H, n + d_v]
    k_nope, v = kv[..., :n], kv[..., n:]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None, :], (T, H, k_pe.shape[1]))], -1)
    scores = np.einsum("thd,uhd->htu", q, k) * softmax_scale_ref(cfg)  # [H, T, T]
    o = np.einsum("htu,uhd->thd", _causal_softmax(scores), v)  # [T, H, d_v]
    return o.reshape(T, H * cfg.v_head_dim) @ w["o_proj"].T


def mla_attention_absorbed_ref(
    x: NDArray, w: dict[str, NDArray], cfg: MlaConfig, positions: NDArray | None = None
) -> NDArray:
    """``mla_attention_ref`` computed over the latent cache only (same arguments and result).

    kv_b's k part is absorbed into the query (q_lat = W_uk^T q_nope, [T, H, c]) and its v part
    applied after the attention over c_kv; no per-head key or value is ever formed.
    """
    x = np.asarray(x, np.float64)
    T, H, n, c = x.shape[0], cfg.n_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    pos = _positions(T, positions)
    q = mla_query_ref(x, w, cfg, pos)  # [T, H, n + r]
    c_kv, k_pe = mla_latent_ref(x, w, cfg, pos)  # the whole cache: [T, c], [T, r]
    kv_b = np.asarray(w["kv_b_proj"], np.float64).reshape(H, n + cfg.v_head_dim, c)
    w_uk, w_uv = kv_b[:, :n], kv_b[:, n:]  # [H, n, c], [H, d_v, c]
    q_lat = np.einsum("thn,hnc->thc", q[..., :n], w_uk)  # [T, H, c]
    scores = np.einsum("thc,uc->htu", q_lat, c_kv) + np.einsum("thr,ur->htu", q[..., n:], k_pe)
    p = _causal_softmax(scores * softmax_scale_ref(cfg))  # [H, T, T]
    o_lat = np.einsum("htu,uc->thc", p, c_kv)  # [T, H, c]
    o = np.einsum("thc,hvc->thv", o_lat, w_uv)  # [T, H, d_v]
    return o.reshape(T, H * cfg.v_head_dim) @ w["o_proj"].T


# ---------------------------------------------------------------- routing and experts


def _top(values: NDArray, k: int) -> NDArray:
    """Indices of the k largest along the last axis, largest first (ties: lower index first)."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def route_ref(
    logits: NDArray,
    *,
    gating: str,
    n_group: int,
    topk_group: int,
    top_k: int,
    bias: NDArray | None,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    group_score: str = "top2_sum",
    masked_score: float = -math.inf,
) -> tuple[NDArray, NDArray]:
    """DeepSeek routing of T tokens over E experts. logits: [T, E] (router output).

    gating: "sigmoid" (V3) or "softmax" (V2) turns logits into scores s. bias (V3's
    e_score_correction_bias, [E]) is added for the choice only: b = s + bias. Group-limited:
    the experts split into n_group equal contiguous groups; each group is scored ("top2_sum":
    the sum of its 2 best b, as V3; "max": its best b, as V2's group_limited_greedy); the
    topk_group best groups are kept and every other expert's b is set to ``masked_score``
    (-inf, as transformers 5's DeepSeek-V3; its V2 and older V3 code, and DeepSeek's hub code,
    use 0.0, which differs only when a kept b is below 0, i.e. with a negative bias); top_k
    experts are chosen by b. Weights w = s of the chosen (unbiased); if norm_topk_prob,
    w /= sum(w) + 1e-20; then
    w *= routed_scaling_factor. Returns ids [T, top_k] int64 (largest weight first) and
    weights [T, top_k] float64.
    """
    logits = np.asarray(logits, np.float64)
    T, E = logits.shape
    if gating == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    elif gating == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = e / e.sum(axis=-1, keepdims=True)
    else:
        raise ValueError(f"gating {gating!r}: use 'sigmoid' or 'softmax'")
    choice = scores if bias is None else scores + np.asarray(bias, np.float64)[None, :]
    if E % n_group:
        raise ValueError(f"{E} experts do not split into n_group={n_group} equal groups")
    grouped = choice.reshape(T, n_group, E // n_group)  # [T, G, E/G]
    if group_score == "top2_sum":
        g_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [T, G]
    elif group_score == "max":
        g_scores = grouped.max(axis=-1)
    else:
        raise ValueError(f"group_score {group_score!r}: use 'top2_sum' or 'max'")
    keep = np.zeros((T, n_group), dtype=bool)
    np.put_along_axis(keep, _top(g_scores, topk_group), True, axis=-1)
    choice = np.where(np.repeat(keep, E // n_group, axis=-1), choice, masked_score)  # [T, E]
    ids = _top(choice, top_k)  # [T, k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + NORM_EPS)
    weights = weights * routed_scaling_factor
    order = np.argsort(-weights, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1).astype(np.int64), np.take_along_axis(
        weights, order, -1
    )


def _silu(x: NDArray) -> NDArray:
    return x / (1.0 + np.exp(-x))


def swiglu_ref(x: NDArray, gate: NDArray, up: NDArray, down: NDArray) -> NDArray:
    """SwiGLU: ``(silu(x @ gate.T) * (x @ up.T)) @ down.T``.

    x: [T, hidden], gate/up [F, hidden], down [hidden, F]. Returns [T, hidden].
    """
    x = np.asarray(x, np.float64)
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe_ffn_ref(
    x: NDArray,
    experts_gate: NDArray,
    experts_up: NDArray,
    experts_down: NDArray,
    ids: NDArray,
    weights: NDArray,
    shared: dict[str, NDArray] | None = None,
) -> NDArray:
    """Routed SwiGLU experts weighted by the router's weights, plus the shared experts.

    x: [T, hidden]; experts_gate/up [E, F, hidden], experts_down [E, hidden, F]; ids, weights
    [T, k] (from ``route_ref``); shared: {"gate" [Fs, hidden], "up" [Fs, hidden], "down"
    [hidden, Fs]} (all shared experts as one wide SwiGLU), summed in, not gated.
    Returns [T, hidden].
    """
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], weights[t], strict=True):
            out[t] += (
                wt * swiglu_ref(x[t : t + 1], experts_gate[e], experts_up[e], experts_down[e])[0]
            )
    if shared is not None:
        out += swiglu_ref(x, shared["gate"], shared["up"], shared["down"])
    return out
