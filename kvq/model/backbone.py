"""The forward pass of the MoE archs kvq serves (see `kvq.gguf.arch`), in torch, with the
routed-expert FFN behind a pluggable MoeFn.

Each block is built from the parts its weights have: GQA or MLA attention (`GqaWeights`,
`MlaWeights`) or Gated DeltaNet linear attention (`DeltaWeights`, qwen35moe: its recurrent
state per sequence beside the KV cache, `KVCache.state`), then a dense FFN (`DenseFfn`:
deepseek2's and glm4moe's leading layers) or the routed experts (`MoeFfn`) with any shared
expert beside them. Token rows of every sequence in a batch are concatenated before the MoE
call, so one MoeFn call per MoE layer per forward covers the whole batch (that call is what gets
dispatched to remote expert workers); attention (`kvq.model.attention`) runs per sequence
against that sequence's own KVCache. Shared experts and dense
layers always run here, next to the routed MoeFn.

A backbone may hold only a span of the blocks (stage grain, X12): a stage holder's
(`from_gguf(span=...)`, no embedding or output head: `run_span` turns a stage's input rows into
its output rows) or a stage-grain coordinator's (no block at all: `embed_tokens` and `head`
around the chain of stage holders, `kvq.coordinator.chain`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from pathlib import Path

import torch

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf.arch import arch_spec
from kvq.gguf.layout import slice_layout
from kvq.gguf.meta import read_meta
from kvq.model.attention import Attention, Rows
from kvq.model.cache import KVCache, SeqStep
from kvq.model.deltanet import DeltaState
from kvq.model.expert_slice import ExpertSlice, map_slice
from kvq.model.experts import expert_forward
from kvq.model.layers import Gating, linear, rms_norm, swiglu
from kvq.model.loader import (
    DenseFfn,
    LayerWeights,
    Loader,
    delta_dims,
    layer_weights,
    output_weight,
)
from kvq.model.moe_ffn import MoeCall, moe_ffn
from kvq.model.qstack import QRows, Weight
from kvq.model.threads import small_block

__all__ = ["Backbone", "KVCache", "LayerCalls", "LayerWeights", "MoeCall", "MoeFn", "SeqStep"]

# (layer, x [T, H] after ffn_norm, topk_ids [T, k] int64, topk_w [T, k] float32) -> [T, H]
# (llama4: x [T*k, H] scaled by the weights, one expert per row: `kvq.model.moe_ffn`)
MoeFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LayerCalls = Generator[MoeCall, torch.Tensor, torch.Tensor]  # see Backbone.layer_calls


class Backbone:
    """Weights and forward pass of a supported MoE model (experts held locally for `moe=None`)."""

    def __init__(
        self,
        meta: ModelMeta,
        embed: torch.Tensor | QRows | None,
        layers: list[LayerWeights],
        output_norm: torch.Tensor,
        output: Weight | None,
        experts: dict[int, ExpertSlice],
        rope_factors: torch.Tensor | None = None,
        first_layer: int = 0,
    ) -> None:
        """`layers`: blocks `first_layer`, `first_layer + 1`, ... (all of them, or a stage's
        span); `embed` and `output` None: a stage holder's backbone, which has no head."""
        self.meta = meta
        self.embed = embed  # [V, H]
        self.layers = layers
        self.span = range(first_layer, first_layer + len(layers))  # the blocks held
        self.output_norm = output_norm  # [H]
        self.output = output  # [V, H]
        self.experts = experts  # experts[layer] covers all experts of that MoE layer
        self.device = output_norm.device
        self.dtype = output_norm.dtype
        self.spec = arch_spec(meta.arch)
        self.gating = Gating.from_meta(meta)
        self.attention = Attention(meta, self.spec.rope_style, rope_factors)

    @classmethod
    def from_gguf(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        meta: ModelMeta | None = None,
        span: range | None = None,
        head: bool = True,
    ) -> Backbone:
        """Map a GGUF model: every expert, the token embedding and each weight matrix a kernel
        computes kept in their encoding (memory-mapped: read on use); the rest dequantized
        once into `dtype`. `meta`: the file's `read_meta`, if the caller has it already.
        `span`: only these blocks (a stage, X12; `range(0)`: none); `head` False: no
        embedding or output head (a stage holder's file need not hold them)."""
        m = meta or read_meta(path)  # validates arch, tensors, quant types before any weight
        load = Loader(path, device, dtype)
        spec, h, e = arch_spec(m.arch), m.embedding_length, m.expert_count
        span = range(m.block_count) if span is None else span
        if span.step != 1 or not 0 <= span.start <= span.stop <= m.block_count:
            raise ModelError(f"span {span} is not a range of the model's {m.block_count} blocks")
        layers = [layer_weights(load, m, spec, i) for i in span]
        experts = {
            i: map_slice(path, slice_layout(m, i, 0, e), i, 0, e, dtype, m.expert_act).to(device)
            for i in (m.moe_layers if m.holds_experts else ())
            if i in span
        }  # a backbone file (`kvq model split --backbone`) holds none: workers compute them
        embed = load.rows("token_embd.weight", (m.vocab_size, h)) if head else None
        output = output_weight(load, m) if head else None
        factors = (
            load.optional("rope_freqs.weight", (m.rope_dims // 2,)) if spec.rope_freqs else None
        )
        norm = load("output_norm.weight", (h,)) if head else torch.ones(h, dtype=dtype).to(device)
        return cls(m, embed, layers, norm, output, experts, factors, span.start)

    def new_cache(self, initial: int = 256) -> KVCache:
        """An empty KV cache that grows up to the model's context length (from `initial`
        positions, doubling), with a zero recurrent state beside it for the linear-attention
        layers (if any)."""
        m = self.meta
        kv, width = m.cache_width
        rec = m.recurrent_layers
        # float32 whatever the compute dtype, as llama.cpp keeps it: the state sums every
        # token of the sequence, so bfloat16 rounding would build up along it
        rec = [i for i in rec if i in self.span]
        state = DeltaState(rec, delta_dims(m), self.device, torch.float32) if rec else None
        return KVCache(
            m.block_count,
            m.context_length,
            kv,
            width,
            self.device,
            self.dtype,
            latent_values=m.kv_lora_rank,
            windows=[m.window(i) for i in range(m.block_count)],
            state=state,
            held=self.span,
            initial=initial,
        )

    def local_moe(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """MoeFn computing all of `layer`'s experts locally in one call: the bits of any
        other placement of its experts (`kvq.model.moe_sum`)."""
        sl = self.experts.get(layer)
        if sl is None:
            raise ModelError(no_experts_message(layer))
        return expert_forward(sl, x, ids, w)

    @torch.no_grad()
    def forward(self, steps: list[SeqStep], moe: MoeFn | None = None) -> torch.Tensor:
        """Run the new tokens of every step; return float32 logits [len(steps), vocab] at
        each sequence's last new position (at each of its positions for a `verify` step: a
        row per token, in step order). Caches advance only if the whole pass succeeds; a
        `verify` step's not at all: its caller advances it by the rows it accepts."""
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
        lens = self.check_steps(steps)
        h = self.embed_tokens([t for s in steps for t in s.tokens])  # [N, H]
        caches = [s.cache for s in steps]
        verify = frozenset(i for i, s in enumerate(steps) if s.verify)
        h = yield from self._blocks(h, caches, lens, verify)
        return self.head(h, lens, verify)

    def embed_tokens(self, tokens: list[int]) -> torch.Tensor:
        """The embedding rows of `tokens` [N], as the first block reads them. Returns [N, H]."""
        if self.embed is None:
            raise ModelError("this backbone is a stage holder's: it has no token embedding")
        return self.embed[torch.tensor(tokens, device=self.device)]  # [N, H]

    def head(
        self, h: torch.Tensor, lens: list[int], every: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        """The float32 logits [B, V] at each sequence's last row of `h` [N, H] (`lens`: rows
        per sequence, in order), and at every row of the sequences in `every` (a speculative
        pass's: `lens[i]` rows for sequence i, in order; each row's bits those it gets alone)."""
        if self.output is None:
            raise ModelError("this backbone is a stage holder's: it has no output head")
        ends = torch.tensor(lens, device=self.device).cumsum(0)  # [B]
        last = torch.cat(
            [
                torch.arange(int(e) - n if i in every else int(e) - 1, int(e))
                for i, (e, n) in enumerate(zip(ends, lens, strict=True))
            ]
        ).to(self.device)  # [R]
        with small_block(len(h))():
            hl = rms_norm(h[last], self.output_norm, self.meta.rms_eps)  # [B, H]
        return linear(hl, self.output).float()  # [B, V]

    @torch.no_grad()
    def run_span(self, h: torch.Tensor, caches: list[KVCache], lens: list[int]) -> torch.Tensor:
        """The held blocks over `h` [N, H], the rows entering the span (`lens[i]` of them
        for sequence i, whose cache holds its earlier positions), with the experts held here;
        returns the rows leaving it [N, H]. The caches are filled but not advanced (the
        caller commits with `advance_caches` once the whole pass is done)."""
        if len({id(c) for c in caches}) != len(caches):
            raise ModelError("two sequences of one pass share a KVCache; give each its own")
        for c, n in zip(caches, lens, strict=True):
            c.check_room(n)
        calls = self._blocks(h, caches, lens)
        try:
            call = next(calls)
            while True:
                call = calls.send(self.local_moe(*call))
        except StopIteration as done:
            out: torch.Tensor = done.value
        return out

    def _blocks(
        self,
        h: torch.Tensor,
        caches: list[KVCache],
        lens: list[int],
        verify: frozenset[int] = frozenset(),
    ) -> LayerCalls:
        """The held blocks over `h` [N, H] as a generator of MoE calls (`layer_calls`);
        `verify`: the sequences whose rows are computed as decode steps would compute them
        (a speculative pass, `SeqStep.verify`)."""
        for c in caches:
            c.begin()
        pos = torch.cat(
            [
                torch.arange(c.length, c.length + n, device=self.device)
                for c, n in zip(caches, lens, strict=True)
            ]
        )  # [N] absolute position of each row
        rows = Rows(caches, lens, pos, verify)
        eps = self.meta.rms_eps
        small = small_block(len(h))
        for i, lw in zip(self.span, self.layers, strict=True):
            with small():
                xa = rms_norm(h, lw.attn_norm, eps)
            h = h + self.attention(i, lw, xa, rows)
            with small():
                x = rms_norm(h, lw.ffn_norm, eps)  # [N, H]
            ffn = lw.ffn
            if isinstance(ffn, DenseFfn):
                h = h + swiglu(x, ffn.gate, ffn.up, ffn.down)
                continue
            h = h + (yield from moe_ffn(i, ffn, x, self.gating, self.spec.scale_input, small))
        return h

    @staticmethod
    def advance(steps: list[SeqStep]) -> None:
        """Commit a finished pass: each cache now holds its step's tokens (a `verify`
        step's caller commits the rows it accepts)."""
        for s in steps:
            if not s.verify:
                s.cache.advance(len(s.tokens))

    @staticmethod
    def advance_caches(caches: list[KVCache], lens: list[int]) -> None:
        """Commit a finished `run_span`: each cache now holds its rows' positions."""
        for c, n in zip(caches, lens, strict=True):
            c.advance(n)

    def check_steps(self, steps: list[SeqStep]) -> list[int]:
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


def no_experts_message(layer: int) -> str:
    return (
        f"layer {layer}'s routed experts are not in this file: it is a backbone file (kvq "
        "model split --backbone), whose experts only workers compute; run `kvq generate` on "
        "the full model, or serve this file with `kvq coordinator` and workers"
    )
