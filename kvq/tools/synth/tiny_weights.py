"""Random weights of a tiny model, named and laid out as llama.cpp's converter writes them.

The weights are random but shaped so that generation is numerically sane and the router is
skewed: every token embedding shares a common direction `u`, and router row e gets
`bias[e] * u` with Zipf-like `bias`, so a few experts win most tokens, as in real MoE models.
For arch `llama` the rows of Q and K are permuted exactly as `convert_hf_to_gguf.py` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvq.errors import ModelError
from kvq.gguf.arch import (
    MLA,
    QK_FULL,
    QK_HEAD,
    QK_NONE,
    SHARED_GATED,
    SHARED_NONE,
    ArchSpec,
    permute_qk,
)
from kvq.text.tokenizer import N_BYTES

_SHARED_DIR = 3.0  # weight of the shared embedding direction (drives router skew)
_ROUTER_SKEW = 1.5  # router bias of the most popular expert, in logits per unit of u.x

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class TinyConfig:
    """Dimensions of a tiny model (see `make_tiny`)."""

    layers: int
    experts: int
    experts_used: int
    hidden: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    shared_expert_ffn: int = 0  # qwen2moe only; 0: 2 * expert_ffn
    vocab: int = N_BYTES + 2  # the byte tokenizer's; tokenizer="bpe" sets or pads its own
    # the parts of the newer families (`kvq.gguf.arch`); the defaults leave the others as
    # they were
    dense_layers: int = 0  # leading dense FFN layers (deepseek2, glm4moe)
    dense_ffn: int = 0  # their FFN width; 0: 2 * expert_ffn
    shared_count: int = 0  # plain shared experts (deepseek2, glm4moe), each expert_ffn wide
    expert_groups: int = 1  # group-limited routing (deepseek2)
    groups_used: int = 1
    gating: str = ""  # "softmax" | "sigmoid"; "": the arch's default, not written
    probs_bias: bool = False  # exp_probs_b: a selection bias per expert (sigmoid routers)
    weights_norm: bool | None = None  # expert_weights_norm; None: not written
    weights_scale: float = 0.0  # expert_weights_scale; 0: not written
    rope_dim: int = 0  # dimensions rope rotates; 0: the head size (MLA: its rope part)
    head_norms: bool = False  # per-head attn_{q,k}_norm on an arch where they are optional
    q_lora_rank: int = 0  # MLA: q's LoRA rank; 0: a plain attn_q (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0  # MLA: the latent size (> 0 for deepseek2)
    v_head_dim: int = 0  # MLA: per-head value size; 0: head_dim - rope_dim
    mla_split: bool = True  # MLA: attn_k_b/attn_v_b (recent converters), else one attn_kv_b
    nextn: int = 0  # MTP blocks after the trunk (glm4moe), written but never run
    sliding_window: int = 0  # the sliding layers' window (archs with `swa_pattern`)
    # Gated DeltaNet (archs with `linear_attn`): layer i is full attention when
    # (i + 1) % full_attention_interval == 0, else linear attention of these sizes
    full_attention_interval: int = 0
    ssm_k_heads: int = 0  # ssm.group_count
    ssm_v_heads: int = 0  # ssm.time_step_rank
    ssm_state: int = 0  # ssm.state_size (each head's size)
    ssm_conv: int = 0  # ssm.conv_kernel
    rope_sections: tuple[int, ...] = ()  # IMROPE's [t, h, w, e] (archs with `imrope`)
    # per trunk layer, whether it is linear attention: written as `attention.recurrent_layers`
    # (as the converter does from the HF config's layer_types), overriding the interval
    recurrent_pattern: tuple[bool, ...] = ()
    # llama4: layer i is MoE when (i + 1) % moe_step == 0 (`interleave_moe_layer_step`), the
    # others dense; 0: every layer after `dense_layers`
    moe_step: int = 0
    context: int = 0  # context_length; 0: `kvq.tools.synth.tiny.CONTEXT_LENGTH`
    rope_factors: bool = False  # rope_freqs.weight, llama3-style frequency factors (llama4)

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s FFN is the routed experts (else a dense FFN)."""
        step = self.moe_step
        return layer >= self.dense_layers and (step <= 1 or (layer + 1) % step == 0)

    @property
    def shared_ffn(self) -> int:
        if self.shared_count:
            return self.shared_count * self.expert_ffn
        return self.shared_expert_ffn or 2 * self.expert_ffn

    def recurrent(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention (Gated DeltaNet) layer."""
        if self.recurrent_pattern:
            return layer < len(self.recurrent_pattern) and self.recurrent_pattern[layer]
        n = self.full_attention_interval
        return bool(n) and layer < self.layers and (layer + 1) % n != 0

    @property
    def ssm_channels(self) -> int:
        """The conv's channels: q and k (group_count heads), then v."""
        return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_state

    @property
    def dense_width(self) -> int:
        return self.dense_ffn or 2 * self.expert_ffn

    @property
    def rope_dims(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim - self.rope_dims

    def check(self) -> None:
        """ModelError naming the first inconsistent dimension."""
        for name in (
            "layers",
            "experts",
            "experts_used",
            "hidden",
            "expert_ffn",
            "heads",
            "kv_heads",
            "head_dim",
            "vocab",
        ):
            if getattr(self, name) < 1:
                raise ModelError(f"make_tiny {name}={getattr(self, name)} must be >= 1")
        if self.experts_used > self.experts:
            raise ModelError(
                f"make_tiny experts_used={self.experts_used} exceeds experts={self.experts}"
            )
        if self.heads % self.kv_heads:
            raise ModelError(
                f"make_tiny heads={self.heads} is not a multiple of kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2 or self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise ModelError(
                f"make_tiny head_dim={self.head_dim} and rope_dim={self.rope_dim} must be even, "
                "rope_dim <= head_dim"
            )
        if self.experts % self.expert_groups or not 0 < self.groups_used <= self.expert_groups:
            raise ModelError(
                f"make_tiny expert_groups={self.expert_groups} must divide experts and "
                f"groups_used={self.groups_used} be in 1..expert_groups"
            )
        if self.recurrent_pattern and len(self.recurrent_pattern) != self.layers:
            raise ModelError(
                f"make_tiny recurrent_pattern {self.recurrent_pattern} must give one flag per "
                f"layer ({self.layers})"
            )
        if not 0 <= self.dense_layers < self.layers or not 0 <= self.moe_step <= self.layers:
            raise ModelError(
                f"make_tiny dense_layers={self.dense_layers} and moe_step={self.moe_step} "
                f"must leave a MoE layer of {self.layers}"
            )


def tiny_tensors(cfg: TinyConfig, spec: ArchSpec, rng: np.random.Generator) -> dict[str, F32]:
    """All weights in numpy order (GGUF dims are the reverse), GGUF names."""
    h = cfg.hidden
    raw = rng.standard_normal(h)
    u: F32 = (raw / np.linalg.norm(raw)).astype(np.float32)  # [H] shared direction, unit length
    embd = _normal(rng, (cfg.vocab, h), 1.0) + _SHARED_DIR * u[None, :]  # [V, H]
    out: dict[str, F32] = {"token_embd.weight": embd.astype(np.float32)}
    bias = _router_bias(cfg.experts, rng)  # [E]
    for layer in range(cfg.layers + cfg.nextn):
        out.update(_layer_tensors(cfg, spec, rng, layer, u, bias))
    out["output_norm.weight"] = _norm_weight(rng, h)  # [H]
    out["output.weight"] = _normal(rng, (cfg.vocab, h), 3.0 / np.sqrt(h))  # [V, H]
    return out


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> F32:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm_weight(rng: np.random.Generator, n: int) -> F32:
    # near 1 so RMSNorm keeps unit scale, slightly varied so the weight is observable
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _router_bias(experts: int, rng: np.random.Generator) -> F32:
    """Zipf-like per-expert bias, in a seed-dependent order so popular ids vary by seed."""
    zipf = _ROUTER_SKEW / np.arange(1, experts + 1)  # [E] 1/rank
    return zipf[rng.permutation(experts)].astype(np.float32)


def _layer_tensors(
    cfg: TinyConfig, spec: ArchSpec, rng: np.random.Generator, layer: int, u: F32, bias: F32
) -> dict[str, F32]:
    h, f, e, d = cfg.hidden, cfg.expert_ffn, cfg.experts, cfg.head_dim
    q_out, kv_out = cfg.heads * d, cfg.kv_heads * d
    router = _normal(rng, (e, h), 1.0 / np.sqrt(h)) + np.outer(bias, u)  # [E, H]
    p = f"blk.{layer}."
    out = {
        p + "attn_norm.weight": _norm_weight(rng, h),  # [H]
        p + "attn_q.weight": _normal(rng, (q_out, h), 1.0 / np.sqrt(h)),  # [heads*d, H]
        p + "attn_k.weight": _normal(rng, (kv_out, h), 1.0 / np.sqrt(h)),  # [kv*d, H]
        p + "attn_v.weight": _normal(rng, (kv_out, h), 1.0 / np.sqrt(h)),  # [kv*d, H]
        p + "attn_output.weight": _normal(rng, (h, q_out), 1.0 / np.sqrt(q_out)),  # [H, heads*d]
        p + "attn_q_norm.weight": _norm_weight(rng, d),  # [d]
        p + "attn_k_norm.weight": _norm_weight(rng, d),  # [d]
        p + "ffn_norm.weight": _norm_weight(rng, h),  # [H]
        p + "ffn_gate_inp.weight": router.astype(np.float32),  # [E, H]
        p + "ffn_gate_exps.weight": _normal(rng, (e, f, h), 1.0 / np.sqrt(h)),  # [E, F, H]
        p + "ffn_up_exps.weight": _normal(rng, (e, f, h), 1.0 / np.sqrt(h)),  # [E, F, H]
        p + "ffn_down_exps.weight": _normal(rng, (e, h, f), 1.0 / np.sqrt(f)),  # [E, H, F]
    }
    if spec.qk_norm == QK_NONE and not cfg.head_norms:
        del out[p + "attn_q_norm.weight"], out[p + "attn_k_norm.weight"]
    if spec.qkv_bias:
        for name, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            out[f"{p}attn_{name}.bias"] = _normal(rng, (n,), 0.2)  # [n]
    if spec.shared == SHARED_GATED:
        out.update(_shared_tensors(rng, p, h, cfg.shared_ffn))
    if spec.hf_permuted_qk:  # llama: the converter's Q/K row permutation
        out[p + "attn_q.weight"] = permute_qk(out[p + "attn_q.weight"], cfg.heads)
        out[p + "attn_k.weight"] = permute_qk(out[p + "attn_k.weight"], cfg.kv_heads)
    if spec.attention == MLA:
        out = {k: v for k, v in out.items() if ".attn_" not in k or "attn_norm" in k}
        out.update(_mla_tensors(cfg, rng, p))
    return _parts(cfg, spec, rng, layer, out)


def _parts(
    cfg: TinyConfig, spec: ArchSpec, rng: np.random.Generator, layer: int, drawn: dict[str, F32]
) -> dict[str, F32]:
    """The block as `layer_shapes` lays it out: tensors drawn above kept, the others drawn
    with the generic rule (1/sqrt(fan-in) matrices, norms near 1, small biases)."""
    out: dict[str, F32] = {}
    for name, shape in layer_shapes(cfg, spec, layer).items():
        if name in drawn and drawn[name].shape == shape:
            out[name] = drawn[name]
        elif name.endswith("norm.weight"):
            out[name] = _norm_weight(rng, shape[0]).reshape(shape)
        elif name.endswith("ssm_a"):  # -exp(A_log): a decay per value head
            out[name] = -np.exp(_normal(rng, shape, 0.5))
        elif name.endswith("ssm_conv1d.weight"):  # the causal conv's taps
            out[name] = _normal(rng, shape, 0.5)
        elif name.endswith("attn_sinks.weight"):  # logits of the order of the scores'
            out[name] = _normal(rng, shape, 1.0) + 1.0
        elif name.endswith(("gate_exps.bias", "up_exps.bias")):  # wide: the clamps are reached
            out[name] = _normal(rng, shape, 2.5)
        elif name.endswith(".bias"):
            out[name] = _normal(rng, shape, 0.3)
        else:
            out[name] = _normal(rng, shape, 1.0 / np.sqrt(shape[-1]))
    return out


def _mla_tensors(cfg: TinyConfig, rng: np.random.Generator, p: str) -> dict[str, F32]:
    """MLA's attention as Hugging Face's names map to GGUF, kv_b split as the converter does."""
    h, heads, dk, r = cfg.hidden, cfg.heads, cfg.head_dim, cfg.kv_lora_rank
    nope, v = dk - cfg.rope_dims, cfg.value_dim
    kv_b = _normal(rng, (heads, nope + v, r), 1.0 / np.sqrt(r))  # HF kv_b_proj, per head
    out = {
        p + "attn_kv_a_mqa.weight": _normal(rng, (r + cfg.rope_dims, h), 1.0 / np.sqrt(h)),
        p + "attn_kv_a_norm.weight": _norm_weight(rng, r),
        p + "attn_output.weight": _normal(rng, (h, heads * v), 1.0 / np.sqrt(heads * v)),
        p + "attn_kv_b.weight": kv_b.reshape(heads * (nope + v), r),
        p + "attn_k_b.weight": np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)),
        p + "attn_v_b.weight": np.ascontiguousarray(kv_b[:, nope:]),
    }
    return out


