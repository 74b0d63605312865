"""A tiny random qwen3moe model in GGUF, for tests and demos (deterministic from `seed`).

The weights are random but shaped so that generation is numerically sane and the router is
skewed: every token embedding shares a common direction `u`, and router row e gets
`bias[e] * u` with Zipf-like `bias`, so a few experts win most tokens, as in real MoE models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGUFWriter, TokenType

from kvq.errors import ModelError
from kvq.model.tokenizer import BYTE_TOKENIZER, N_BYTES, byte_token_list

ARCH = "qwen3moe"
CONTEXT_LENGTH = 512
ROPE_FREQ_BASE = 1e6
RMS_EPS = 1e-6
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

    @property
    def vocab(self) -> int:
        return N_BYTES + 2

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
        if self.head_dim % 2:
            raise ModelError(f"make_tiny head_dim={self.head_dim} must be even for RoPE")


def make_tiny(
    path: str | Path,
    *,
    layers: int = 2,
    experts: int = 8,
    experts_used: int = 2,
    hidden: int = 64,
    expert_ffn: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    seed: int = 0,
) -> None:
    """Write a tiny random qwen3moe GGUF (all tensors F32) with a byte tokenizer to `path`."""
    cfg = TinyConfig(layers, experts, experts_used, hidden, expert_ffn, heads, kv_heads, head_dim)
    cfg.check()
    tensors = _tensors(cfg, np.random.default_rng(seed))
    writer = GGUFWriter(str(path), ARCH)
    try:
        _add_metadata(writer, cfg, seed)
        for name, arr in tensors.items():
            writer.add_tensor(name, arr)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add_metadata(w: GGUFWriter, cfg: TinyConfig, seed: int) -> None:
    w.add_name(f"kvq-tiny-{cfg.layers}L-{cfg.experts}E-s{seed}")
    w.add_block_count(cfg.layers)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.expert_ffn)
    w.add_expert_feed_forward_length(cfg.expert_ffn)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(cfg.experts)
    w.add_expert_used_count(cfg.experts_used)
    w.add_tokenizer_model(BYTE_TOKENIZER)
    w.add_token_list(byte_token_list())
    w.add_token_types([TokenType.BYTE] * N_BYTES + [TokenType.CONTROL] * 2)
    w.add_bos_token_id(N_BYTES)
    w.add_eos_token_id(N_BYTES + 1)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> F32:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm_weight(rng: np.random.Generator, n: int) -> F32:
    # near 1 so RMSNorm keeps unit scale, slightly varied so the weight is observable
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _tensors(cfg: TinyConfig, rng: np.random.Generator) -> dict[str, F32]:
    """All weights in numpy order (GGUF dims are the reverse)."""
    h = cfg.hidden
    raw = rng.standard_normal(h)
    u: F32 = (raw / np.linalg.norm(raw)).astype(np.float32)  # [H] shared direction, unit length
    embd = _normal(rng, (cfg.vocab, h), 1.0) + _SHARED_DIR * u[None, :]  # [V, H]
    out: dict[str, F32] = {"token_embd.weight": embd.astype(np.float32)}
    bias = _router_bias(cfg.experts, rng)  # [E]
    for layer in range(cfg.layers):
        out.update(_layer_tensors(cfg, rng, layer, u, bias))
    out["output_norm.weight"] = _norm_weight(rng, h)  # [H]
    out["output.weight"] = _normal(rng, (cfg.vocab, h), 3.0 / np.sqrt(h))  # [V, H]
    return out


def _router_bias(experts: int, rng: np.random.Generator) -> F32:
    """Zipf-like per-expert bias, in a seed-dependent order so popular ids vary by seed."""
    zipf = _ROUTER_SKEW / np.arange(1, experts + 1)  # [E] 1/rank
    return zipf[rng.permutation(experts)].astype(np.float32)


def _layer_tensors(
    cfg: TinyConfig, rng: np.random.Generator, layer: int, u: F32, bias: F32
) -> dict[str, F32]:
    h, f, e, d = cfg.hidden, cfg.expert_ffn, cfg.experts, cfg.head_dim
    q_out, kv_out = cfg.heads * d, cfg.kv_heads * d
    router = _normal(rng, (e, h), 1.0 / np.sqrt(h)) + np.outer(bias, u)  # [E, H]
    p = f"blk.{layer}."
    return {
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
