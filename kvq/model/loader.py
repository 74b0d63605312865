"""The dense (non-routed) weights of a GGUF model in torch, read through a memory map.

Weight matrices stay encoded and mapped (`QMatrix`) wherever a fused kernel computes their
type on this device (`kvq.quant.kernels`: CPU, float32); the others are dequantized once, at
load, into the compute dtype. Vectors, norms and the router are always dequantized (small).
The token embedding stays encoded and is dequantized a few rows at a time (`QRows`), since a
step only ever reads the rows of its tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import ReaderTensor

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf import reader as gio
from kvq.gguf.arch import MLA, QK_FULL, QK_HEAD, SHARED_GATED, ArchSpec
from kvq.model.deltanet import DeltaDims, DeltaWeights
from kvq.model.qstack import FileMap, QMatrix, QRows, Weight
from kvq.quant import dequantize, kernels


@dataclass
class SharedExpert:
    """The always-on expert(s) of a MoE layer: `down(silu(gate x) * up x)`, gated per token by
    `sigmoid(x . gate_inp)` where the arch has that gate (qwen2moe), else added as is."""

    gate: Weight  # [Fs, H]
    up: Weight  # [Fs, H]
    down: Weight  # [H, Fs]
    gate_inp: torch.Tensor | None = None  # [H]


@dataclass
class GqaWeights:
    """Grouped-query attention (MHA when kv heads = heads); optional parts are None."""

    wq: Weight  # [heads*d, H]
    wk: Weight  # [kv*d, H]
    wv: Weight  # [kv*d, H]
    wo: Weight  # [H, heads*d]
    q_norm: torch.Tensor | None = None  # [d] per head, or [heads*d] over the whole q
    k_norm: torch.Tensor | None = None  # [d] per head, or [kv*d] over the whole k
    bq: torch.Tensor | None = None  # [heads*d]
    bk: torch.Tensor | None = None  # [kv*d]
    bv: torch.Tensor | None = None  # [kv*d]
    bo: torch.Tensor | None = None  # [H]
    sinks: torch.Tensor | None = None  # [heads]: each head's sink logit (gpt-oss)
    gated: bool = False  # wq is [heads*2d, H]: per head q then an output gate (qwen35moe)


@dataclass
class MlaWeights:
    """DeepSeek's multi-head latent attention (dk = nope + rope per head, r = kv_lora_rank).

    k_b and v_b are kept per head as the absorbed form computes with them: queries are taken
    into the latent space through k_b, attention runs against the cached latent, and v_b
    takes each head's result out of it. Files from older converters store the two as one
    `attn_kv_b`; the loader splits it."""

    wq: Weight  # [heads*dk, q_lora] after q_a and its norm, or [heads*dk, H] with no LoRA
    wkv_a: Weight  # [r + rope, H]: the latent and the shared rope key
    kv_a_norm: torch.Tensor  # [r]
    wk_b: torch.Tensor  # [heads, r, nope]
    wv_b: torch.Tensor  # [heads, v, r]
    wo: Weight  # [H, heads*v]
    wq_a: Weight | None = None  # [q_lora, H]
    q_a_norm: torch.Tensor | None = None  # [q_lora]


@dataclass
class MoeFfn:
    """The router of a MoE layer and what runs beside the routed experts."""

    router: torch.Tensor  # [E, H]
    probs_bias: torch.Tensor | None = None  # [E]: added to the scores for the choice only
    router_bias: torch.Tensor | None = None  # [E]: added to the logits (gpt-oss)
    shared: SharedExpert | None = None


@dataclass
class DenseFfn:
    """The SwiGLU FFN of a dense layer (deepseek2's and glm4moe's leading layers)."""

    gate: Weight  # [F, H]
    up: Weight  # [F, H]
    down: Weight  # [H, F]


@dataclass
class LayerWeights:
    """Dense weights of one block, numpy/torch order [out, in]."""

    attn_norm: torch.Tensor  # [H]
    attn: GqaWeights | MlaWeights | DeltaWeights
    ffn_norm: torch.Tensor  # [H]
    ffn: MoeFfn | DenseFfn


class Loader:
    """Dequantizes named, shape-checked tensors of one GGUF file into torch."""

    def __init__(self, path: str | Path, device: str | torch.device, dtype: torch.dtype) -> None:
        self.path = str(path)
        self.tensors = gio.tensor_map(gio.open_reader(path))
        self.device = device
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor `name` dequantized into the compute dtype, checked against `shape`."""
        t, got = self._find(name, shape)
        raw = self._raw(t)
        rows = int(math.prod(got[:-1])) if len(got) > 1 else 1
        dense = dequantize(raw, int(t.tensor_type), (rows, got[-1]), torch.float32)
        return dense.reshape(shape).to(device=self.device, dtype=self.dtype)

    def matrix(self, name: str, shape: tuple[int, int]) -> Weight:
        """Weight matrix `name`: encoded and mapped where a kernel computes it, else dense."""
        t, _ = self._find(name, shape)
        qtype = int(t.tensor_type)
        if not kernels.keeps_encoded(qtype, self.device, self.dtype):
            return self(name, shape)
        return QMatrix(self._raw(t).reshape(shape[0], -1), qtype, shape)

    def _find(self, name: str, shape: tuple[int, ...]) -> tuple[ReaderTensor, tuple[int, ...]]:
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(
                f"tensor {name!r} is missing from {self.path!r}; the file is incomplete"
            )
        got = gio.numpy_shape(t)
        # a vector may be stored as [1, n] (e.g. ffn_gate_inp_shexp); the values are the same
        if tuple(d for d in got if d != 1) != tuple(d for d in shape if d != 1):
            raise ModelError(f"tensor {name!r} has shape {got}, expected {shape}")
        return t, got

    def rows(self, name: str, shape: tuple[int, int]) -> QRows:
        """Matrix `name` kept encoded (mapped), for row lookups."""
        t = self.tensors.get(name)
        if t is None or gio.numpy_shape(t) != shape:
            raise ModelError(f"tensor {name!r} is missing from {self.path!r} or not {shape}")
        raw = self._raw(t).reshape(shape[0], -1).to(self.device)
        return QRows(raw, int(t.tensor_type), shape, self.dtype)

    def _raw(self, t: ReaderTensor) -> torch.Tensor:
        """The tensor's encoded bytes, aliasing a memory map of the file (no copy)."""
        gio.check_supported(int(t.tensor_type), t.name)
        shape = gio.numpy_shape(t)
        nbytes = gio.nbytes_for(int(t.tensor_type), shape)
        if int(t.n_bytes) != nbytes:
            raise ModelError(
                f"tensor {t.name!r}: {int(t.n_bytes)} bytes do not hold a "
                f"{gio.quant_type(int(t.tensor_type)).name} tensor of shape {shape}"
            )
        return FileMap.bytes_of(self.path, int(t.data_offset), nbytes)

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self(name, shape) if self.has(name) else None


