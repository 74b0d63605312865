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
from kvq.model.arch import ArchSpec, permute_qk
from kvq.model.tokenizer import N_BYTES

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

    @property
    def shared_ffn(self) -> int:
        return self.shared_expert_ffn or 2 * self.expert_ffn

    def check(self) -> None:
        """ModelError naming the first inconsistent dimension."""
        for name in (
            "layers", "experts", "experts_used", "hidden", "expert_ffn", "heads", "kv_heads",
            "head_dim", "vocab",
        ):  # fmt: skip
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
        if self.head_dim % 2:
            raise ModelError(f"make_tiny head_dim={self.head_dim} must be even for RoPE")


def tiny_tensors(cfg: TinyConfig, spec: ArchSpec, rng: np.random.Generator) -> dict[str, F32]:
    """All weights in numpy order (GGUF dims are the reverse), GGUF names."""
    h = cfg.hidden
    raw = rng.standard_normal(h)
    u: F32 = (raw / np.linalg.norm(raw)).astype(np.float32)  # [H] shared direction, unit length
    embd = _normal(rng, (cfg.vocab, h), 1.0) + _SHARED_DIR * u[None, :]  # [V, H]
    out: dict[str, F32] = {"token_embd.weight": embd.astype(np.float32)}
    bias = _router_bias(cfg.experts, rng)  # [E]
    for layer in range(cfg.layers):
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
    if not spec.qk_norm:
        del out[p + "attn_q_norm.weight"], out[p + "attn_k_norm.weight"]
    if spec.qkv_bias:
        for name, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            out[f"{p}attn_{name}.bias"] = _normal(rng, (n,), 0.2)  # [n]
    if spec.shared_expert:
        out.update(_shared_tensors(rng, p, h, cfg.shared_ffn))
    if spec.rope_style == "norm":  # llama: the converter's Q/K row permutation
        out[p + "attn_q.weight"] = permute_qk(out[p + "attn_q.weight"], cfg.heads)
        out[p + "attn_k.weight"] = permute_qk(out[p + "attn_k.weight"], cfg.kv_heads)
    return out


def _shared_tensors(rng: np.random.Generator, p: str, h: int, fs: int) -> dict[str, F32]:
    return {
        p + "ffn_gate_inp_shexp.weight": _normal(rng, (h,), 1.0 / np.sqrt(h)),  # [H]
        p + "ffn_gate_shexp.weight": _normal(rng, (fs, h), 1.0 / np.sqrt(h)),  # [Fs, H]
        p + "ffn_up_shexp.weight": _normal(rng, (fs, h), 1.0 / np.sqrt(h)),  # [Fs, H]
        p + "ffn_down_shexp.weight": _normal(rng, (h, fs), 1.0 / np.sqrt(fs)),  # [H, Fs]
    }
