"""Stateless pieces of the forward pass, following llama.cpp's graph for each architecture."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf.arch import ACT_SILU, ACT_SWIGLU_OAI, arch_spec
from kvq.model.qstack import QMatrix, Weight
from kvq.model.rowwise import pointwise, row_matmul
from kvq.quant import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim (no weight: None)."""
    var = x.pow(2).mean(dim=-1, keepdim=True)  # [..., 1]
    y = x * torch.rsqrt(var + eps)
    return y if weight is None else y * weight


def attn_temperature(pos: torch.Tensor, floor: int, scale: float) -> torch.Tensor:
    """llama4's attention temperature of the NoPE layers' queries at positions pos [T]:
    `1 + scale ln(floor((p + 1) / floor) + 1)` (llama.cpp's offset of 1). Returns [T] f32."""
    steps = torch.floor((pos.to(torch.float32) + 1.0) / floor)  # [T]
    return pointwise(torch.log, (steps + 1.0)[:, None])[:, 0] * scale + 1.0


class Rope:
    """Rotary position embedding as llama.cpp's `ggml_rope_ext` computes it.

    `style` "neox" rotates pairs (i, i + d/2); "norm" rotates adjacent pairs (2i, 2i + 1).
    Scaling "linear" divides positions by `factor`; "yarn" blends interpolated and extrapolated
    frequencies over the dimensions between the correction bounds and scales cos/sin by
    `1 + 0.1 ln(factor)` (or by `mscale` where the arch says otherwise). `head_dim` is the
    number of dimensions rotated: a head wider than that (partial rotary, glm4moe) keeps the
    rest as they are.

    `sections` [t, h, w, e] (IMROPE, qwen35moe): pair j belongs to section t, h or w by
    `j % sum(sections) % 3` within that section's share of the interleave, else to e, as
    ggml's `ggml_mrope_cache_init` assigns them. A text token's position is its position in
    t, h and w and 0 in e (llama.cpp's `llm_graph_input_pos`), so its e pairs stay as they are
    and the others rotate as NEOX rope does.

    `factors` [d/2] (a file's `rope_freqs`, llama3-style scaling): pair i turns at its
    frequency divided by `factors[i]`, as ggml's `freq_factors` do.
    """

    def __init__(
        self,
        head_dim: int,
        base: float,
        style: str,
        scaling: str = "none",
        factor: float = 1.0,
        original_context: int = 0,
        beta: tuple[float, float] = (32.0, 1.0),
        mscale: float | None = None,
        sections: tuple[int, ...] = (),
        factors: torch.Tensor | None = None,
    ) -> None:
        if style not in ("neox", "norm"):
            raise ModelError(f"rope style {style!r} is not 'neox' or 'norm'")
        half = head_dim // 2
        idx = torch.arange(half, dtype=torch.float32)  # [d/2]
        inv_freq = 1.0 / base ** (idx * 2 / head_dim)  # [d/2]
        self.mscale = 1.0
        if scaling == "linear":
            inv_freq = inv_freq / factor
        elif scaling == "yarn" and factor != 1.0:
            low, high = _yarn_bounds(head_dim, base, original_context, beta)
            ramp = ((idx - low) / max(high - low, 0.001)).clamp(0, 1)  # [d/2] 0: extrapolate
            inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
            self.mscale = 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
        if mscale is not None:
            self.mscale = mscale
        if sections:
            inv_freq = inv_freq * _text_pairs(sections, half)
        if factors is not None:
            inv_freq = inv_freq / factors.float().cpu()
        self.inv_freq = inv_freq  # [d/2]
        self.style = style
        self.dims = head_dim
        # cos and sin of positions 0 .. n - 1 ([n, d/2] each, times mscale), grown by doubling:
        # every layer's q and k of a step rotate by the same positions
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_meta(
        cls,
        meta: ModelMeta,
        style: str,
        mscale: float | None = None,
        factors: torch.Tensor | None = None,
    ) -> Rope:
        """The rope of a model, from its metadata (and its `rope_freqs`, if any)."""
        return cls(
            meta.rope_dims,
            meta.rope_freq_base,
            style,
            meta.rope_scaling_type,
            meta.rope_scaling_factor,
            meta.rope_original_context_length or meta.context_length,
            (meta.rope_yarn_beta_fast, meta.rope_yarn_beta_slow),
            mscale,
            meta.rope_sections,
            factors,
        )

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, d]; pos: [T] int64 absolute positions. Returns [T, heads, d]."""
        if x.shape[-1] > self.dims:  # partial rotary: the first `dims` only
            return torch.cat((self._rotate(x[..., : self.dims], pos), x[..., self.dims :]), -1)
        return self._rotate(x, pos)

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (times mscale) of the angles at positions pos [T]: [T, d/2] float32
        each, the rows of a table kept across calls. A row has the bits it gets computed
        alone (`pointwise`; products of exact integer positions round alike), so the table
        gives every position what computing it per call gave."""
        need = int(pos.max()) + 1 if pos.numel() else 0
        table = self._table
        if table is None or table[0].shape[0] < need or table[0].device != pos.device:
            n = max(need, 256, 2 * table[0].shape[0] if table is not None else 0)
            ang = torch.arange(n, device=pos.device).to(torch.float32)[:, None]  # [n, 1]
            ang = ang * self.inv_freq.to(pos.device)[None, :]  # [n, d/2]
            table = (
                pointwise(torch.cos, ang) * self.mscale,
                pointwise(torch.sin, ang) * self.mscale,
            )
            self._table = table
        return table[0][pos], table[1][pos]

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos_t, sin_t = self.cos_sin(pos)  # [T, d/2] each
        cos = cos_t[:, None, :].to(x.dtype)  # [T, 1, d/2]
        sin = sin_t[:, None, :].to(x.dtype)  # [T, 1, d/2]
        if self.style == "neox":
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]  # [T, heads, d/2] each
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, heads, d/2] each
        rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, h, d/2, 2]
        return rot.flatten(-2)


