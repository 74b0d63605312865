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

from kvq.errors import ModelError
from kvq.model import gguf_io as gio
from kvq.model.arch import ArchSpec
from kvq.model.meta import ModelMeta
from kvq.model.qstack import FileMap, QMatrix, QRows, Weight
from kvq.quant import dequantize, kernels


@dataclass
class SharedExpert:
    """qwen2moe's always-on expert: `sigmoid(x . gate_inp) * down(silu(gate x) * up x)`."""

    gate: Weight  # [Fs, H]
    up: Weight  # [Fs, H]
    down: Weight  # [H, Fs]
    gate_inp: torch.Tensor  # [H]


@dataclass
class LayerWeights:
    """Dense weights of one block, numpy/torch order [out, in]; optional parts are None."""

    attn_norm: torch.Tensor  # [H]
    wq: Weight  # [heads*d, H]
    wk: Weight  # [kv*d, H]
    wv: Weight  # [kv*d, H]
    wo: Weight  # [H, heads*d]
    ffn_norm: torch.Tensor  # [H]
    router: torch.Tensor  # [E, H]
    q_norm: torch.Tensor | None = None  # [d]
    k_norm: torch.Tensor | None = None  # [d]
    bq: torch.Tensor | None = None  # [heads*d]
    bk: torch.Tensor | None = None  # [kv*d]
    bv: torch.Tensor | None = None  # [kv*d]
    shared: SharedExpert | None = None


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
    """The dense weights of block `i` (attention, norms, router, shared expert)."""
    h, p, d = m.embedding_length, f"blk.{i}.", m.head_dim
    q_out, kv_out = m.head_count * d, m.head_count_kv * d
    bias = load if spec.qkv_bias else load.optional
    return LayerWeights(
        attn_norm=load(p + "attn_norm.weight", (h,)),
        wq=load.matrix(p + "attn_q.weight", (q_out, h)),
        wk=load.matrix(p + "attn_k.weight", (kv_out, h)),
        wv=load.matrix(p + "attn_v.weight", (kv_out, h)),
        wo=load.matrix(p + "attn_output.weight", (h, q_out)),
        ffn_norm=load(p + "ffn_norm.weight", (h,)),
        router=load(p + "ffn_gate_inp.weight", (m.expert_count, h)),
        q_norm=load(p + "attn_q_norm.weight", (d,)) if spec.qk_norm else None,
        k_norm=load(p + "attn_k_norm.weight", (d,)) if spec.qk_norm else None,
        bq=bias(p + "attn_q.bias", (q_out,)),
        bk=bias(p + "attn_k.bias", (kv_out,)),
        bv=bias(p + "attn_v.bias", (kv_out,)),
        shared=_shared_expert(load, m, p) if spec.shared_expert else None,
    )


def _shared_expert(load: Loader, m: ModelMeta, p: str) -> SharedExpert:
    h, f = m.embedding_length, m.expert_shared_feed_forward_length
    if f <= 0:
        raise ModelError(
            f"{m.arch} needs a shared expert but its width is unknown: the file has neither "
            f"{m.arch}.expert_shared_feed_forward_length nor blk.0.ffn_up_shexp.weight"
        )
    return SharedExpert(
        gate=load.matrix(p + "ffn_gate_shexp.weight", (f, h)),
        up=load.matrix(p + "ffn_up_shexp.weight", (f, h)),
        down=load.matrix(p + "ffn_down_shexp.weight", (h, f)),
        gate_inp=load(p + "ffn_gate_inp_shexp.weight", (h,)),
    )


def output_weight(load: Loader, m: ModelMeta) -> Weight:
    """`output.weight`, or the token embedding when the file ties them (no output tensor)."""
    name = "output.weight" if load.has("output.weight") else "token_embd.weight"
    return load.matrix(name, (m.vocab_size, m.embedding_length))
