"""Model metadata read from a GGUF header: every hyper-parameter the forward pass needs, and
where each layer's stacked expert tensors lie in the file (see `kvq.gguf.layout`).

Everything is validated here, before any weight is read: the architecture, each tensor's quant
type, the expert tensors' shapes, and that the file stores experts stacked (one tensor per
layer and kind), which is what makes a slice a contiguous byte range.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from gguf import GGUFReader, ReaderTensor

from kvq.catalog import ModelMeta
from kvq.errors import ModelError
from kvq.gguf import reader as gio
from kvq.gguf.arch import MLA, SUPPORTED_TEXT, ArchSpec, arch_spec
from kvq.gguf.meta_llama4 import layer_pattern, llama4_fields
from kvq.slices import EXPERT_KINDS, STACKED_KINDS, TensorRange

ROPE_SCALINGS = ("none", "linear", "yarn")
# a backbone file (`kvq model split --backbone`, `kvq.gguf.split`) says so under this key
ROUTED_EXPERTS_KEY = "kvq.routed_experts"
ROUTED_EXPERTS_ABSENT = "absent"


def read_meta(path: str | Path) -> ModelMeta:
    """Read and validate the header of a GGUF model (memory-mapped; no tensor data is copied)."""
    reader = gio.open_reader(path)
    arch = gio.str_field(reader, "general.architecture")
    spec = arch_spec(arch)
    tensors = gio.tensor_map(reader)
    meta = _meta_fields(reader, arch, os.path.getsize(path))
    if spec.shared_expert and meta.expert_shared_feed_forward_length <= 0:
        shexp = tensors.get(f"blk.{meta.moe_layers[0]}.ffn_up_shexp.weight")
        width = gio.numpy_shape(shexp)[0] if shexp is not None else 0
        meta = replace(meta, expert_shared_feed_forward_length=width)
    _check_unsupported_tensors(tensors, spec)
    experts = {}
    if gio.str_field(reader, ROUTED_EXPERTS_KEY, "") != ROUTED_EXPERTS_ABSENT:
        experts = {layer: _layer_experts(tensors, meta, spec, layer) for layer in meta.moe_layers}
    for t in tensors.values():  # refuse unsupported quant types before any weight is read
        gio.check_supported(int(t.tensor_type), t.name)
    return replace(meta, expert_tensors=experts)  # replace keeps the dataclass frozen


def _meta_fields(reader: GGUFReader, arch: str, file_size: int) -> ModelMeta:
    """The scalar metadata of a supported architecture."""
    a, spec = arch, arch_spec(arch)
    # a dense llama has no expert_count at all: refuse it as such, not as an incomplete file
    experts = gio.int_field(reader, f"{a}.expert_count", 0 if a == "llama" else None)
    if experts <= 0:
        raise ModelError(
            f"model architecture {arch!r} without experts ({a}.expert_count = {experts}) is "
            f"not supported; kvq serves MoE models: {SUPPORTED_TEXT}"
        )
    hidden = gio.int_field(reader, f"{a}.embedding_length")
    heads = gio.int_field(reader, f"{a}.attention.head_count")
    head_dim, rope_dim = _head_dim(reader, a, hidden, heads, spec)
    blocks, nextn = _blocks(reader, a, spec)
    return ModelMeta(
        arch=arch,
        name=gio.str_field(reader, "general.name", ""),
        block_count=blocks,
        expert_count=experts,
        expert_used_count=_experts_used(reader, a, experts),
        embedding_length=hidden,
        expert_feed_forward_length=_expert_ffn(reader, a),
        head_count=heads,
        head_count_kv=_kv_heads(reader, a, heads, spec),
        head_dim=head_dim,
        rope_freq_base=gio.float_field(reader, f"{a}.rope.freq_base", 10000.0),
        rms_eps=gio.float_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        context_length=gio.int_field(reader, f"{a}.context_length"),
        vocab_size=_vocab_size(reader),
        bos_id=gio.int_field(reader, "tokenizer.ggml.bos_token_id", -1),
        eos_id=gio.int_field(reader, "tokenizer.ggml.eos_token_id", -1),
        file_size=file_size,
        feed_forward_length=gio.int_field(reader, f"{a}.feed_forward_length", 0),
        tokenizer_model=gio.str_field(reader, "tokenizer.ggml.model", ""),
        **_rope_scaling(reader, a),
        attention_scale=gio.float_field(reader, f"{a}.attention.scale", 0.0),
        **_gating(reader, a, spec, experts),
        expert_shared_feed_forward_length=gio.int_field(
            reader, f"{a}.expert_shared_feed_forward_length", 0
        ),
        leading_dense_block_count=_dense_lead(reader, a, spec, blocks),
        nextn_predict_layers=nextn,
        rope_dim=rope_dim,
        rope_yarn_log_mul=gio.float_field(reader, f"{a}.rope.scaling.yarn_log_multiplier", 0.0),
        **_mla(reader, a, spec),
        **_sliding(reader, a, spec),
        **_delta(reader, a, spec, blocks, nextn),
        **_rope_sections(reader, a, spec),
        **(llama4_fields(reader, a, blocks, experts) if spec.chunked else {}),
        expert_act=spec.expert_act,
    )


def _sliding(reader: GGUFReader, a: str, spec: ArchSpec) -> dict[str, Any]:
    """The sliding-window layers (gpt-oss): the window, the pattern and their rope base."""
    if not spec.swa_pattern:
        return {}
    window = gio.int_field(reader, f"{a}.attention.sliding_window")
    blocks = gio.int_field(reader, f"{a}.block_count")
    pattern, layers = layer_pattern(reader, a, blocks, spec.swa_pattern)
    if window <= 0:
        raise ModelError(f"{a}.attention.sliding_window = {window} must be positive")
    return {
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "sliding_layers": layers,
        "rope_freq_base_swa": gio.float_field(reader, f"{a}.rope.freq_base_swa", 0.0),
    }


def _delta(reader: GGUFReader, a: str, spec: ArchSpec, blocks: int, nextn: int) -> dict[str, Any]:
    """The Gated DeltaNet sizes (qwen35moe), checked as llama.cpp's recurrence needs them,
    and its layer pattern."""
    if not spec.linear_attn:
        return {}
    out = {
        "full_attention_interval": gio.int_field(reader, f"{a}.full_attention_interval", 4),
        "ssm_conv_kernel": gio.int_field(reader, f"{a}.ssm.conv_kernel"),
        "ssm_state_size": gio.int_field(reader, f"{a}.ssm.state_size"),
        "ssm_group_count": gio.int_field(reader, f"{a}.ssm.group_count"),
        "ssm_time_step_rank": gio.int_field(reader, f"{a}.ssm.time_step_rank"),
    }
    inner = gio.int_field(reader, f"{a}.ssm.inner_size")
    k, hv, d = out["ssm_group_count"], out["ssm_time_step_rank"], out["ssm_state_size"]
    if min(out.values()) < 1 or hv % k or inner != hv * d:
        raise ModelError(
            f"{a}: Gated DeltaNet sizes {out} with ssm.inner_size {inner} are inconsistent "
            "(value heads a multiple of group_count, inner_size = value heads * state_size)"
        )
    return out | _recurrent_list(reader, a, blocks, nextn)


def _recurrent_list(reader: GGUFReader, a: str, blocks: int, nextn: int) -> dict[str, Any]:
    """`attention.recurrent_layers`, one bool per block (MTP blocks included, never
    recurrent), as the converter writes it from the HF config's `layer_types`; llama.cpp then
    ignores `full_attention_interval`."""
    key = f"{a}.attention.recurrent_layers"
    if gio.array_len(reader, key) == 0:
        return {}
    flags = gio.field(reader, key)
    if (
        not isinstance(flags, list)
        or len(flags) != blocks + nextn
        or not all(isinstance(f, bool) for f in flags)
        or any(flags[blocks:])
    ):
        raise ModelError(
            f"{key} = {flags!r} must be {blocks + nextn} booleans, one per block, with the "
            f"{nextn} MTP block(s) not recurrent"
        )
    return {"recurrent_list": tuple(i for i, f in enumerate(flags[:blocks]) if f)}


def _rope_sections(reader: GGUFReader, a: str, spec: ArchSpec) -> dict[str, Any]:
    """IMROPE's four sections (llama.cpp requires them for its IMROPE archs)."""
    if not spec.imrope:
        return {}
    raw = gio.field(reader, f"{a}.rope.dimension_sections")
    sections = tuple(int(v) for v in raw) if isinstance(raw, list) else ()
    if len(sections) < 4 or min(sections[:4]) < 0 or sum(sections[:3]) <= 0:
        raise ModelError(
            f"{a}.rope.dimension_sections = {raw!r} is not four section sizes "
            "with a positive t, h or w"
        )
    return {"rope_sections": sections[:4]}


