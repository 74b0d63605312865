"""Tiny random MoE models in GGUF, for tests, demos and benches (deterministic from `seed`).

Any supported arch (`qwen3moe`, `qwen2moe`, `mixtral` = GGUF arch `llama`) and quant type, or
the mix `q4_k_m`. Tensors are named, shaped and typed as llama.cpp writes real models: each
tensor's type comes from `kvq.model.quants.tensor_type`, llama-quantize's rules (norms, biases
and routers F32; rows that are not whole blocks of the type fall back per tensor, experts
included: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, else F16).

Tokenizer (`tokenizer=`): `bytes`, kvq's own byte tokenizer (`kvq-bytes`: ids 0-255 = bytes,
then BOS, EOS; only kvq reads it), or `bpe`, the GPT-2-style byte-level BPE of
`kvq.model.bpe` that llama.cpp and other GGUF tools load too (ids 0-255 are again the bytes,
256 BOS, 257 EOS, then merged tokens). Both carry a `tokenizer.chat_template`
(`CHAT_TEMPLATE`). Real-sized models: `kvq.model.presets`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType, RopeScalingType, TokenType

from kvq.errors import ModelError
from kvq.model import bpe
from kvq.model.arch import ArchSpec, tiny_arch
from kvq.model.meta import ROPE_SCALINGS
from kvq.model.quants import check_quant, encode, tensor_type
from kvq.model.tiny_weights import TinyConfig, tiny_tensors
from kvq.model.tokenizer import BYTE_TOKENIZER, N_BYTES, byte_token_list

__all__ = ["TOKENIZERS", "TinyConfig", "add_metadata", "make_tiny", "write_tiny"]

ARCH = "qwen3moe"
CONTEXT_LENGTH = 512
ROPE_FREQ_BASE = 1e6
RMS_EPS = 1e-6
TOKENIZERS = ("bytes", "bpe")
# general.file_type as llama-quantize sets it; a lone K-quant is its "small" (_S) file type
FILE_TYPES = {
    "f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16, "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_1": LlamaFileType.MOSTLY_Q4_1,
    "q5_0": LlamaFileType.MOSTLY_Q5_0, "q5_1": LlamaFileType.MOSTLY_Q5_1,
    "q4_k": LlamaFileType.MOSTLY_Q4_K_S, "q5_k": LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": LlamaFileType.MOSTLY_Q6_K, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}  # fmt: skip
TokenizerArg = str | Callable[[GGUFWriter], object]
# `tokenizer.chat_template` of the built-in tokenizers: not ChatML, so that a test can tell the
# file's template from the fallback; it refuses unknown roles as real templates do
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "### {{ m['role'] | capitalize }}:\n{{ m['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


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
    tokenizer: str = "bytes",
) -> None:
    """Write a tiny random MoE model to `path`.

    `arch`: qwen3moe | qwen2moe | mixtral. `quant`: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
    q5_1, q4_k, q5_k, q6_k, or the mix q4_k_m (rows that are not whole blocks fall back per
    tensor, as llama-quantize does). `shared_expert_ffn` (qwen2moe; 0 = 2 * expert_ffn).
    `rope_scaling`: none | linear | yarn, by `rope_scaling_factor` (yarn's original context is
    the context / factor). `tokenizer`: bytes (kvq only) | bpe (llama.cpp loads it too).
    """
    cfg = TinyConfig(
        layers, experts, experts_used, hidden, expert_ffn, heads, kv_heads, head_dim,
        shared_expert_ffn,
    )  # fmt: skip
    rope = (rope_scaling, rope_scaling_factor)
    write_tiny(path, cfg, arch=arch, quant=quant, seed=seed, rope=rope, tokenizer=tokenizer)


def write_tiny(
    path: str | Path,
    cfg: TinyConfig,
    *,
    arch: str = ARCH,
    quant: str = "f32",
    seed: int = 0,
    rope: tuple[str, float] = ("none", 1.0),
    tokenizer: TokenizerArg = "bytes",
    extra: Callable[[GGUFWriter], None] | None = None,
) -> None:
    """`make_tiny` from a TinyConfig. `tokenizer`: "bytes", "bpe" (the vocabulary is padded
    to `cfg.vocab` if that is larger than the BPE's, and sets it if `cfg.vocab` is the byte
    tokenizer's 258), or a function writing the tokenizer keys for `cfg.vocab` tokens;
    `extra` adds more metadata."""
    spec, quant = tiny_arch(arch), check_quant(quant)
    cfg, add_tokenizer = _tokenizer(cfg, tokenizer)
    cfg.check()
    if rope[0] not in ROPE_SCALINGS or rope[1] <= 0:
        raise ModelError(
            f"make_tiny rope_scaling={rope[0]!r} x {rope[1]} is invalid; "
            f"use one of {ROPE_SCALINGS} with a positive factor"
        )
    tensors = tiny_tensors(cfg, spec, np.random.default_rng(seed))
    writer = GGUFWriter(str(path), spec.name)
    try:
        name = f"kvq-tiny-{arch}-{cfg.layers}L-{cfg.experts}E-s{seed}"
        add_metadata(writer, cfg, spec, name, quant=quant)
        _add_rope_scaling(writer, *rope)
        add_tokenizer(writer)
        if isinstance(tokenizer, str):
            writer.add_chat_template(CHAT_TEMPLATE)
        if extra is not None:
            extra(writer)
        for tname, arr in tensors.items():
            qtype = tensor_type(tname, arr.shape, quant, cfg.layers, cfg.experts)
            writer.add_tensor(tname, encode(arr, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _tokenizer(
    cfg: TinyConfig, tokenizer: TokenizerArg
) -> tuple[TinyConfig, Callable[[GGUFWriter], object]]:
    """The config (vocab size settled) and the function writing the tokenizer keys."""
    if callable(tokenizer):
        return cfg, tokenizer
    if tokenizer == "bytes":
        if cfg.vocab != N_BYTES + 2:
            raise ModelError(
                f"make_tiny vocab={cfg.vocab} does not fit the byte tokenizer (258 tokens); "
                "use tokenizer='bpe' or pass a tokenizer function"
            )
        return cfg, _byte_tokenizer
    if tokenizer == "bpe":
        vocab = bpe.tiny_vocab(0 if cfg.vocab == N_BYTES + 2 else cfg.vocab)
        return replace(cfg, vocab=len(vocab.tokens)), lambda w: bpe.add_vocab(w, vocab)
    raise ModelError(f"make_tiny tokenizer {tokenizer!r} is unknown; choose one of {TOKENIZERS}")


def _add_rope_scaling(w: GGUFWriter, kind: str, factor: float) -> None:
    if kind != "none":
        w.add_rope_scaling_type(RopeScalingType(kind))
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(max(1, round(CONTEXT_LENGTH / factor)))


def add_metadata(
    w: GGUFWriter, cfg: TinyConfig, spec: ArchSpec, name: str, *, quant: str = "f32",
    context: int = CONTEXT_LENGTH, rope_base: float = ROPE_FREQ_BASE, rms_eps: float = RMS_EPS,
) -> None:  # fmt: skip
    """Hyper-parameters under the keys llama.cpp's converter writes for `spec`'s arch."""
    w.add_name(name)
    w.add_file_type(int(FILE_TYPES[quant]))
    w.add_block_count(cfg.layers)
    w.add_context_length(context)
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
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_expert_count(cfg.experts)
    w.add_expert_used_count(cfg.experts_used)


def _byte_tokenizer(w: GGUFWriter) -> None:
    w.add_tokenizer_model(BYTE_TOKENIZER)
    w.add_token_list(byte_token_list())
    w.add_token_types([TokenType.BYTE] * N_BYTES + [TokenType.CONTROL] * 2)
    w.add_bos_token_id(N_BYTES)
    w.add_eos_token_id(N_BYTES + 1)
