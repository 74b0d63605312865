"""The qwen3moe forward pass in torch, with the routed-expert FFN behind a pluggable MoeFn.

Token rows of every sequence in a batch are concatenated before the MoE call, so one MoeFn
call per layer per forward covers the whole batch (that call is what gets dispatched to
remote expert workers); attention runs per sequence against that sequence's own KVCache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq.errors import ModelError
from kvq.model import gguf_io as gio
from kvq.model.cache import KVCache, SeqStep
from kvq.model.experts import expert_forward
from kvq.model.layers import causal_attention, rms_norm, rope_neox, route
from kvq.model.meta import ModelMeta, read_meta
from kvq.model.slices import ExpertSlice, load_slice

__all__ = ["Backbone", "KVCache", "LayerWeights", "MoeFn", "SeqStep"]

# (layer, x [T, H] after ffn_norm, topk_ids [T, k] int64, topk_w [T, k] float32) -> [T, H]
MoeFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    """Dense (non-expert) weights of one block, numpy/torch order [out, in]."""

    attn_norm: torch.Tensor  # [H]
    wq: torch.Tensor  # [heads*d, H]
    wk: torch.Tensor  # [kv*d, H]
    wv: torch.Tensor  # [kv*d, H]
    wo: torch.Tensor  # [H, heads*d]
    q_norm: torch.Tensor  # [d]
    k_norm: torch.Tensor  # [d]
    ffn_norm: torch.Tensor  # [H]
    router: torch.Tensor  # [E, H]


class Backbone:
    """Weights and forward pass of a qwen3moe model (experts held locally for `moe=None`)."""

    def __init__(
        self,
        meta: ModelMeta,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        output_norm: torch.Tensor,
        output: torch.Tensor,
        experts: list[ExpertSlice],
    ) -> None:
        self.meta = meta
        self.embed = embed  # [V, H]
        self.layers = layers
        self.output_norm = output_norm  # [H]
        self.output = output  # [V, H]
        self.experts = experts  # experts[layer] covers all experts of that layer
        self.device = embed.device
        self.dtype = embed.dtype

    @classmethod
    def from_gguf(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Backbone:
        """Load and dequantize every weight of a GGUF model once."""
        m = read_meta(path)
        load = _Loader(path, device, dtype)
        h, e = m.embedding_length, m.expert_count
        layers = [_layer_weights(load, m, i) for i in range(m.block_count)]
        experts = [load_slice(path, m, i, 0, e, device, dtype) for i in range(m.block_count)]
        embed = load("token_embd.weight", (m.vocab_size, h))
        output = load("output.weight", (m.vocab_size, h))
        return cls(m, embed, layers, load("output_norm.weight", (h,)), output, experts)

    def new_cache(self) -> KVCache:
        """An empty KV cache sized to the model's context length."""
        m = self.meta
        return KVCache(
            m.block_count, m.context_length, m.head_count_kv, m.head_dim, self.device, self.dtype
        )

    def local_moe(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """MoeFn computing all of `layer`'s experts locally."""
        return expert_forward(self.experts[layer], x, ids, w)

    @torch.no_grad()
    def forward(self, steps: list[SeqStep], moe: MoeFn | None = None) -> torch.Tensor:
        """Run the new tokens of every step; return float32 logits [len(steps), vocab] at
        each sequence's last new position. Caches advance only if the whole pass succeeds."""
        lens = self._check_steps(steps)
        moe_fn = moe if moe is not None else self.local_moe
        tokens = torch.tensor([t for s in steps for t in s.tokens], device=self.device)  # [N]
        pos = torch.cat(
            [
                torch.arange(s.cache.length, s.cache.length + n, device=self.device)
                for s, n in zip(steps, lens, strict=True)
            ]
        )  # [N] absolute position of each row
        h = self.embed[tokens]  # [N, H]
        eps, k = self.meta.rms_eps, self.meta.expert_used_count
        for i, lw in enumerate(self.layers):
            h = h + self._attention(i, lw, rms_norm(h, lw.attn_norm, eps), steps, lens, pos)
            x = rms_norm(h, lw.ffn_norm, eps)  # [N, H]
            ids, w = route(lw.router, x, k)  # [N, k] each
            y = moe_fn(i, x, ids, w)  # [N, H]
            if tuple(y.shape) != tuple(x.shape):
                raise ModelError(
                    f"moe fn returned shape {tuple(y.shape)} for layer {i}, "
                    f"expected {tuple(x.shape)}"
                )
            h = h + y.to(device=h.device, dtype=h.dtype)
        for s, n in zip(steps, lens, strict=True):
            s.cache.advance(n)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1  # [B]
        hl = rms_norm(h[last], self.output_norm, eps)  # [B, H]
        return (hl @ self.output.T).float()  # [B, V]

    def _attention(
        self,
        layer: int,
        lw: LayerWeights,
        x: torch.Tensor,
        steps: list[SeqStep],
        lens: list[int],
        pos: torch.Tensor,
    ) -> torch.Tensor:
        """Self-attention of all rows, each sequence against its own cache. x: [N, H]."""
        m, n = self.meta, x.shape[0]
        q = (x @ lw.wq.T).view(n, m.head_count, m.head_dim)  # [N, heads, d]
        kk = (x @ lw.wk.T).view(n, m.head_count_kv, m.head_dim)  # [N, kv, d]
        vv = (x @ lw.wv.T).view(n, m.head_count_kv, m.head_dim)  # [N, kv, d]
        q = rope_neox(rms_norm(q, lw.q_norm, m.rms_eps), pos, m.rope_freq_base)
        kk = rope_neox(rms_norm(kk, lw.k_norm, m.rms_eps), pos, m.rope_freq_base)
        outs, start = [], 0
        for s, t in zip(steps, lens, strict=True):
            keys, values = s.cache.append(layer, kk[start : start + t], vv[start : start + t])
            outs.append(causal_attention(q[start : start + t], keys, values, s.cache.length))
            start += t
        return torch.cat(outs) @ lw.wo.T  # [N, H]

    def _check_steps(self, steps: list[SeqStep]) -> list[int]:
        """Token counts per step; ModelError on empty steps, bad ids, shared or full caches."""
        if not steps:
            raise ModelError("forward needs at least one SeqStep")
        if len({id(s.cache) for s in steps}) != len(steps):
            raise ModelError(
                "two SeqSteps in one batch share a KVCache; give each sequence its own"
            )
        vocab = self.meta.vocab_size
        for i, s in enumerate(steps):
            if not s.tokens:
                raise ModelError(f"SeqStep {i} has no tokens; send at least one per step")
            bad = [t for t in s.tokens if not 0 <= t < vocab]
            if bad:
                raise ModelError(f"SeqStep {i} has token ids {bad[:5]} outside [0, {vocab})")
            s.cache.check_room(len(s.tokens))
        return [len(s.tokens) for s in steps]

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        moe: MoeFn | None = None,
        stop_at_eos: bool = True,
    ) -> list[int]:
        """Greedy decoding; returns the generated ids only (EOS not included). Stops early at
        EOS (if `stop_at_eos`) or when the context is full."""
        if max_tokens <= 0:
            return []
        cache = self.new_cache()
        logits = self.forward([SeqStep(list(prompt_ids), cache)], moe)  # [1, V]
        out: list[int] = []
        while True:
            nxt = int(logits[0].argmax())
            if stop_at_eos and nxt == self.meta.eos_id:
                break
            out.append(nxt)
            if len(out) >= max_tokens or cache.length >= cache.max_len:
                break
            logits = self.forward([SeqStep([nxt], cache)], moe)
        return out