def _blocks(reader: GGUFReader, a: str, spec: ArchSpec) -> tuple[int, int]:
    """(trunk layers, MTP layers): `nextn_predict_layers` blocks at the end of the file are
    next-token-prediction heads for speculative decoding; kvq loads the file without them."""
    total = gio.int_field(reader, f"{a}.block_count")
    nextn = gio.int_field(reader, f"{a}.nextn_predict_layers", 0)
    if not 0 <= nextn < total:
        raise ModelError(f"{a}.nextn_predict_layers = {nextn} must be in 0..{total - 1}")
    return total - nextn, nextn


def _dense_lead(reader: GGUFReader, a: str, spec: ArchSpec, blocks: int) -> int:
    n = gio.int_field(reader, f"{a}.leading_dense_block_count", 0) if spec.dense_lead else 0
    if not 0 <= n < blocks:
        raise ModelError(
            f"{a}.leading_dense_block_count = {n} must leave at least one MoE layer of {blocks}"
        )
    return n


def _mla(reader: GGUFReader, a: str, spec: ArchSpec) -> dict[str, Any]:
    """MLA's ranks and value size (deepseek2); nothing for the other attention kinds."""
    if spec.attention != MLA:
        return {}
    kv_rank = gio.int_field(reader, f"{a}.attention.kv_lora_rank")
    v_mla = gio.int_field(reader, f"{a}.attention.value_length_mla", 0)
    value = v_mla or gio.int_field(reader, f"{a}.attention.value_length")
    if kv_rank <= 0 or value <= 0:
        raise ModelError(f"{a}: kv_lora_rank {kv_rank} and value size {value} must be positive")
    return {
        "q_lora_rank": gio.int_field(reader, f"{a}.attention.q_lora_rank", 0),
        "kv_lora_rank": kv_rank,
        "value_head_dim": value,
    }


