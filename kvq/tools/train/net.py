"""A `qwen3moe` network in torch, for training: the computation llama.cpp and kvq run.

Per block: x += Wo · attn(rope(qnorm(Wq · n1(x))), rope(knorm(Wk · n1(x))), Wv · n1(x)), then
x += Σ_top-k w_e · down_e(silu(gate_e(h)) * up_e(h)) with h = n2(x) and w the router's
softmax over all experts, kept top-k and renormalised. RMSNorm everywhere (eps `rms_eps`),
q/k norms per head, NEOX rope (the two halves of a head rotate together), grouped-query
attention (query head i reads kv head i // (heads / kv_heads)), the output tied to the
token embedding (the file has no `output.weight`).

Parameters are kept in GGUF's numpy layout ((out, in) matrices, experts stacked (E, out, in))
so that `kvq.tools.train.export` writes them as they are.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class NetConfig:
    """The shape of one model."""

    vocab: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    context: int
    rope_base: float = 10000.0
    rms_eps: float = 1e-6

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(cfg: NetConfig, n: int) -> tuple[Tensor, Tensor]:
    """cos, sin [n, head_dim / 2] of positions 0..n-1 (float64 angles, as ggml's)."""
    half = cfg.head_dim // 2
    freq = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * freq[None, :]
    return ang.cos().float(), ang.sin().float()


def rope_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, d] rotated by position; pairs (i, i + d/2)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Block(nn.Module):
    """One attention + MoE block."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        h, d, e, f = cfg.hidden, cfg.head_dim, cfg.experts, cfg.expert_ffn
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.attn_q = nn.Parameter(torch.empty(cfg.heads * d, h))
        self.attn_k = nn.Parameter(torch.empty(cfg.kv_heads * d, h))
        self.attn_v = nn.Parameter(torch.empty(cfg.kv_heads * d, h))
        self.attn_output = nn.Parameter(torch.empty(h, cfg.heads * d))
        self.attn_q_norm = nn.Parameter(torch.ones(d))
        self.attn_k_norm = nn.Parameter(torch.ones(d))
        self.ffn_norm = nn.Parameter(torch.ones(h))
        self.ffn_gate_inp = nn.Parameter(torch.empty(e, h))
        self.ffn_gate_exps = nn.Parameter(torch.empty(e, f, h))
        self.ffn_up_exps = nn.Parameter(torch.empty(e, f, h))
        self.ffn_down_exps = nn.Parameter(torch.empty(e, h, f))

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        cfg, (b, t, _) = self.cfg, x.shape
        hx = rms_norm(x, self.attn_norm, cfg.rms_eps)
        q = (hx @ self.attn_q.T).view(b, t, cfg.heads, cfg.head_dim)
        k = (hx @ self.attn_k.T).view(b, t, cfg.kv_heads, cfg.head_dim)
        v = (hx @ self.attn_v.T).view(b, t, cfg.kv_heads, cfg.head_dim)
        q = rope_neox(rms_norm(q, self.attn_q_norm, cfg.rms_eps).transpose(1, 2), cos, sin)
        k = rope_neox(rms_norm(k, self.attn_k_norm, cfg.rms_eps).transpose(1, 2), cos, sin)
        group = cfg.heads // cfg.kv_heads
        k = k.repeat_interleave(group, dim=1)  # [B, heads, T, d]
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, d]
        return o.transpose(1, 2).reshape(b, t, -1) @ self.attn_output.T

    def moe(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The routed experts' sum for x [N, H], and the load-balancing loss."""
        cfg = self.cfg
        hx = rms_norm(x, self.ffn_norm, cfg.rms_eps)
        probs = (hx @ self.ffn_gate_inp.T).softmax(-1)  # [N, E]
        w, idx = probs.topk(cfg.experts_used, dim=-1)  # [N, k]
        w = w / w.sum(-1, keepdim=True)
        flat = idx.flatten()  # [N * k]
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=cfg.experts).tolist()
        xs = torch.split(hx[order // cfg.experts_used], counts)  # per expert [n_e, H]
        ys = [
            (F.silu(xe @ self.ffn_gate_exps[e].T) * (xe @ self.ffn_up_exps[e].T))
            @ self.ffn_down_exps[e].T
            for e, xe in enumerate(xs)
        ]
        y = torch.cat(ys)[order.argsort()].view(-1, cfg.experts_used, x.shape[-1])
        out = (y * w.unsqueeze(-1)).sum(1)  # [N, H]
        share = torch.tensor(counts, dtype=x.dtype) / flat.numel()
        aux = cfg.experts * (share * probs.mean(0)).sum()
        return out, aux

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.attention(x, cos, sin)
        b, t, h = x.shape
        y, aux = self.moe(x.reshape(b * t, h))
        return x + y.view(b, t, h), aux


class MoeLM(nn.Module):
    """The whole model: token embedding (tied output), blocks, final norm."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Parameter(torch.empty(cfg.vocab, cfg.hidden))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.output_norm = nn.Parameter(torch.ones(cfg.hidden))

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) matrices, the residual outputs scaled by 1/sqrt(2 * layers)."""
        g = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = out_std if name.endswith(("attn_output", "ffn_down_exps")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Logits [B, T, vocab] of ids [B, T], and the blocks' mean balancing loss."""
        cos, sin = rope_tables(self.cfg, ids.shape[1])
        x = self.token_embd[ids]
        aux = x.new_zeros(())
        for blk in self.blocks:
            x, a = blk(x, cos, sin)
            aux = aux + a
        x = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        return x @ self.token_embd.T, aux / len(self.blocks)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