def layer_weights(load: Loader, m: ModelMeta, spec: ArchSpec, i: int) -> LayerWeights:
    """The dense weights of block `i` (attention, norms, router, shared or dense FFN)."""
    h, p = m.embedding_length, f"blk.{i}."
    attn: GqaWeights | MlaWeights | DeltaWeights
    if i in m.recurrent_layers:
        attn = _delta(load, m, p)
    else:
        attn = _mla(load, m, p) if spec.attention == MLA else _gqa(load, m, spec, p)
    ffn: MoeFfn | DenseFfn
    if i in m.moe_layers:
        ffn = MoeFfn(
            router=load(p + "ffn_gate_inp.weight", (m.expert_count, h)),
            probs_bias=load.optional(p + "exp_probs_b.bias", (m.expert_count,)),
            router_bias=(load if spec.router_bias else load.optional)(
                p + "ffn_gate_inp.bias", (m.expert_count,)
            ),
            shared=_shared_expert(load, m, spec, p) if spec.shared_expert else None,
        )
    else:
        f = m.feed_forward_length
        ffn = DenseFfn(
            gate=load.matrix(p + "ffn_gate.weight", (f, h)),
            up=load.matrix(p + "ffn_up.weight", (f, h)),
            down=load.matrix(p + "ffn_down.weight", (h, f)),
        )
    return LayerWeights(
        attn_norm=load(p + "attn_norm.weight", (h,)),
        attn=attn,
        ffn_norm=load(p + spec.ffn_norm + ".weight", (h,)),
        ffn=ffn,
    )


def _gqa(load: Loader, m: ModelMeta, spec: ArchSpec, p: str) -> GqaWeights:
    h, d = m.embedding_length, m.head_dim
    q_out, kv_out = m.head_count * d, m.head_count_kv * d
    q_rows = 2 * q_out if spec.gated_q else q_out
    bias = load if spec.qkv_bias else load.optional
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    if spec.qk_norm == QK_FULL:
        q_norm = load(p + "attn_q_norm.weight", (q_out,))
        k_norm = load(p + "attn_k_norm.weight", (kv_out,))
    else:  # per head: required where the arch has it, else used where the file has it
        norm = load if spec.qk_norm == QK_HEAD else load.optional
        q_norm, k_norm = norm(p + "attn_q_norm.weight", (d,)), norm(p + "attn_k_norm.weight", (d,))
    return GqaWeights(
        wq=load.matrix(p + "attn_q.weight", (q_rows, h)),
        wk=load.matrix(p + "attn_k.weight", (kv_out, h)),
        wv=load.matrix(p + "attn_v.weight", (kv_out, h)),
        wo=load.matrix(p + "attn_output.weight", (h, q_out)),
        q_norm=q_norm,
        k_norm=k_norm,
        bq=bias(p + "attn_q.bias", (q_out,)),
        bk=bias(p + "attn_k.bias", (kv_out,)),
        bv=bias(p + "attn_v.bias", (kv_out,)),
        bo=(load if spec.out_bias else load.optional)(p + "attn_output.bias", (h,)),
        sinks=load(p + "attn_sinks.weight", (m.head_count,)) if spec.attn_sinks else None,
        gated=spec.gated_q,
    )


