"""The forward pass of the MoE archs kvq serves (see `kvq.gguf.arch`), in torch, with the
routed-expert FFN behind a pluggable MoeFn.

Each block is built from the parts its weights have: GQA or MLA attention (`GqaWeights`,
`MlaWeights`) or Gated DeltaNet linear attention (`DeltaWeights`, qwen35moe: its recurrent
state per sequence beside the KV cache, `KVCache.state`), then a dense FFN (`DenseFfn`:
deepseek2's and glm4moe's leading layers) or the routed experts (`MoeFfn`) with any shared
expert beside them. Token rows of every sequence in a batch are concatenated before the MoE call, so one MoeFn call per MoE layer per forward
covers the whole batch (that call is what gets dispatched to remote expert workers);
attention runs per sequence against that sequence's own KVCache. Shared experts and dense
layers always run here, next to the routed MoeFn.

A backbone may hold only a span of the blocks (stage grain, X12): a stage holder's
(`from_gguf(span=...)`, no embedding or output head: `run_span` turns a stage's input rows into
its output rows) or a stage-grain coordinator's (no block at all: `embed_tokens` and `head`
around the chain of stage holders, `kvq.coordinator.chain`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf.arch import arch_spec
from kvq.gguf.layout import slice_layout
from kvq.gguf.meta import read_meta
from kvq.model import deltanet
from kvq.model.cache import KVCache, SeqStep
from kvq.model.decode_attention import decode_attention
from kvq.model.deltanet import DeltaState, DeltaWeights
from kvq.model.expert_slice import ExpertSlice, map_slice
from kvq.model.experts import expert_forward
from kvq.model.layers import (
    Gating,
    Rope,
    attn_temperature,
    causal_attention,
    linear,
    linears,
    rms_norm,
    swiglu,
)
from kvq.model.loader import (
    DenseFfn,
    GqaWeights,
    LayerWeights,
    Loader,
    MlaWeights,
    delta_dims,
    layer_weights,
    output_weight,
)
from kvq.model.mla import mla_scales
from kvq.model.moe_ffn import MoeCall, moe_ffn
from kvq.model.qstack import QRows, Weight
from kvq.model.rowwise import heads_matmul
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
        rope_mscale, self.mla_kq_scale = mla_scales(meta)
        style = self.spec.rope_style  # rope_factors [d/2]: the file's `rope_freqs` (llama4)
        self.rope = Rope.from_meta(meta, style, rope_mscale, rope_factors)
        # sliding layers may have their own rope base (`rope.freq_base_swa`)
        swa_base = meta.rope_freq_base_swa
        self.rope_swa = (
            Rope.from_meta(replace(meta, rope_freq_base=swa_base), style, None, rope_factors)
            if swa_base and swa_base != meta.rope_freq_base
            else self.rope
        )

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
        with _small(len(h))():
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
        eps = self.meta.rms_eps
        small = _small(len(h))
        for i, lw in zip(self.span, self.layers, strict=True):
            with small():
                xa = rms_norm(h, lw.attn_norm, eps)
            h = h + self._attention(i, lw, xa, caches, lens, pos, verify)
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

    def _attention(
        self,
        layer: int,
        lw: LayerWeights,
        x: torch.Tensor,
        caches: list[KVCache],
        lens: list[int],
        pos: torch.Tensor,
        verify: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Self-attention of all rows, each sequence against its own cache. x: [N, H]."""
        if isinstance(lw.attn, MlaWeights):
            return self._mla(layer, lw.attn, x, caches, lens, pos, verify)
        if isinstance(lw.attn, DeltaWeights):
            return self._delta(layer, lw.attn, x, caches, lens, verify)
        return self._gqa(layer, lw.attn, x, caches, lens, pos, verify)

    def _delta(
        self,
        layer: int,
        w: DeltaWeights,
        x: torch.Tensor,
        caches: list[KVCache],
        lens: list[int],
        verify: frozenset[int],
    ) -> torch.Tensor:
        """Gated DeltaNet linear attention (`kvq.model.deltanet`): each sequence's rows run
        from its committed recurrent state (float32), and the state after them is staged for
        `advance` to commit (a speculative pass's: one token at a time as decode steps run,
        the state after each row staged, for `advance` to commit the accepted). x: [N, H]."""
        dims, eps = delta_dims(self.meta), self.meta.rms_eps
        mixed, z, beta, g = deltanet.project(x, w)  # every row of the batch at once
        outs, start = [], 0
        with _small(max(lens))():
            for i, (c, t) in enumerate(zip(caches, lens, strict=True)):
                state = c.state
                if state is None:
                    raise ModelError(
                        f"layer {layer} is linear attention but the cache has no recurrent "
                        "state; make caches with Backbone.new_cache"
                    )
                conv, ssm = state.get(layer)
                states = []
                for r in [(start, t)] if i not in verify else [(start + j, 1) for j in range(t)]:
                    rows = slice(r[0], r[0] + r[1])
                    o, conv, ssm = deltanet.recur(
                        mixed[rows].float(),
                        beta[rows].float(),
                        g[rows].float(),
                        w,
                        dims,
                        conv,
                        ssm,
                        eps,
                    )
                    states.append((conv, ssm))
                    outs.append(o)
                state.stage_rows(layer, states)
                start += t
        return deltanet.output(torch.cat(outs).to(z.dtype), z, w, dims, eps)  # [N, H]

    def _gqa(
        self,
        layer: int,
        a: GqaWeights,
        x: torch.Tensor,
        caches: list[KVCache],
        lens: list[int],
        pos: torch.Tensor,
        verify: frozenset[int],
    ) -> torch.Tensor:
        """Grouped-query attention (K and V of each kv head cached; only the window's on a
        sliding layer), with sinks, an output bias and an output gate (qwen35moe: each head's
        output times sigmoid(gate)) where the weights have them. x: [N, H]."""
        m, n, eps = self.meta, x.shape[0], self.meta.rms_eps
        window = m.window(layer)
        rope = self.rope_swa if window else self.rope
        ys = linears(x, [a.wq, a.wk, a.wv])  # one kernel call for a decode step's row
        q, kk, v = (y if b is None else y + b for y, b in zip(ys, (a.bq, a.bk, a.bv), strict=True))
        gate = None  # q [N, heads*d], kk [N, kv*d], v [N, kv*d]
        if a.gated:  # qwen35moe: per head d values of q, then d of the output gate
            qg = q.view(n, m.head_count, 2, m.head_dim)
            q, gate = qg[:, :, 0].reshape(n, -1), qg[:, :, 1].reshape(n, -1)  # [N, heads*d]
        vv = v.view(n, m.head_count_kv, m.head_dim)  # [N, kv, d]
        with _small(n)():
            qn, kn = a.q_norm, a.k_norm
            full = qn is not None and qn.shape[0] != m.head_dim
            if full and qn is not None and kn is not None:  # olmoe: over the whole projections
                q, kk = rms_norm(q, qn, eps), rms_norm(kk, kn, eps)
            q = q.view(n, m.head_count, m.head_dim)  # [N, heads, d]
            kk = kk.view(n, m.head_count_kv, m.head_dim)  # [N, kv, d]
            if not full and qn is not None and kn is not None:  # per head
                q, kk = rms_norm(q, qn, eps), rms_norm(kk, kn, eps)
            if m.ropes(layer):
                q, kk = rope(q, pos), rope(kk, pos)
                if m.kq_norm:  # llama4: RMS over each head, no weight, after rope
                    q, kk = rms_norm(q, None, eps), rms_norm(kk, None, eps)
            elif m.attn_temp_floor:  # llama4's NoPE layers: the attention temperature
                q = q * attn_temperature(pos, m.attn_temp_floor, m.attn_temp_scale)[:, None, None]
        o = self._gqa_rows(layer, a, q, kk, vv, caches, lens, window, verify)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return _linear(o, a.wo, a.bo)  # [N, H]

    def _gqa_rows(
        self,
        layer: int,
        a: GqaWeights,
        q: torch.Tensor,
        kk: torch.Tensor,
        vv: torch.Tensor,
        caches: list[KVCache],
        lens: list[int],
        window: int,
        verify: frozenset[int],
    ) -> torch.Tensor:
        """Attention of every row: the decoding sequences' (one row each) and a speculative
        pass's (each row at its own position) in one kernel call where it covers the layer,
        the others' each against its cache. A decode row takes the kernel whether or not a
        prompt shares its step (X17: the same bits either way), and so does each row of a
        speculative pass. q [N, heads, d], kk, vv [N, kv, d]. Returns [N, heads * d]."""
        m = self.meta
        if max(lens) == 1 and not verify:  # decode: every sequence at once
            o = decode_attention(q, kk, vv, caches, layer, m.attention_scale, a.sinks)
            return o if o is not None else self._gqa_each(layer, a, q, kk, vv, caches, lens, window)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        one = [i for i, t in enumerate(lens) if t == 1 or i in verify]
        dec = None
        if one:
            r = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in one])  # [D]
            sub = [caches[i] for i in one for _ in range(lens[i])]
            ahead = [j for i in one for j in range(lens[i])]
            dec = decode_attention(
                q[r], kk[r], vv[r], sub, layer, m.attention_scale, a.sinks, ahead
            )
        if dec is None:
            return self._gqa_each(layer, a, q, kk, vv, caches, lens, window, verify)
        rest = [i for i, t in enumerate(lens) if t > 1 and i not in verify]
        if not rest:
            return dec
        rows = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in rest])
        o = q.new_empty((q.shape[0], dec.shape[1]))  # [N, heads * d]
        o[r] = dec
        cs, ts = [caches[i] for i in rest], [lens[i] for i in rest]
        o[rows] = self._gqa_each(layer, a, q[rows], kk[rows], vv[rows], cs, ts, window)
        return o

    def _gqa_each(
        self,
        layer: int,
        a: GqaWeights,
        q: torch.Tensor,
        kk: torch.Tensor,
        vv: torch.Tensor,
        caches: list[KVCache],
        lens: list[int],
        window: int,
        verify: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Each sequence's rows against its own cache (`causal_attention`; a speculative
        pass's rows each as a decode step at its position): q [N, heads, d], kk, vv [N, kv,
        d]. Returns [N, heads * d]."""
        m = self.meta
        outs, start = [], 0
        with _small(max(lens))():
            for i, (c, t) in enumerate(zip(caches, lens, strict=True)):
                kt, vt, k0 = kk[start : start + t], vv[start : start + t], 0
                if window:
                    keys, values, k0 = c.append_window(layer, kt, vt)
                else:
                    keys, values = c.append(layer, kt, vt)
                if i in verify:
                    qs = q[start : start + t]
                    outs.append(self._as_decode(layer, a, qs, keys, values, c.length, k0, window))
                    start += t
                    continue
                outs.append(
                    causal_attention(
                        q[start : start + t],
                        keys,
                        values,
                        c.length,
                        m.attention_scale,
                        a.sinks,
                        window,
                        k0,
                        m.chunk(layer),
                    )
                )
                start += t
        return torch.cat(outs)  # [N, heads*d]

    def _as_decode(
        self,
        layer: int,
        a: GqaWeights,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        length: int,
        k0: int,
        window: int,
    ) -> torch.Tensor:
        """A speculative pass's rows q [T, heads, d] at positions length.., each attending
        as a decode step there would: to the keys [S, kv, d] from position k0 up to its own
        (a sliding layer's: its window, gathered afresh as `append_window` gathers it).
        Returns [T, heads * d]."""
        m, outs = self.meta, []
        for j in range(q.shape[0]):
            p = length + j
            lo = max(0, p - window + 1) - k0 if window else 0
            kj, vj = keys[lo : p - k0 + 1], values[lo : p - k0 + 1]
            if window:
                kj, vj = kj.clone(), vj.clone()
            sc = m.attention_scale
            o = causal_attention(
                q[j : j + 1], kj, vj, p, sc, a.sinks, window, k0 + lo, m.chunk(layer)
            )
            outs.append(o)
        return torch.cat(outs)

    def _mla(
        self,
        layer: int,
        a: MlaWeights,
        x: torch.Tensor,
        caches: list[KVCache],
        lens: list[int],
        pos: torch.Tensor,
        verify: frozenset[int],
    ) -> torch.Tensor:
        """Multi-head latent attention in its absorbed form (`kvq.model.mla`): the cache holds
        one latent per token, `[c_kv ; k_pe]` (r + rope values), never per-head K and V.
        x: [N, H]."""
        m, n, eps = self.meta, x.shape[0], self.meta.rms_eps
        heads, r, rope = m.head_count, m.kv_lora_rank, m.rope_dims
        nope = m.head_dim - rope
        q_in = (
            x
            if a.wq_a is None or a.q_a_norm is None
            else rms_norm(linear(x, a.wq_a), a.q_a_norm, eps)
        )
        q = linear(q_in, a.wq).view(n, heads, m.head_dim)  # [N, heads, nope + rope]
        kv = linear(x, a.wkv_a)  # [N, r + rope]
        with _small(n)():
            ckv = rms_norm(kv[:, :r], a.kv_a_norm, eps)  # [N, r]
            k_pe = self.rope(kv[:, None, r:], pos)  # [N, 1, rope]: one rope key for all heads
            q_pe = self.rope(q[..., nope:], pos)  # [N, heads, rope]
            q_lat = heads_matmul(q[..., :nope].transpose(0, 1), a.wk_b.transpose(1, 2))  # [h, N, r]
            qc = torch.cat((q_lat.transpose(0, 1), q_pe), -1)  # [N, heads, r + rope]
            latent = torch.cat((ckv[:, None, :], k_pe), -1)  # [N, 1, r + rope]
        outs, start = [], 0
        scale = m.attention_scale or self.mla_kq_scale
        with _small(max(lens))():
            for i, (c, t) in enumerate(zip(caches, lens, strict=True)):
                keys, values = c.append(layer, latent[start : start + t], None)
                qs = qc[start : start + t]
                start += t
                if i not in verify:
                    outs.append(causal_attention(qs, keys, values, c.length, scale))
                    continue
                for j in range(t):  # each row as a decode step at its position would read
                    end = c.length + j + 1
                    outs.append(
                        causal_attention(qs[j : j + 1], keys[:end], values[:end], end - 1, scale)
                    )
            o = torch.cat(outs).view(n, heads, r).transpose(0, 1)  # [heads, N, r]
            ov = heads_matmul(o, a.wv_b.transpose(1, 2)).transpose(0, 1)  # [N, heads, v]
        return linear(ov.reshape(n, heads * m.value_head_dim), a.wo)  # [N, H]

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


def _linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ b). x: [N, in]; w: [out, in]. Returns [N, out]."""
    y = linear(x, w)  # [N, out]
    return y if b is None else y + b
