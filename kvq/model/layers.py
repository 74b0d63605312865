"""Stateless pieces of the qwen3moe forward pass, following llama.cpp's graph."""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim."""
    var = x.pow(2).mean(dim=-1, keepdim=True)  # [..., 1]
    return x * torch.rsqrt(var + eps) * weight


def rope_neox(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding, NEOX style (first half paired with second half).

    x: [T, heads, d]; pos: [T] int64 absolute positions.
    """
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) * 2 / d)
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = ang.cos()[:, None, :].to(x.dtype)  # [T, 1, d/2]
    sin = ang.sin()[:, None, :].to(x.dtype)  # [T, 1, d/2]
    x1, x2 = x[..., :half], x[..., half:]  # [T, heads, d/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int
) -> torch.Tensor:
    """Grouped-query causal attention of new queries against a sequence's cached keys.

    q: [T, heads, d] at positions q_start..q_start+T-1; k, v: [S, kv, d] with S = q_start+T.
    Query head h reads kv head h // (heads / kv), as ggml's broadcasting matmul does.
    Returns [T, heads * d].
    """
    t, heads, d = q.shape
    group = heads // k.shape[1]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, d]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, d]
    qh = q.transpose(0, 1)  # [heads, T, d]
    scores = (qh @ kh.transpose(1, 2)) / math.sqrt(d)  # [heads, T, S]
    qpos = torch.arange(q_start, q_start + t, device=q.device)[:, None]  # [T, 1]
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]  # [1, S]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [heads, T, S]
    return (probs @ vh).transpose(0, 1).reshape(t, heads * d)  # [T, heads*d]


def route(router: torch.Tensor, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top-k, renormalise to sum 1 (qwen3moe norm_topk_prob).

    router: [E, H]; x: [T, H]. Returns ids [T, k] int64 and weights [T, k] float32.
    """
    logits = x.float() @ router.float().T  # [T, E] in f32, as llama.cpp does
    probs = torch.softmax(logits, dim=-1)  # [T, E]
    w, ids = torch.topk(probs, k, dim=-1)  # [T, k] each, largest first
    w = w / w.sum(dim=-1, keepdim=True)  # [T, k]
    return ids, w
