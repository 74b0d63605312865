"""Tiny random MoE models in GGUF, for tests, demos and benches (deterministic from `seed`).

Any supported arch (`qwen3moe`, `qwen2moe`, `mixtral` = GGUF arch `llama`) and quant type, or
the mix `q4_k_m`. Tensors are named, shaped and typed as llama.cpp writes real models: each
tensor's type comes from `kvq.tools.synth.quants.tensor_type`, llama-quantize's rules (norms, biases
and routers F32; rows that are not whole blocks of the type fall back per tensor, experts
included: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, else F16).

Tokenizer (`tokenizer=`): `bytes`, kvq's own byte tokenizer (`kvq-bytes`: ids 0-255 = bytes,
then BOS, EOS; only kvq reads it), or `bpe`, the GPT-2-style byte-level BPE of
`kvq.tools.synth.bpe` that llama.cpp and other GGUF tools load too (ids 0-255 are again the bytes,
256 BOS, 257 EOS, then merged tokens). Both carry a `tokenizer.chat_template`
(`CHAT_TEMPLATE`). Real-sized models: `kvq.tools.synth.presets`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter, LlamaFileType, RopeScalingType, TokenType

from kvq.errors import ModelError
from kvq.gguf.arch import MLA, QK_NONE, SHARED_GATED, SHARED_NONE, ArchSpec, tiny_arch
from kvq.gguf.meta import ROPE_SCALINGS
from kvq.text.tokenizer import BYTE_TOKENIZER, N_BYTES, byte_token_list
from kvq.tools.synth import bpe
from kvq.tools.synth.quants import check_quant, encode, tensor_type
from kvq.tools.synth.tiny_weights import TinyConfig, llama3_rope_factors, tiny_tensors

__all__ = ["TOKENIZERS", "TinyConfig", "add_metadata", "make_tiny", "write_tiny"]

ARCH = "qwen3moe"
CONTEXT_LENGTH = 512
ROPE_FREQ_BASE = 1e6
RMS_EPS = 1e-6
TOKENIZERS = ("bytes", "bpe")
# general.file_type as llama-quantize sets it; a lone K-quant is its "small" (_S) file type
FILE_TYPES = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "q4_1": LlamaFileType.MOSTLY_Q4_1,
    "q5_0": LlamaFileType.MOSTLY_Q5_0,
    "q5_1": LlamaFileType.MOSTLY_Q5_1,
    "q4_k": LlamaFileType.MOSTLY_Q4_K_S,
    "q5_k": LlamaFileType.MOSTLY_Q5_K_S,
    "q6_k": LlamaFileType.MOSTLY_Q6_K,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
    "mxfp4": LlamaFileType.MOSTLY_MXFP4_MOE,
}
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
    variant: str = "",
) -> None:
    """Write a tiny random MoE model to `path`.

    `arch`: qwen3moe | qwen2moe | mixtral | olmoe | glm4moe | deepseek2 | gpt-oss |
    qwen35moe, each with every part
    its family's real files use (`family_parts`; `variant` picks another form of a family:
    deepseek2 `v2-lite`, `kv-b`). `quant`: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
    q5_1, q4_k, q5_k, q6_k, or the mixes q4_k_m and mxfp4 (experts MXFP4, the rest Q8_0; rows that are not whole blocks fall back per
    tensor, as llama-quantize does). `shared_expert_ffn` (qwen2moe; 0 = 2 * expert_ffn).
    `rope_scaling`: none | linear | yarn, by `rope_scaling_factor` (yarn's original context is
    the context / factor). `tokenizer`: bytes (kvq only) | bpe (llama.cpp loads it too).
    """
    cfg = TinyConfig(
        layers,
        experts,
        experts_used,
        hidden,
        expert_ffn,
        heads,
        kv_heads,
        head_dim,
        shared_expert_ffn,
    )
    cfg = family_parts(cfg, arch, variant)
    rope = (rope_scaling, rope_scaling_factor)
    write_tiny(path, cfg, arch=arch, quant=quant, seed=seed, rope=rope, tokenizer=tokenizer)


VARIANTS: dict[str, tuple[str, ...]] = {"deepseek2": ("v3", "v2-lite", "kv-b")}


def family_parts(cfg: TinyConfig, arch: str, variant: str = "") -> TinyConfig:
    """`cfg` with the parts of `arch`'s real files (the other archs: unchanged).

    - deepseek2 (`v3`, the default): q LoRA, the latent KV with k_b/v_b split, one leading
      dense layer, one shared expert, sigmoid scores with the `exp_probs_b` bias, 2 expert
      groups of which 1 is kept, renormalised top-k weights scaled by 2.5, a rope part of half
      the head and values as wide as a whole head; `v2-lite`: no q LoRA, softmax, no groups,
      no bias, raw top-k weights (DeepSeek-V2-Lite's config); `kv-b`: v3 with one attn_kv_b
      (files from older converters).
    - glm4moe: one leading dense layer, one shared expert, sigmoid scores with the bias,
      renormalised weights, half-head rope, per-head q/k norms, q/k/v biases, and an MTP block.
    - olmoe: as many kv heads as heads (its k norm spans the whole projection).
    - gpt-oss: a sliding window of 8 positions on the even layers (a test's context passes
      it), attention sinks, q/k/v/o, router and expert biases (`layer_shapes`).
    - qwen35moe: Gated DeltaNet on the even layers and gated full attention on the odd ones
      (`full_attention_interval` 2, so a 2-layer file has both), more value heads than key
      heads (the tiling), a conv of 4 taps, the sigmoid-gated shared expert, partial rope of
      half the head with IMROPE sections [1, 1, 1, 1] per 4 pairs (the 4th pair of each is
      IMROPE's e section, which a text token does not rotate).
    - llama4: at least 4 layers, the odd ones MoE (`interleave_moe_layer_step` 2) with one
      shared expert and top-1 routing, the even ones dense; every 4th layer NoPE with full
      attention, the others chunked (llama.cpp's fixed chunk of 8192 positions, so the
      context is 16384 for a test to cross it) with the q/k norm; llama3 `rope_freqs`.
    """
    variants = VARIANTS.get(arch, ())
    if variant and variant not in variants:
        raise ModelError(
            f"make_tiny variant {variant!r} is unknown for arch {arch!r}; "
            f"choose one of {list(variants) or 'none'}"
        )
    half = max(2, cfg.head_dim // 2 // 2 * 2)
    if arch == "deepseek2":
        return _deepseek2_parts(cfg, variant, half)
    if arch == "glm4moe":
        return _glm4moe_parts(cfg, half)
    if arch == "olmoe":
        return replace(cfg, kv_heads=cfg.heads)
    if arch == "gpt-oss":
        return replace(cfg, sliding_window=cfg.sliding_window or 8)
    if arch == "qwen35moe":
        return _qwen35moe_parts(cfg, half)
    if arch == "llama4":
        return _llama4_parts(cfg)
    return cfg


def _glm4moe_parts(cfg: TinyConfig, half: int) -> TinyConfig:
    return replace(
        cfg,
        dense_layers=min(1, cfg.layers - 1),
        shared_count=1,
        rope_dim=half,
        gating="sigmoid",
        probs_bias=True,
        weights_norm=True,
        head_norms=True,
        nextn=1,
    )


def _llama4_parts(cfg: TinyConfig) -> TinyConfig:
    return replace(
        cfg,
        layers=max(4, cfg.layers),
        moe_step=2,
        shared_count=1,
        experts_used=1,
        context=16384,
        rope_factors=True,
    )


def _deepseek2_parts(cfg: TinyConfig, variant: str, half: int) -> TinyConfig:
    """deepseek2's parts in `variant` (see `family_parts`); `half`: the rope part's width."""
    lite = variant == "v2-lite"
    groups = 1 if lite or cfg.experts % 2 else 2
    return replace(
        cfg,
        dense_layers=min(1, cfg.layers - 1),
        shared_count=1,
        rope_dim=half,
        q_lora_rank=0 if lite else max(2, cfg.hidden // 2),
        kv_lora_rank=max(2, cfg.hidden // 2),
        v_head_dim=cfg.head_dim,
        mla_split=variant != "kv-b",
        gating="softmax" if lite else "sigmoid",
        probs_bias=not lite,
        expert_groups=groups,
        groups_used=1,
        weights_norm=not lite,
        weights_scale=1.0 if lite else 2.5,
    )


def _qwen35moe_parts(cfg: TinyConfig, half: int) -> TinyConfig:
    """qwen35moe's parts (see `family_parts`); `half`: the rope part's width."""
    k_heads = max(1, cfg.kv_heads)
    return replace(
        cfg,
        rope_dim=half,
        full_attention_interval=2,
        ssm_k_heads=k_heads,
        ssm_v_heads=2 * k_heads,
        ssm_state=cfg.head_dim,
        ssm_conv=4,
        rope_sections=(1, 1, 1, 1),
    )


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
    if cfg.rope_factors:
        tensors["rope_freqs.weight"] = llama3_rope_factors(cfg.rope_dims, ROPE_FREQ_BASE)
    writer = GGUFWriter(str(path), spec.name)
    try:
        name = f"kvq-tiny-{arch}-{cfg.layers}L-{cfg.experts}E-s{seed}"
        add_metadata(writer, cfg, spec, name, quant=quant, context=cfg.context or CONTEXT_LENGTH)
        _add_rope_scaling(writer, *rope)
        if spec.attention == MLA and rope[0] == "yarn":  # DeepSeek's mscale_all_dim = 1
            writer.add_rope_scaling_yarn_log_mul(0.1)
        add_tokenizer(writer)
        if isinstance(tokenizer, str):
            writer.add_chat_template(CHAT_TEMPLATE)
        if extra is not None:
            extra(writer)
        write_tensors(writer, tensors, quant, cfg.layers, cfg.experts)
    finally:
        writer.close()


def write_tensors(
    writer: GGUFWriter, tensors: dict[str, np.ndarray], quant: str, layers: int, experts: int
) -> None:
    """Each tensor in the type `quant` gives it (`quants.tensor_type`), then the file: header,
    metadata, tensors (the metadata must be added before)."""
    for tname, arr in tensors.items():
        qtype = tensor_type(tname, arr.shape, quant, layers, experts)
        writer.add_tensor(tname, encode(arr, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()


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
    w: GGUFWriter,
    cfg: TinyConfig,
    spec: ArchSpec,
    name: str,
    *,
    quant: str = "f32",
    context: int = CONTEXT_LENGTH,
    rope_base: float = ROPE_FREQ_BASE,
    rms_eps: float = RMS_EPS,
) -> None:
    """Hyper-parameters under the keys llama.cpp's converter writes for `spec`'s arch."""
    w.add_name(name)
    w.add_file_type(int(FILE_TYPES[quant]))
    w.add_block_count(cfg.layers + cfg.nextn)
    w.add_context_length(context)
    w.add_embedding_length(cfg.hidden)
    dense = cfg.dense_layers or cfg.moe_step > 1
    w.add_feed_forward_length(cfg.dense_width if dense else cfg.expert_ffn)
    if spec.name != "llama":  # Mixtral files carry the expert width as feed_forward_length
        w.add_expert_feed_forward_length(cfg.expert_ffn)
    if spec.shared == SHARED_GATED:
        w.add_expert_shared_feed_forward_length(cfg.shared_ffn)
    elif spec.shared != SHARED_NONE and not spec.moe_step:  # llama4's is one expert, unwritten
        w.add_expert_shared_count(cfg.shared_count)
    w.add_head_count(cfg.heads)
    if spec.attention == MLA:
        _add_mla(w, cfg)
    else:
        w.add_head_count_kv(cfg.kv_heads)
        if spec.qk_norm != QK_NONE or cfg.head_dim * cfg.heads != cfg.hidden:
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
    if spec.name == "llama" or cfg.rope_dim:
        w.add_rope_dimension_count(cfg.rope_dims)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_expert_count(cfg.experts)
    w.add_expert_used_count(cfg.experts_used)
    if spec.swa_pattern:  # the pattern is the arch's default (gpt-oss files omit it)
        w.add_sliding_window(cfg.sliding_window)
    if spec.linear_attn:
        _add_delta(w, cfg)
    if spec.imrope:
        w.add_rope_dimension_sections(list(cfg.rope_sections))
    _add_routing(w, cfg, spec)


def _add_delta(w: GGUFWriter, cfg: TinyConfig) -> None:
    """The Gated DeltaNet keys llama.cpp's converter writes for Qwen3.5."""
    w.add_full_attention_interval(cfg.full_attention_interval)
    if cfg.recurrent_pattern:  # one flag per block, the MTP blocks not recurrent
        flags = [*cfg.recurrent_pattern, *[False] * cfg.nextn]
        w.add_array(f"{w.arch}.attention.recurrent_layers", flags)  # gguf 0.19 lacks the helper
    w.add_ssm_conv_kernel(cfg.ssm_conv)
    w.add_ssm_state_size(cfg.ssm_state)
    w.add_ssm_group_count(cfg.ssm_k_heads)
    w.add_ssm_time_step_rank(cfg.ssm_v_heads)
    w.add_ssm_inner_size(cfg.ssm_v_heads * cfg.ssm_state)


def _add_mla(w: GGUFWriter, cfg: TinyConfig) -> None:
    """MLA's keys as llama.cpp's converter writes them: with attn_k_b/attn_v_b the file is
    MQA over the latent (one kv head, key = latent + rope, value = latent) and carries the
    per-head sizes as *_mla; with one attn_kv_b, the per-head sizes as key/value_length."""
    w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    if cfg.mla_split:
        w.add_head_count_kv(1)
        w.add_key_length(cfg.kv_lora_rank + cfg.rope_dims)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.head_dim)
        w.add_value_length_mla(cfg.value_dim)
    else:
        w.add_head_count_kv(cfg.heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.value_dim)


def _add_routing(w: GGUFWriter, cfg: TinyConfig, spec: ArchSpec) -> None:
    """The layer pattern and router keys of the newer families (only those set)."""
    if spec.dense_lead:
        w.add_leading_dense_block_count(cfg.dense_layers)
    if spec.moe_step:
        w.add_interleave_moe_layer_step(cfg.moe_step)
    if cfg.gating:
        w.add_expert_gating_func(ExpertGatingFuncType[cfg.gating.upper()])
    if cfg.expert_groups > 1:
        w.add_expert_group_count(cfg.expert_groups)
        w.add_expert_group_used_count(cfg.groups_used)
    if cfg.weights_norm is not None:
        w.add_expert_weights_norm(cfg.weights_norm)
    if cfg.weights_scale:
        w.add_expert_weights_scale(cfg.weights_scale)
    if cfg.nextn:
        w.add_nextn_predict_layers(cfg.nextn)


def _byte_tokenizer(w: GGUFWriter) -> None:
    w.add_tokenizer_model(BYTE_TOKENIZER)
    w.add_token_list(byte_token_list())
    w.add_token_types([TokenType.BYTE] * N_BYTES + [TokenType.CONTROL] * 2)
    w.add_bos_token_id(N_BYTES)
    w.add_eos_token_id(N_BYTES + 1)