def layer_shapes(cfg: TinyConfig, spec: ArchSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape of every tensor of block `layer`, for every arch (MTP blocks
    past `cfg.layers` included): the one description `tiny_tensors` and the presets share."""
    h, d = cfg.hidden, cfg.head_dim
    q, kv, p = cfg.heads * d, cfg.kv_heads * d, f"blk.{layer}."
    out: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (h,)}
    if cfg.recurrent(layer):
        out.update(_delta_shapes(cfg, p))
    elif spec.attention == MLA:
        out.update(_mla_shapes(cfg, p))
    else:
        out.update(_gqa_shapes(cfg, spec, p))
    out[p + spec.ffn_norm + ".weight"] = (h,)
    if spec.out_bias:
        out[p + "attn_output.bias"] = (h,)
    if spec.attn_sinks:
        out[p + "attn_sinks.weight"] = (cfg.heads,)
    out.update(_ffn_shapes(cfg, layer, p))
    if spec.qkv_bias:
        out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
    if cfg.is_moe(layer):
        out.update(_moe_extra_shapes(cfg, spec, p))
    if layer >= cfg.layers:  # an MTP block: its own projections and norms
        out.update(
            {
                p + "nextn.eh_proj.weight": (h, 2 * h),
                p + "nextn.enorm.weight": (h,),
                p + "nextn.hnorm.weight": (h,),
                p + "nextn.shared_head_norm.weight": (h,),
            }
        )
    return out


def _gqa_shapes(cfg: TinyConfig, spec: ArchSpec, p: str) -> dict[str, tuple[int, ...]]:
    """Grouped-query attention's projections and its q/k norms, if any."""
    h, d = cfg.hidden, cfg.head_dim
    q, kv = cfg.heads * d, cfg.kv_heads * d
    q_rows = 2 * q if spec.gated_q else q  # qwen35moe: per head q, then the output gate
    out: dict[str, tuple[int, ...]] = {
        p + "attn_q.weight": (q_rows, h),
        p + "attn_k.weight": (kv, h),
        p + "attn_v.weight": (kv, h),
        p + "attn_output.weight": (h, q),
    }
    if spec.qk_norm == QK_FULL:
        out.update({p + "attn_q_norm.weight": (q,), p + "attn_k_norm.weight": (kv,)})
    elif spec.qk_norm == QK_HEAD or cfg.head_norms:
        out.update({p + "attn_q_norm.weight": (d,), p + "attn_k_norm.weight": (d,)})
    return out


def _ffn_shapes(cfg: TinyConfig, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    """A dense layer's FFN, or a MoE layer's router and stacked experts."""
    h, f, e = cfg.hidden, cfg.expert_ffn, cfg.experts
    if not cfg.is_moe(layer):
        fd = cfg.dense_width
        return {
            p + "ffn_gate.weight": (fd, h),
            p + "ffn_up.weight": (fd, h),
            p + "ffn_down.weight": (h, fd),
        }
    return {
        p + "ffn_gate_inp.weight": (e, h),
        p + "ffn_gate_exps.weight": (e, f, h),
        p + "ffn_up_exps.weight": (e, f, h),
        p + "ffn_down_exps.weight": (e, h, f),
    }


def _moe_extra_shapes(cfg: TinyConfig, spec: ArchSpec, p: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's shared expert (and its gate), score bias, router and expert biases."""
    h, f, e, fs = cfg.hidden, cfg.expert_ffn, cfg.experts, cfg.shared_ffn
    out: dict[str, tuple[int, ...]] = {}
    if spec.shared == SHARED_GATED:
        out[p + "ffn_gate_inp_shexp.weight"] = (h,)
    if spec.shared != SHARED_NONE:
        out.update(
            {
                p + "ffn_gate_shexp.weight": (fs, h),
                p + "ffn_up_shexp.weight": (fs, h),
                p + "ffn_down_shexp.weight": (h, fs),
            }
        )
    if cfg.probs_bias:
        out[p + "exp_probs_b.bias"] = (e,)
    if spec.router_bias:
        out[p + "ffn_gate_inp.bias"] = (e,)
    if spec.expert_bias:
        out.update(
            {
                p + "ffn_gate_exps.bias": (e, f),
                p + "ffn_up_exps.bias": (e, f),
                p + "ffn_down_exps.bias": (e, h),
            }
        )
    return out


def _delta_shapes(cfg: TinyConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors, as llama.cpp's `qwen35moe` loads them."""
    h, c, hv = cfg.hidden, cfg.ssm_channels, cfg.ssm_v_heads
    vd = hv * cfg.ssm_state
    return {
        p + "attn_qkv.weight": (c, h),
        p + "attn_gate.weight": (vd, h),
        p + "ssm_conv1d.weight": (c, cfg.ssm_conv),
        p + "ssm_dt.bias": (hv,),
        p + "ssm_a": (hv,),
        p + "ssm_beta.weight": (hv, h),
        p + "ssm_alpha.weight": (hv, h),
        p + "ssm_norm.weight": (cfg.ssm_state,),
        p + "ssm_out.weight": (h, vd),
    }


def _mla_shapes(cfg: TinyConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, heads, dk, r = cfg.hidden, cfg.heads, cfg.head_dim, cfg.kv_lora_rank
    nope, v = dk - cfg.rope_dims, cfg.value_dim
    out: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank:
        out.update(
            {
                p + "attn_q_a.weight": (cfg.q_lora_rank, h),
                p + "attn_q_a_norm.weight": (cfg.q_lora_rank,),
                p + "attn_q_b.weight": (heads * dk, cfg.q_lora_rank),
            }
        )
    else:
        out[p + "attn_q.weight"] = (heads * dk, h)
    out.update(
        {p + "attn_kv_a_mqa.weight": (r + cfg.rope_dims, h), p + "attn_kv_a_norm.weight": (r,)}
    )
    if cfg.mla_split:
        out.update({p + "attn_k_b.weight": (heads, r, nope), p + "attn_v_b.weight": (heads, v, r)})
    else:
        out[p + "attn_kv_b.weight"] = (heads * (nope + v), r)
    out[p + "attn_output.weight"] = (h, heads * v)
    return out


def _shared_tensors(rng: np.random.Generator, p: str, h: int, fs: int) -> dict[str, F32]:
    return {
        p + "ffn_gate_inp_shexp.weight": _normal(rng, (h,), 1.0 / np.sqrt(h)),  # [H]
        p + "ffn_gate_shexp.weight": _normal(rng, (fs, h), 1.0 / np.sqrt(h)),  # [Fs, H]
        p + "ffn_up_shexp.weight": _normal(rng, (fs, h), 1.0 / np.sqrt(h)),  # [Fs, H]
        p + "ffn_down_shexp.weight": _normal(rng, (h, fs), 1.0 / np.sqrt(fs)),  # [H, Fs]
    }


def llama3_rope_factors(dims: int, base: float, factor: float = 8.0) -> F32:
    """`rope_freqs.weight` [dims / 2] as llama.cpp's converter derives it from a llama3
    `rope_scaling` (Llama-3.1's: low 1, high 4, over an original 8192 positions): 1 for
    wavelengths under 8192 / 4, `factor` over 8192, blended in between."""
    original, low, high = 8192.0, 1.0, 4.0
    wavelen = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)  # [d/2]
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended)
    )
    return out.astype(np.float32)