def _head_dim(
    reader: GGUFReader, a: str, hidden: int, heads: int, spec: ArchSpec
) -> tuple[int, int]:
    """(head size of q and k, dimensions rope rotates), checked against value_length and rope.

    MLA files written by a recent converter carry the per-head sizes as `key_length_mla` /
    `value_length_mla` (and the latent's as `key_length`); older ones as `key_length`."""
    if heads <= 0:
        raise ModelError(f"{a}.attention.head_count = {heads} must be positive")
    if spec.attention == MLA:
        head_dim = gio.int_field(reader, f"{a}.attention.key_length_mla", 0) or gio.int_field(
            reader, f"{a}.attention.key_length"
        )
    else:
        head_dim = gio.int_field(reader, f"{a}.attention.key_length", hidden // heads)
        value_dim = gio.int_field(reader, f"{a}.attention.value_length", head_dim)
        if value_dim != head_dim:
            raise ModelError(
                f"{a}.attention.value_length {value_dim} != key_length {head_dim}; kvq needs "
                "equal key and value head sizes"
            )
    rot = gio.int_field(reader, f"{a}.rope.dimension_count", head_dim)
    if rot != head_dim and not (spec.partial_rope and 0 < rot < head_dim):
        raise ModelError(
            f"{a}.rope.dimension_count {rot} != head size {head_dim}: partial rotary "
            f"embeddings are not supported for {a}"
        )
    if head_dim % 2 or rot % 2:
        raise ModelError(f"head size {head_dim} or rope size {rot} is odd; RoPE needs even sizes")
    return head_dim, (0 if rot == head_dim else rot)


def _kv_heads(reader: GGUFReader, a: str, heads: int, spec: ArchSpec) -> int:
    kv = gio.int_field(reader, f"{a}.attention.head_count_kv", heads)
    if spec.attention == MLA:
        return heads  # MLA expands its latent to every head (files say 1: one latent)
    if kv <= 0 or heads % kv:
        raise ModelError(f"{a}.attention.head_count_kv = {kv} does not divide head_count {heads}")
    return kv


def _experts_used(reader: GGUFReader, a: str, experts: int) -> int:
    used = gio.int_field(reader, f"{a}.expert_used_count")
    if not 0 < used <= experts:
        raise ModelError(f"{a}.expert_used_count = {used} must be in 1..{experts} (expert_count)")
    return used


def _expert_ffn(reader: GGUFReader, a: str) -> int:
    """Expert FFN width: the metadata key, else the width of layer 0's stacked gate tensor."""
    ffn = gio.int_field(reader, f"{a}.expert_feed_forward_length", 0)
    if ffn > 0:
        return ffn
    gate = gio.tensor_map(reader).get("blk.0.ffn_gate_exps.weight")
    if gate is None:
        raise ModelError(
            f"GGUF metadata {a}.expert_feed_forward_length is missing and tensor "
            "'blk.0.ffn_gate_exps.weight' is missing too; the file is not a complete MoE model"
        )
    return gio.numpy_shape(gate)[1]


def _rope_scaling(reader: GGUFReader, a: str) -> dict[str, Any]:
    """rope.scaling.* as ModelMeta fields (the old `rope.scale_linear` key counts as linear)."""
    kind = gio.str_field(reader, f"{a}.rope.scaling.type", "none")
    factor = gio.float_field(reader, f"{a}.rope.scaling.factor", 0.0)
    if factor == 0.0:
        factor = gio.float_field(reader, f"{a}.rope.scale_linear", 0.0)
        if factor not in (0.0, 1.0) and kind == "none":
            kind = "linear"
    if kind not in ROPE_SCALINGS:
        raise ModelError(
            f"{a}.rope.scaling.type {kind!r} is not supported; kvq runs {ROPE_SCALINGS}"
        )
    if factor < 0:
        raise ModelError(f"{a}.rope.scaling.factor {factor} must be positive")
    return {
        "rope_scaling_type": kind,
        "rope_scaling_factor": factor or 1.0,
        "rope_original_context_length": gio.int_field(
            reader, f"{a}.rope.scaling.original_context_length", 0
        ),
        "rope_yarn_beta_fast": gio.float_field(reader, f"{a}.rope.scaling.yarn_beta_fast", 32.0),
        "rope_yarn_beta_slow": gio.float_field(reader, f"{a}.rope.scaling.yarn_beta_slow", 1.0),
    }


def _gating(reader: GGUFReader, a: str, spec: ArchSpec, experts: int) -> dict[str, Any]:
    """How top-k gate weights are formed: the scores (softmax or sigmoid, as the file's
    `expert_gating_func` says, else the arch's default), expert groups, renormalisation and
    scale."""
    funcs = {1: "softmax", 2: "sigmoid"}  # gpt-oss's softmax_weight is its arch's, never a key
    func = gio.int_field(reader, f"{a}.expert_gating_func", 0)
    if func not in (0, *funcs):
        raise ModelError(
            f"{a}.expert_gating_func = {func} is not supported; kvq runs softmax (1) and "
            "sigmoid (2) gating"
        )
    groups = gio.int_field(reader, f"{a}.expert_group_count", 0) or 1
    used = gio.int_field(reader, f"{a}.expert_group_used_count", 0) or groups
    if experts % groups or not 0 < used <= groups:
        raise ModelError(
            f"{a}.expert_group_count = {groups} must divide expert_count {experts}, and "
            f"expert_group_used_count = {used} be in 1..{groups}"
        )
    scale = gio.float_field(reader, f"{a}.expert_weights_scale", 0.0)
    return {
        "expert_weights_norm": gio.bool_field(reader, f"{a}.expert_weights_norm", spec.norm_topk),
        "expert_weights_scale": scale if scale > 0 else 1.0,
        "expert_gating": funcs.get(func, spec.gating),
        "expert_group_count": groups,
        "expert_group_used_count": used,
    }


def _vocab_size(reader: GGUFReader) -> int:
    """Rows of `token_embd.weight` (the logits width), else the token list's length."""
    t = gio.tensor_map(reader).get("token_embd.weight")
    if t is not None:
        return gio.numpy_shape(t)[0]
    n = gio.array_len(reader, "tokenizer.ggml.tokens")
    if n <= 0:
        raise ModelError("GGUF has neither tokenizer.ggml.tokens nor token_embd.weight")
    return n


def _check_unsupported_tensors(tensors: Mapping[str, ReaderTensor], spec: ArchSpec) -> None:
    """Refuse per-expert tensors (pre-2024 Mixtral conversions) and llama3 rope factors
    outside the archs that run them (llama4)."""
    if "rope_freqs.weight" in tensors and not spec.rope_freqs:
        raise ModelError(
            "tensor 'rope_freqs.weight' (llama3-style rope frequency factors) is not supported"
        )
    if "blk.0.ffn_gate.0.weight" in tensors:
        raise ModelError(
            "this GGUF stores each expert as its own tensor (blk.N.ffn_gate.E.weight, an old "
            "Mixtral conversion); kvq needs stacked ffn_*_exps tensors: re-convert the model "
            "with a recent llama.cpp convert_hf_to_gguf.py"
        )


def _layer_experts(
    tensors: Mapping[str, ReaderTensor], meta: ModelMeta, spec: ArchSpec, layer: int
) -> dict[str, TensorRange]:
    """Full-tensor ranges of one layer's gate/up/down expert stacks (and their biases where
    the arch has them), shape-checked."""
    e, f, h = meta.expert_count, meta.expert_feed_forward_length, meta.embedding_length
    want = {
        "gate": (e, f, h),
        "up": (e, f, h),
        "down": (e, h, f),
        "gate_b": (e, f),
        "up_b": (e, f),
        "down_b": (e, h),
    }
    out: dict[str, TensorRange] = {}
    for kind in STACKED_KINDS if spec.expert_bias else EXPERT_KINDS:
        base, part = kind.removesuffix("_b"), "bias" if kind.endswith("_b") else "weight"
        name = f"blk.{layer}.ffn_{base}_exps.{part}"
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"tensor {name!r} is missing; the file is not a complete MoE model")
        out[kind] = _expert_range(t, kind, want[kind])
    return out


def _expert_range(t: ReaderTensor, kind: str, want: tuple[int, ...]) -> TensorRange:
    """The TensorRange of a whole stacked expert tensor."""
    shape = gio.numpy_shape(t)
    if shape != want:
        raise ModelError(
            f"tensor {t.name!r} has numpy shape {shape}, expected {want} from the metadata"
        )
    gio.check_supported(int(t.tensor_type), t.name)
    nbytes = gio.nbytes_for(int(t.tensor_type), shape)
    if nbytes != int(t.n_bytes):
        raise ModelError(f"tensor {t.name!r} size {t.n_bytes} != computed {nbytes} bytes")
    return TensorRange(
        name=t.name,
        kind=kind,
        offset=int(t.data_offset),
        nbytes=nbytes,
        ggml_type=int(t.tensor_type),
        expert_shape=shape[1:],
    )