def delta_dims(m: ModelMeta) -> DeltaDims:
    return DeltaDims(m.ssm_group_count, m.ssm_time_step_rank, m.ssm_state_size, m.ssm_conv_kernel)


def _delta(load: Loader, m: ModelMeta, p: str) -> DeltaWeights:
    """A Gated DeltaNet layer's weights (llama.cpp's names; `ssm_a` is -exp(A_log))."""
    h, dd = m.embedding_length, delta_dims(m)
    c, hv, vd = dd.channels, dd.v_heads, dd.value_dim
    return DeltaWeights(
        wqkv=load.matrix(p + "attn_qkv.weight", (c, h)),
        wgate=load.matrix(p + "attn_gate.weight", (vd, h)),
        conv=load(p + "ssm_conv1d.weight", (c, dd.conv)),
        dt_bias=load(p + "ssm_dt.bias", (hv,)),
        a=load(p + "ssm_a", (hv,)),
        wbeta=load.matrix(p + "ssm_beta.weight", (hv, h)),
        walpha=load.matrix(p + "ssm_alpha.weight", (hv, h)),
        norm=load(p + "ssm_norm.weight", (dd.head_dim,)),
        wout=load.matrix(p + "ssm_out.weight", (h, vd)),
    )


def _mla(load: Loader, m: ModelMeta, p: str) -> MlaWeights:
    h, heads, dk, v = m.embedding_length, m.head_count, m.head_dim, m.value_head_dim
    r, rope = m.kv_lora_rank, m.rope_dims
    nope = dk - rope
    if m.q_lora_rank:
        wq_a = load.matrix(p + "attn_q_a.weight", (m.q_lora_rank, h))
        q_a_norm = load(p + "attn_q_a_norm.weight", (m.q_lora_rank,))
        wq = load.matrix(p + "attn_q_b.weight", (heads * dk, m.q_lora_rank))
    else:
        wq_a, q_a_norm = None, None
        wq = load.matrix(p + "attn_q.weight", (heads * dk, h))
    if load.has(p + "attn_k_b.weight"):  # split by a recent converter, k_b transposed
        wk_b = load(p + "attn_k_b.weight", (heads, r, nope))
        wv_b = load(p + "attn_v_b.weight", (heads, v, r))
    else:  # one kv_b: per head, nope rows of k then v rows of v, over the latent
        kv_b = load(p + "attn_kv_b.weight", (heads * (nope + v), r)).view(heads, nope + v, r)
        wk_b = kv_b[:, :nope].transpose(1, 2).contiguous()  # [heads, r, nope]
        wv_b = kv_b[:, nope:].contiguous()  # [heads, v, r]
    return MlaWeights(
        wq=wq,
        wkv_a=load.matrix(p + "attn_kv_a_mqa.weight", (r + rope, h)),
        kv_a_norm=load(p + "attn_kv_a_norm.weight", (r,)),
        wk_b=wk_b,
        wv_b=wv_b,
        wo=load.matrix(p + "attn_output.weight", (h, heads * v)),
        wq_a=wq_a,
        q_a_norm=q_a_norm,
    )


def _shared_expert(load: Loader, m: ModelMeta, spec: ArchSpec, p: str) -> SharedExpert:
    h, f = m.embedding_length, m.expert_shared_feed_forward_length
    if f <= 0:
        raise ModelError(
            f"{m.arch} needs a shared expert but its width is unknown: the file has neither "
            f"{m.arch}.expert_shared_feed_forward_length nor an ffn_up_shexp tensor"
        )
    gated = spec.shared == SHARED_GATED
    return SharedExpert(
        gate=load.matrix(p + "ffn_gate_shexp.weight", (f, h)),
        up=load.matrix(p + "ffn_up_shexp.weight", (f, h)),
        down=load.matrix(p + "ffn_down_shexp.weight", (h, f)),
        gate_inp=load(p + "ffn_gate_inp_shexp.weight", (h,)) if gated else None,
    )


def output_weight(load: Loader, m: ModelMeta) -> Weight:
    """`output.weight`, or the token embedding when the file ties them (no output tensor)."""
    name = "output.weight" if load.has("output.weight") else "token_embd.weight"
    return load.matrix(name, (m.vocab_size, m.embedding_length))
