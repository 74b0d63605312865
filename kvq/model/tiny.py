"""Tiny random MoE models in GGUF, for tests, demos and benches (deterministic from `seed`).

Any supported arch (`qwen3moe`, `qwen2moe`, `mixtral` = GGUF arch `llama`) and quant type.
Tensors are named, shaped and typed as llama.cpp writes real models: norms, biases and
routers stay F32; every other matrix is stored in the requested type (a dense matrix whose
rows are not whole quant blocks falls back to F32; expert matrices must fit, or ModelError).
The tokenizer is kvq's byte-level one (ids 0-255 = bytes, then BOS, EOS).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType

from kvq.errors import ModelError
from kvq.model.arch import ArchSpec, tiny_arch
from kvq.model.meta import ROPE_SCALINGS
from kvq.model.quants import encode, quant_type_named
from kvq.model.tiny_weights import F32, TinyConfig, tiny_tensors
from kvq.model.tokenizer import BYTE_TOKENIZER, N_BYTES, byte_token_list

__all__ = ["TinyConfig", "make_tiny", "write_tiny"]

ARCH = "qwen3moe"
CONTEXT_LENGTH = 512
ROPE_FREQ_BASE = 1e6
RMS_EPS = 1e-6
_KEEP_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # as llama-quantize does


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
    arch: str = ARCH,
    quant: str = "f32",
    shared_expert_ffn: int = 0,
    rope_scaling: str = "none",
    rope_scaling_factor: float = 1.0,
) -> None:
    """Write a tiny random MoE model to `path`.

    `arch`: qwen3moe | qwen2moe | mixtral. `quant`: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
    q5_1, q4_k, q5_k, q6_k (K-quants need hidden and expert_ffn multiples of 256, the others
    of 32). `shared_expert_ffn` (qwen2moe; 0 = 2 * expert_ffn). `rope_scaling`: none | linear |
    yarn, by `rope_scaling_factor` (yarn's original context is the context / factor).
    """
    cfg = TinyConfig(
        layers, experts, experts_used, hidden, expert_ffn, heads, kv_heads, head_dim,
        shared_expert_ffn,
    )  # fmt: skip
    write_tiny(
        path, cfg, arch=arch, quant=quant, seed=seed, rope=(rope_scaling, rope_scaling_factor)
    )


def write_tiny(
    path: str | Path,
    cfg: TinyConfig,
    *,
    arch: str = ARCH,
    quant: str = "f32",
    seed: int = 0,
    rope: tuple[str, float] = ("none", 1.0),
    tokenizer: Callable[[GGUFWriter], None] | None = None,
    extra: Callable[[GGUFWriter], None] | None = None,
) -> None:
    """`make_tiny` from a TinyConfig. `tokenizer` writes the tokenizer keys (default: the
    byte tokenizer; needed when `cfg.vocab` is not 258); `extra` adds more metadata."""
    spec, qtype = tiny_arch(arch), quant_type_named(quant)
    cfg.check()
    _check_quant(cfg, qtype)
    if rope[0] not in ROPE_SCALINGS or rope[1] <= 0:
        raise ModelError(
            f"make_tiny rope_scaling={rope[0]!r} x {rope[1]} is invalid; "
            f"use one of {ROPE_SCALINGS} with a positive factor"
        )
    tensors = tiny_tensors(cfg, spec, np.random.default_rng(seed))
    writer = GGUFWriter(str(path), spec.name)
    try:
        _add_metadata(writer, cfg, spec, f"kvq-tiny-{arch}-{cfg.layers}L-{cfg.experts}E-s{seed}")
        _add_rope_scaling(writer, *rope)
        (tokenizer or _byte_tokenizer)(writer)
        if extra is not None:
            extra(writer)
        for name, arr in tensors.items():
            _add_tensor(writer, name, arr, qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add_rope_scaling(w: GGUFWriter, kind: str, factor: float) -> None:
    if kind != "none":
        w.add_rope_scaling_type(RopeScalingType(kind))
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(max(1, round(CONTEXT_LENGTH / factor)))


def _check_quant(cfg: TinyConfig, qtype: GGMLQuantizationType) -> None:
    """Expert rows (hidden for gate/up, expert_ffn for down) must be whole quant blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    for name, value in (("hidden", cfg.hidden), ("expert_ffn", cfg.expert_ffn)):
        if value % block:
            raise ModelError(
                f"make_tiny {name}={value} is not a multiple of the {qtype.name} block size "
                f"{block}; use a multiple of {block} (e.g. --{name.replace('_', '-')} {block})"
            )


def _add_tensor(w: GGUFWriter, name: str, arr: F32, qtype: GGMLQuantizationType) -> None:
    """Store `arr` as `qtype`, except vectors, routers, and rows that are not whole blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    keep = arr.ndim == 1 or name.endswith(_KEEP_F32) or arr.shape[-1] % block
    t = GGMLQuantizationType.F32 if keep else qtype
    w.add_tensor(name, encode(arr, t), raw_dtype=t)


def _add_metadata(w: GGUFWriter, cfg: TinyConfig, spec: ArchSpec, name: str) -> None:
    """Hyper-parameters under the keys llama.cpp's converter writes for `spec`'s arch."""
    w.add_name(name)
    w.add_block_count(cfg.layers)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.expert_ffn)
    if spec.name != "llama":  # Mixtral files carry the expert width as feed_forward_length
        w.add_expert_feed_forward_length(cfg.expert_ffn)
    if spec.shared_expert:
        w.add_expert_shared_feed_forward_length(cfg.shared_ffn)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    if spec.qk_norm or cfg.head_dim * cfg.heads != cfg.hidden:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if spec.name == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(cfg.experts)
    w.add_expert_used_count(cfg.experts_used)


def _byte_tokenizer(w: GGUFWriter) -> None:
    w.add_tokenizer_model(BYTE_TOKENIZER)
    w.add_token_list(byte_token_list())
    w.add_token_types([TokenType.BYTE] * N_BYTES + [TokenType.CONTROL] * 2)
    w.add_bos_token_id(N_BYTES)
    w.add_eos_token_id(N_BYTES + 1)
