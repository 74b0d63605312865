"""`Attention`: the attention of a backbone's blocks, each sequence against its own cache.

Three kinds, as the weights of a block have them: grouped-query attention (`GqaWeights`: K and V
of each kv head cached, a sliding window, sinks, an output bias and gate where the weights
have them), multi-head latent attention in its absorbed form (`MlaWeights`, `kvq.model.mla`)
and Gated DeltaNet linear attention (`DeltaWeights`, `kvq.model.deltanet`: a recurrent state
per sequence beside the cache). A decode step's rows take one kernel call over every
sequence (`kvq.model.decode_attention`); a speculative pass's rows (`SeqStep.verify`) are each
computed as a decode step at its position would compute them (X17).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.model import deltanet
from kvq.model.cache import KVCache
from kvq.model.decode_attention import decode_attention
from kvq.model.deltanet import DeltaWeights
from kvq.model.layers import (
    Rope,
    attn_temperature,
    causal_attention,
    linear,
    linears,
    rms_norm,
)
from kvq.model.loader import GqaWeights, LayerWeights, MlaWeights, delta_dims
from kvq.model.mla import mla_scales
from kvq.model.qstack import Weight
from kvq.model.rowwise import heads_matmul
from kvq.model.threads import small_block


@dataclass(frozen=True, slots=True)
class Rows:
    """The rows of one pass as attention reads them: `lens[i]` rows for sequence i, whose
    cache is `caches[i]`, at the absolute positions `pos` [N]; `verify`: the sequences of a
    speculative pass (`SeqStep.verify`), each of whose rows is computed as a decode step at
    its position would compute it."""

    caches: list[KVCache]
    lens: list[int]
    pos: torch.Tensor
    verify: frozenset[int] = frozenset()


class Attention:
    """The self-attention of every block of a model with metadata `meta`."""

    def __init__(
        self, meta: ModelMeta, rope_style: str, rope_factors: torch.Tensor | None = None
    ) -> None:
        """`rope_factors` [d/2]: the file's `rope_freqs` (llama4)."""
        self.meta = meta
        rope_mscale, self.mla_kq_scale = mla_scales(meta)
        self.rope = Rope.from_meta(meta, rope_style, rope_mscale, rope_factors)
        # sliding layers may have their own rope base (`rope.freq_base_swa`)
        swa_base = meta.rope_freq_base_swa
        self.rope_swa = (
            Rope.from_meta(replace(meta, rope_freq_base=swa_base), rope_style, None, rope_factors)
            if swa_base and swa_base != meta.rope_freq_base
            else self.rope
        )

    def __call__(self, layer: int, lw: LayerWeights, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Self-attention of the rows `x` [N, H] of layer `layer`, each sequence against its
        own cache. Returns [N, H]."""
        if isinstance(lw.attn, MlaWeights):
            return self._mla(layer, lw.attn, x, rows)
        if isinstance(lw.attn, DeltaWeights):
            return self._delta(layer, lw.attn, x, rows)
        return self._gqa(layer, lw.attn, x, rows)

    def _delta(self, layer: int, w: DeltaWeights, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Gated DeltaNet linear attention (`kvq.model.deltanet`): each sequence's rows run
        from its committed recurrent state (float32), and the state after them is staged for
        `advance` to commit (a speculative pass's: one token at a time as decode steps run,
        the state after each row staged, for `advance` to commit the accepted). x: [N, H]."""
        dims, eps = delta_dims(self.meta), self.meta.rms_eps
        mixed, z, beta, g = deltanet.project(x, w)  # every row of the batch at once
        outs, start = [], 0
        with small_block(max(rows.lens))():
            for i, (c, t) in enumerate(zip(rows.caches, rows.lens, strict=True)):
                state = c.state
                if state is None:
                    raise ModelError(
                        f"layer {layer} is linear attention but the cache has no recurrent "
                        "state; make caches with Backbone.new_cache"
                    )
                conv, ssm = state.get(layer)
                states = []
                each = i in rows.verify
                for r in [(start, t)] if not each else [(start + j, 1) for j in range(t)]:
                    part = slice(r[0], r[0] + r[1])
                    o, conv, ssm = deltanet.recur(
                        mixed[part].float(),
                        beta[part].float(),
                        g[part].float(),
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

    def _gqa(self, layer: int, a: GqaWeights, x: torch.Tensor, rows: Rows) -> torch.Tensor:
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
        with small_block(n)():
            qn, kn = a.q_norm, a.k_norm
            full = qn is not None and qn.shape[0] != m.head_dim
            if full and qn is not None and kn is not None:  # olmoe: over the whole projections
                q, kk = rms_norm(q, qn, eps), rms_norm(kk, kn, eps)
            q = q.view(n, m.head_count, m.head_dim)  # [N, heads, d]
            kk = kk.view(n, m.head_count_kv, m.head_dim)  # [N, kv, d]
            if not full and qn is not None and kn is not None:  # per head
                q, kk = rms_norm(q, qn, eps), rms_norm(kk, kn, eps)
            if m.ropes(layer):
                q, kk = rope(q, rows.pos), rope(kk, rows.pos)
                if m.kq_norm:  # llama4: RMS over each head, no weight, after rope
                    q, kk = rms_norm(q, None, eps), rms_norm(kk, None, eps)
            elif m.attn_temp_floor:  # llama4's NoPE layers: the attention temperature
                temp = attn_temperature(rows.pos, m.attn_temp_floor, m.attn_temp_scale)
                q = q * temp[:, None, None]
        o = self._gqa_rows(layer, a, (q, kk, vv), rows, window)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return _linear(o, a.wo, a.bo)  # [N, H]

    def _gqa_rows(
        self,
        layer: int,
        a: GqaWeights,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rows: Rows,
        window: int,
    ) -> torch.Tensor:
        """Attention of every row: the decoding sequences' (one row each) and a speculative
        pass's (each row at its own position) in one kernel call where it covers the layer,
        the others' each against its cache. A decode row takes the kernel whether or not a
        prompt shares its step (X17: the same bits either way), and so does each row of a
        speculative pass. q [N, heads, d], kk, vv [N, kv, d]. Returns [N, heads * d]."""
        m, (q, kk, vv) = self.meta, qkv
        caches, lens, verify = rows.caches, rows.lens, rows.verify
        if max(lens) == 1 and not verify:  # decode: every sequence at once
            o = decode_attention(q, kk, vv, caches, layer, m.attention_scale, a.sinks)
            return o if o is not None else self._gqa_each(layer, a, qkv, caches, lens, window)
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
            return self._gqa_each(layer, a, qkv, caches, lens, window, verify)
        rest = [i for i, t in enumerate(lens) if t > 1 and i not in verify]
        if not rest:
            return dec
        at = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in rest])
        o = q.new_empty((q.shape[0], dec.shape[1]))  # [N, heads * d]
        o[r] = dec
        cs, ts = [caches[i] for i in rest], [lens[i] for i in rest]
        o[at] = self._gqa_each(layer, a, (q[at], kk[at], vv[at]), cs, ts, window)
        return o

    def _gqa_each(
        self,
        layer: int,
        a: GqaWeights,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        caches: list[KVCache],
        lens: list[int],
        window: int,
        verify: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Each sequence's rows against its own cache (`causal_attention`; a speculative
        pass's rows each as a decode step at its position): q [N, heads, d], kk, vv [N, kv,
        d]. Returns [N, heads * d]."""
        m, (q, kk, vv) = self.meta, qkv
        outs, start = [], 0
        with small_block(max(lens))():
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

    def _mla(self, layer: int, a: MlaWeights, x: torch.Tensor, rows: Rows) -> torch.Tensor:
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
        with small_block(n)():
            ckv = rms_norm(kv[:, :r], a.kv_a_norm, eps)  # [N, r]
            k_pe = self.rope(kv[:, None, r:], rows.pos)  # [N, 1, rope]: one rope key for all heads
            q_pe = self.rope(q[..., nope:], rows.pos)  # [N, heads, rope]
            q_lat = heads_matmul(q[..., :nope].transpose(0, 1), a.wk_b.transpose(1, 2))  # [h, N, r]
            qc = torch.cat((q_lat.transpose(0, 1), q_pe), -1)  # [N, heads, r + rope]
            latent = torch.cat((ckv[:, None, :], k_pe), -1)  # [N, 1, r + rope]
        outs, start = [], 0
        scale = m.attention_scale or self.mla_kq_scale
        with small_block(max(rows.lens))():
            for i, (c, t) in enumerate(zip(rows.caches, rows.lens, strict=True)):
                keys, values = c.append(layer, latent[start : start + t], None)
                qs = qc[start : start + t]
                start += t
                if i not in rows.verify:
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


def _linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ b). x: [N, in]; w: [out, in]. Returns [N, out]."""
    y = linear(x, w)  # [N, out]
    return y if b is None else y + b