def _text_pairs(sections: tuple[int, ...], half: int) -> torch.Tensor:
    """1 for each of the `half` rope pairs that a text token rotates under IMROPE (its t, h
    or w pairs), 0 for its e pairs (position 0)."""
    t, h, w = sections[0], sections[1], sections[2]
    total = sum(sections)
    keep = []
    for j in range(half):
        sec = j % total
        r = sec % 3
        keep.append(
            (r == 1 and sec < 3 * h) or (r == 2 and sec < 3 * w) or (r == 0 and sec < 3 * t)
        )
    return torch.tensor(keep, dtype=torch.float32)


def _yarn_bounds(
    head_dim: int, base: float, original_context: int, beta: tuple[float, float]
) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pair indices where interpolation starts and ends."""

    def dim(rotations: float) -> float:
        return (
            head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low, high = math.floor(dim(beta[0])), math.ceil(dim(beta[1]))
    return float(max(0, low)), float(min(head_dim - 1, high))


def _fused_prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """A prompt into an empty cache: torch's fused causal attention (flash attention on the
    CPU), which skips the masked half and never makes the [T, S] scores; 1.6x at 512.
    q: [T, heads, d], k and v: [T, kv, d]; returns [T, heads * d]."""
    t, heads, d = q.shape
    return (
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale or 1.0 / math.sqrt(d),
            enable_gqa=k.shape[1] != heads,
        )[0]
        .transpose(0, 1)
        .reshape(t, heads * v.shape[-1])
    )


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    scale: float = 0.0,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    k_start: int = 0,
    chunk: int = 0,
) -> torch.Tensor:
    """Grouped-query causal attention of new queries against a sequence's cached keys.

    q: [T, heads, d] at positions q_start..q_start+T-1; k: [S, kv, d], v: [S, kv, dv] at
    positions k_start..q_start+T-1 (dv may differ from d: MLA's latent values).
    Query head h reads kv head h // (heads / kv), as ggml's broadcasting matmul does: the
    `group` query heads of one kv head are stacked as rows of one matmul against that head's
    keys, so the cache is read in place, never copied per query head. A single new token
    (decode) sees every key it is given, so it needs no mask. `scale` 0 means 1/sqrt(d).
    `window` > 0: a query at p sees only keys at p - window + 1..p (llama.cpp's standard
    sliding window). `chunk` > 0: a query at p sees only keys from `p // chunk * chunk` on
    (llama4's chunked attention, decode steps included). `sinks` [heads]: a logit per head that joins the softmax without a value
    (gpt-oss's attention sinks). Returns [T, heads * dv].
    """
    t, heads, d = q.shape
    dv = v.shape[-1]
    kv = k.shape[1]
    if t > 1 and sinks is None and not window and not chunk and k.shape[0] == t and dv == d:
        return _fused_prompt_attention(q, k, v, scale)
    group = heads // kv
    qg = q.reshape(t, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * t, d)
    scores = (qg @ k.permute(1, 2, 0)) * (scale or 1.0 / math.sqrt(d))  # [kv, group*T, S]
    if t > 1 or chunk > 0:
        qpos = torch.arange(q_start, q_start + t, device=q.device)[:, None]  # [T, 1]
        kpos = torch.arange(k_start, k_start + k.shape[0], device=q.device)[None, :]  # [1, S]
        masked = kpos > qpos  # [T, S]
        if window > 0:
            masked |= qpos - kpos >= window
        if chunk > 0:
            masked |= kpos < qpos // chunk * chunk
        scores = scores.view(kv, group, t, -1).masked_fill(masked, float("-inf"))
        scores = scores.view(kv, group * t, -1)
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:  # one more column per head: its sink's logit, dropped after the softmax
        sink = sinks.float().view(kv, group, 1, 1).expand(kv, group, t, 1).reshape(kv, -1, 1)
        probs = torch.softmax(torch.cat((scores.float(), sink), -1), -1)[..., :-1].to(q.dtype)
    out = probs @ v.transpose(0, 1)  # [kv, group*T, dv]
    return out.view(kv, group, t, dv).permute(2, 0, 1, 3).reshape(t, heads * dv)  # [T, heads*dv]


@dataclass(frozen=True, slots=True)
class Gating:
    """How a layer's router turns logits into experts and weights (from the file's metadata).

    `scores` softmax or sigmoid, or `softmax_weight` (gpt-oss): the top-k logits are chosen
    and softmaxed among themselves. A router bias, where the layer has one, is added to the
    logits first; a `bias` tensor, where the layer has one, is added to the scores for the
    choice only (DeepSeek-V3's `exp_probs_b`); with `groups` > 1 the experts
    form that many equal groups, each scored by the sum of its two best (biased) scores, and
    only the best `groups_used` groups compete; the chosen experts' unbiased scores are the
    weights, renormalised to sum 1 if `norm`, then times `scale`. `on_logits` (llama4): the
    top-k is chosen on the logits themselves (the same order as the sigmoid's, without its
    ties where it saturates)."""

    k: int
    scores: str = "softmax"
    norm: bool = True
    scale: float = 1.0
    groups: int = 1
    groups_used: int = 1
    on_logits: bool = False

    @classmethod
    def from_meta(cls, m: ModelMeta) -> Gating:
        return cls(
            m.expert_used_count,
            m.expert_gating,
            m.expert_weights_norm,
            m.expert_weights_scale,
            m.expert_group_count,
            m.expert_group_used_count,
            arch_spec(m.arch).choose_logits,
        )


# llama.cpp clamps the sum of the chosen weights to the smallest normal f16 before dividing
_MIN_WEIGHT_SUM = 6.103515625e-5


def route(
    router: torch.Tensor,
    x: torch.Tensor,
    gating: Gating,
    bias: torch.Tensor | None = None,
    router_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each row and their weights, as `gating` says.

    router: [E, H]; x: [T, H]; bias: [E] or None (the choice's); router_bias: [E] or None
    (the logits'). Returns ids [T, k] int64 and weights [T, k] float32, largest choice first.
    """
    logits = row_matmul(x.float(), router.float().T)  # [T, E] in f32, as llama.cpp does
    if router_bias is not None:
        logits = logits + router_bias.float()
    if gating.scores == "softmax_weight":
        probs = logits  # softmaxed below, over the chosen ones only
    elif gating.scores == "softmax":
        probs = torch.softmax(logits, -1)
    else:
        probs = pointwise(torch.sigmoid, logits)
    choice = probs if bias is None else probs + bias.float()  # [T, E]
    if gating.on_logits:
        choice = logits
    if gating.groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, gating.groups, e // gating.groups)  # [T, G, E/G]
        best = grouped.topk(min(2, e // gating.groups), dim=-1).values.sum(-1)  # [T, G]
        keep = best.topk(gating.groups_used, dim=-1).indices  # [T, Gu]
        mask = torch.ones_like(best, dtype=torch.bool).scatter_(1, keep, False)  # [T, G]
        choice = grouped.masked_fill(mask[:, :, None], float("-inf")).view(t, e)
    ids = torch.topk(choice, gating.k, dim=-1).indices  # [T, k], largest first
    w = probs.gather(1, ids)  # [T, k]
    if gating.scores == "softmax_weight":
        w = torch.softmax(w, -1)
    if gating.norm:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(_MIN_WEIGHT_SUM)  # [T, k]
    return ids, w * gating.scale if gating.scale != 1.0 else w


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ w.T for a dense or encoded (`QMatrix`) weight, each row's bits those it gets
    alone (`kvq.model.rowwise`). x: [N, in]; w: [out, in]."""
    return w.matmul(x) if isinstance(w, QMatrix) else row_matmul(x, w.T)


def linears(x: torch.Tensor, ws: list[Weight]) -> list[torch.Tensor]:
    """`linear(x, w)` for each w of `ws`, with their bits; one row of x against encoded
    weights in one kernel call (`kernels.matmul_one`: a decode step's q, k and v)."""
    enc = [w for w in ws if isinstance(w, QMatrix) and w.raw.is_contiguous()]
    if len(enc) == len(ws) and kernels.one_covers([w.qtype for w in enc], x):
        return kernels.matmul_one(x, [(w.raw, w.qtype) for w in enc])
    return [linear(x, w) for w in ws]


def swiglu(x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
    """down(silu(gate x) * up x). x: [T, H]; gate, up: [F, H]; down: [H, F]. Returns [T, H]."""
    return linear(gated(linear(x, gate), linear(x, up)), down)


def gated(g: torch.Tensor, u: torch.Tensor, act: str = ACT_SILU) -> torch.Tensor:
    """The gated activation of gate output g and up output u ([T, F] each): silu(g) * u, or
    gpt-oss's `swiglu_oai`. Returns [T, F]."""
    if act == ACT_SWIGLU_OAI:
        return swiglu_oai(g, u)
    return pointwise(F.silu, g) * u


# gpt-oss's clamped SwiGLU (llama.cpp's `ggml_swiglu_oai`, constants of `build_moe_ffn`)
OAI_ALPHA = 1.702
OAI_LIMIT = 7.0


def swiglu_oai(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1).
    g, u: [T, F] (the gate's and up's outputs, biases included). Returns [T, F]."""
    g = g.clamp(max=OAI_LIMIT)
    return g * pointwise(torch.sigmoid, OAI_ALPHA * g) * (u.clamp(-OAI_LIMIT, OAI_LIMIT) + 1)
