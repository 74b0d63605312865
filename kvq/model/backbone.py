"""The forward pass of the MoE archs kvq serves (see `kvq.model.arch`), in torch, with the
routed-expert FFN behind a pluggable MoeFn.

Token rows of every sequence in a batch are concatenated before the MoE call, so one MoeFn
call per layer per forward covers the whole batch (that call is what gets dispatched to
remote expert workers); attention runs per sequence against that sequence's own KVCache.
A shared expert (qwen2moe) is dense and always runs here, next to the routed MoeFn.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from kvq.errors import ModelError
from kvq.model.arch import arch_spec
from kvq.model.cache import KVCache, SeqStep
from kvq.model.experts import expert_forward
from kvq.model.generate import generate
from kvq.model.layers import Rope, causal_attention, linear, rms_norm, route, swiglu
from kvq.model.layout import slice_layout
from kvq.model.loader import LayerWeights, Loader, SharedExpert, layer_weights, output_weight
from kvq.model.meta import ModelMeta, read_meta
from kvq.model.qstack import QRows, Weight
from kvq.model.slices import ExpertSlice, map_slice
from kvq.model.threads import one_thread

# the small torch work of a pass (norms, rope, routing, each sequence's attention) runs on one
# thread when it has at most this many rows (decode steps, short prompts): its parallel regions
# cost more in wake-ups than they save (`kvq.model.threads`). The attention projections, the
# output head and the experts run outside these blocks and keep every thread.
SMALL_ROWS = 64


def _small(rows: int) -> Callable[[], AbstractContextManager[None]]:
    return one_thread if rows <= SMALL_ROWS else nullcontext


__all__ = ["Backbone", "KVCache", "LayerCalls", "LayerWeights", "MoeCall", "MoeFn", "SeqStep"]

# (layer, x [T, H] after ffn_norm, topk_ids [T, k] int64, topk_w [T, k] float32) -> [T, H]
MoeFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MoeCall = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]  # MoeFn's arguments
LayerCalls = Generator[MoeCall, torch.Tensor, torch.Tensor]  # see Backbone.layer_calls


class Backbone:
    """Weights and forward pass of a supported MoE model (experts held locally for `moe=None`)."""

    def __init__(
        self,
        meta: ModelMeta,
        embed: torch.Tensor | QRows,
        layers: list[LayerWeights],
        output_norm: torch.Tensor,
        output: Weight,
        experts: list[ExpertSlice],
    ) -> None:
        self.meta = meta
        self.embed = embed  # [V, H]
        self.layers = layers
        self.output_norm = output_norm  # [H]
        self.output = output  # [V, H]
        self.experts = experts  # experts[layer] covers all experts of that layer
        self.device = output_norm.device
        self.dtype = output_norm.dtype
        self.spec = arch_spec(meta.arch)
        self.rope = Rope.from_meta(meta, self.spec.rope_style)

    @classmethod
    def from_gguf(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        meta: ModelMeta | None = None,
    ) -> Backbone:
        """Map a GGUF model: every expert, the token embedding and each weight matrix a kernel
        computes kept in their encoding (memory-mapped: read on use); the rest dequantized
        once into `dtype`. `meta`: the file's `read_meta`, if the caller has it already."""
        m = meta or read_meta(path)  # validates arch, tensors, quant types before any weight
        load = Loader(path, device, dtype)
        spec, h, e = arch_spec(m.arch), m.embedding_length, m.expert_count
        layers = [layer_weights(load, m, spec, i) for i in range(m.block_count)]
        experts = [
            map_slice(path, slice_layout(m, i, 0, e), i, 0, e, dtype).to(device)
            for i in range(m.block_count)
        ]
        embed = load.rows("token_embd.weight", (m.vocab_size, h))
        output = output_weight(load, m)
        return cls(m, embed, layers, load("output_norm.weight", (h,)), output, experts)

    def new_cache(self) -> KVCache:
        """An empty KV cache that grows up to the model's context length."""
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
        moe_fn = moe if moe is not None else self.local_moe
        layers = self.layer_calls(steps)
        try:
            call = next(layers)
            while True:
                call = layers.send(moe_fn(*call))
        except StopIteration as done:
            logits: torch.Tensor = done.value
        self.advance(steps)
        return logits

    @torch.no_grad()
    def layer_calls(self, steps: list[SeqStep]) -> LayerCalls:
        """The forward of `steps` as a generator: it yields each MoE layer's call
        `(layer, x, ids, w)`, expects that call's `[N, H]` result sent back, and returns the
        logits `[len(steps), V]`. Caches are filled but not advanced (`advance`): several
        such passes can be interleaved (`kvq.model.microbatch`) and each computes exactly
        what `forward` computes for its steps."""
        lens = self._check_steps(steps)
        tokens = torch.tensor([t for s in steps for t in s.tokens], device=self.device)  # [N]
        pos = torch.cat(
            [
                torch.arange(s.cache.length, s.cache.length + n, device=self.device)
                for s, n in zip(steps, lens, strict=True)
            ]
        )  # [N] absolute position of each row
        h = self.embed[tokens]  # [N, H]
        m = self.meta
        eps, k = m.rms_eps, m.expert_used_count
        small = _small(len(tokens))
        for i, lw in enumerate(self.layers):
            with small():
                xa = rms_norm(h, lw.attn_norm, eps)
            h = h + self._attention(i, lw, xa, steps, lens, pos)
            with small():
                x = rms_norm(h, lw.ffn_norm, eps)  # [N, H]
                ids, w = route(lw.router, x, k, m.expert_weights_norm, m.expert_weights_scale)
            y = yield i, x, ids, w  # [N, H]; ids, w: [N, k]
            if tuple(y.shape) != tuple(x.shape):
                raise ModelError(
                    f"moe fn returned shape {tuple(y.shape)} for layer {i}, "
                    f"expected {tuple(x.shape)}"
                )
            y = y.to(device=h.device, dtype=h.dtype)
            if lw.shared is not None:
                y = y + _shared_ffn(lw.shared, x)
            h = h + y
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1  # [B]
        with small():
            hl = rms_norm(h[last], self.output_norm, eps)  # [B, H]
        return linear(hl, self.output).float()  # [B, V]

    @staticmethod
    def advance(steps: list[SeqStep]) -> None:
        """Commit a finished pass: each cache now holds its step's tokens."""
        for s in steps:
            s.cache.advance(len(s.tokens))

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
        q = _linear(x, lw.wq, lw.bq).view(n, m.head_count, m.head_dim)  # [N, heads, d]
        kk = _linear(x, lw.wk, lw.bk).view(n, m.head_count_kv, m.head_dim)  # [N, kv, d]
        vv = _linear(x, lw.wv, lw.bv).view(n, m.head_count_kv, m.head_dim)  # [N, kv, d]
        with _small(n)():
            if lw.q_norm is not None and lw.k_norm is not None:  # qwen3moe: per-head norm
                q, kk = rms_norm(q, lw.q_norm, m.rms_eps), rms_norm(kk, lw.k_norm, m.rms_eps)
            q, kk = self.rope(q, pos), self.rope(kk, pos)
        outs, start = [], 0
        with _small(max(lens))():
            for s, t in zip(steps, lens, strict=True):
                keys, values = s.cache.append(layer, kk[start : start + t], vv[start : start + t])
                qs = q[start : start + t]
                outs.append(causal_attention(qs, keys, values, s.cache.length, m.attention_scale))
                start += t
        return linear(torch.cat(outs), lw.wo)  # [N, H]

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
        EOS (if `stop_at_eos`) or when the context is full. Sampling: `kvq.model.generate`."""
        return generate(self, prompt_ids, max_tokens, moe=moe, stop_at_eos=stop_at_eos)


def _linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ b). x: [N, in]; w: [out, in]. Returns [N, out]."""
    y = linear(x, w)  # [N, out]
    return y if b is None else y + b


def _shared_ffn(sh: SharedExpert, x: torch.Tensor) -> torch.Tensor:
    """qwen2moe's shared expert, gated per row by a sigmoid. x: [N, H]. Returns [N, H]."""
    gate = torch.sigmoid(x @ sh.gate_inp)[:, None]  # [N, 1]
    return gate * swiglu(x, sh.gate, sh.up, sh.down)  # [N, H]