class _Loader:
    """Dequantizes named, shape-checked tensors of one GGUF file into torch."""

    def __init__(self, path: str | Path, device: str | torch.device, dtype: torch.dtype) -> None:
        self.path = str(path)
        self.tensors = gio.tensor_map(gio.open_reader(path))
        self.device = device
        self.dtype = dtype

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"tensor {name!r} is missing from {self.path!r}")
        if gio.numpy_shape(t) != shape:
            raise ModelError(f"tensor {name!r} has shape {gio.numpy_shape(t)}, expected {shape}")
        arr = gio.dequantize_tensor(t)  # float32, numpy order
        return torch.from_numpy(arr).to(device=self.device, dtype=self.dtype)


def _layer_weights(load: _Loader, m: ModelMeta, i: int) -> LayerWeights:
    """The dense weights of block `i`."""
    h, p = m.embedding_length, f"blk.{i}."
    q_out, kv_out = m.head_count * m.head_dim, m.head_count_kv * m.head_dim
    return LayerWeights(
        attn_norm=load(p + "attn_norm.weight", (h,)),
        wq=load(p + "attn_q.weight", (q_out, h)),
        wk=load(p + "attn_k.weight", (kv_out, h)),
        wv=load(p + "attn_v.weight", (kv_out, h)),
        wo=load(p + "attn_output.weight", (h, q_out)),
        q_norm=load(p + "attn_q_norm.weight", (m.head_dim,)),
        k_norm=load(p + "attn_k_norm.weight", (m.head_dim,)),
        ffn_norm=load(p + "ffn_norm.weight", (h,)),
        router=load(p + "ffn_gate_inp.weight", (m.expert_count, h)),
    )
