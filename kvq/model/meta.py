"""Model metadata read from a GGUF header: every hyper-parameter the forward pass needs, and
where each layer's stacked expert tensors lie in the file (see `kvq.model.layout`).

Everything is validated here, before any weight is read: the architecture, each tensor's quant
type, the expert tensors' shapes, and that the file stores experts stacked (one tensor per
layer and kind), which is what makes a slice a contiguous byte range.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf import GGUFReader, ReaderTensor

from kvq.errors import ModelError
from kvq.model import gguf_io as gio
from kvq.model.arch import MLA, SUPPORTED_TEXT, ArchSpec, arch_spec
from kvq.model.meta_llama4 import layer_pattern, llama4_fields

EXPERT_KINDS = ("gate", "up", "down")
# the experts' biases (gpt-oss), stacked like the matrices: [E, F], [E, F], [E, H]
BIAS_KINDS = ("gate_b", "up_b", "down_b")
STACKED_KINDS = EXPERT_KINDS + BIAS_KINDS  # the order of a slice's ranges
ROPE_SCALINGS = ("none", "linear", "yarn")
# a backbone file (`kvq model split --backbone`, `kvq.model.split`) says so under this key
ROUTED_EXPERTS_KEY = "kvq.routed_experts"
ROUTED_EXPERTS_ABSENT = "absent"


@dataclass(frozen=True, slots=True)
class TensorRange:
    """A byte range of an expert tensor in the model file."""

    name: str
    kind: str  # "gate" | "up" | "down", or a bias: "gate_b" | "up_b" | "down_b"
    offset: int  # absolute byte offset in the file
    nbytes: int
    ggml_type: int
    expert_shape: tuple[int, ...]  # numpy shape of ONE expert's matrix (or bias vector)


@dataclass(frozen=True)
class ModelMeta:
    """Everything about a model except its weights. `expert_tensors[layer][kind]` spans all
    experts of that layer's stacked tensor (use `slice_layout` for a sub-range)."""

    arch: str
    name: str
    block_count: int
    expert_count: int
    expert_used_count: int
    embedding_length: int
    expert_feed_forward_length: int
    head_count: int
    head_count_kv: int
    head_dim: int
    rope_freq_base: float
    rms_eps: float
    context_length: int
    vocab_size: int
    bos_id: int
    eos_id: int
    file_size: int
    feed_forward_length: int = 0
    tokenizer_model: str = ""
    rope_scaling_type: str = "none"  # none | linear | yarn
    rope_scaling_factor: float = 1.0
    rope_original_context_length: int = 0  # yarn: the pre-training context
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    attention_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    expert_weights_norm: bool = True  # renormalise the top-k weights to sum 1
    expert_weights_scale: float = 1.0  # multiplies the top-k weights
    expert_shared_feed_forward_length: int = 0  # the shared expert(s)' total width; 0 if none
    expert_gating: str = "softmax"  # the router's scores: softmax | sigmoid
    expert_group_count: int = 1  # group-limited routing: experts in this many equal groups
    expert_group_used_count: int = 1  # ... of which the best this many are kept per token
    leading_dense_block_count: int = 0  # layers [0, n) run a dense FFN, the rest are MoE
    nextn_predict_layers: int = 0  # MTP blocks after the trunk (in the file, not run)
    rope_dim: int = 0  # dimensions rope rotates (rope.dimension_count); 0: the head size
    rope_yarn_log_mul: float = (
        0.0  # rope.scaling.yarn_log_multiplier (deepseek2: 0.1 x mscale_all_dim)
    )
    q_lora_rank: int = 0  # MLA: rank of q's LoRA (0: a plain attn_q, as DeepSeek-V2-Lite)
    kv_lora_rank: int = 0  # MLA: size of the compressed KV latent; 0 for every non-MLA arch
    value_head_dim: int = 0  # MLA: each head's value size (v_head_dim); 0: the head size
    sliding_window: int = 0  # positions a sliding layer sees (itself included); 0: none
    sliding_window_pattern: int = 0  # layers i % p < p - 1 slide (p = 0: all of them)
    sliding_layers: tuple[bool, ...] = ()  # the pattern as a per-layer array, when so given
    rope_freq_base_swa: float = 0.0  # the sliding layers' rope base; 0: rope_freq_base
    expert_act: str = "silu"  # the routed experts' activation (`kvq.model.arch.EXPERT_ACTS`)
    # Gated DeltaNet (qwen35moe, `kvq.model.deltanet`); full_attention_interval 0: no such layers
    full_attention_interval: int = 0  # layer i is full attention when (i + 1) % this == 0
    recurrent_list: tuple[int, ...] = ()  # attention.recurrent_layers, where the file has it
    ssm_conv_kernel: int = 0  # ssm.conv_kernel: the causal conv's taps
    ssm_state_size: int = 0  # ssm.state_size: each q/k/v head's size
    ssm_group_count: int = 0  # ssm.group_count: q/k heads
    ssm_time_step_rank: int = 0  # ssm.time_step_rank: value heads
    # IMROPE (qwen35moe): rope.dimension_sections [t, h, w, e]; a text token has its position
    # in t, h and w and 0 in e, so the pairs of an e section are not rotated (`Rope`)
    rope_sections: tuple[int, ...] = ()
    # llama4 (`kvq.model.meta_llama4`): MoE every `moe_layer_step`-th layer, chunked windows,
    # NoPE layers, q/k RMS norm and the NoPE layers' attention temperature
    moe_layer_step: int = 1  # layer i is MoE when (i + 1 - leading dense) % this == 0
    swa_chunked: bool = False  # the sliding layers attend within chunks of `sliding_window`
    no_rope_step: int = 0  # layer i has no rope when (i + 1) % this == 0; 0: all rope
    kq_norm: bool = False  # unweighted RMS norm of q and k after rope (rope layers)
    attn_temp_floor: int = 0  # NoPE layers: q * (1 + scale ln(floor((p + 1) / floor) + 1))
    attn_temp_scale: float = 0.0  # ... with this scale; floor 0: no temperature tuning
    expert_tensors: Mapping[int, Mapping[str, TensorRange]] = field(default_factory=dict)

    @property
    def holds_experts(self) -> bool:
        """Whether the file holds its routed experts (False: a backbone file, whose
        `expert_tensors` is empty; workers hold them)."""
        return bool(self.expert_tensors)

    def expert_types(self) -> set[int]:
        """The ggml types the expert tensors are stored in."""
        return {r.ggml_type for layer in self.expert_tensors.values() for r in layer.values()}

    @property
    def moe_layers(self) -> range:
        """The layers whose FFN is the routed experts (the others are dense): all after the
        leading dense ones, or every `moe_layer_step`-th (llama4)."""
        step = self.moe_layer_step
        return range(self.leading_dense_block_count + step - 1, self.block_count, step)

    def window(self, layer: int) -> int:
        """Positions `layer` attends to (the newest ones), or 0 for all of them."""
        p = self.sliding_window_pattern
        if self.sliding_layers:
            slides = self.sliding_layers[layer]
        else:
            slides = p == 0 or layer % p < p - 1
        return self.sliding_window if self.sliding_window > 0 and slides else 0

    def chunk(self, layer: int) -> int:
        """The chunk `layer` attends within (llama4: query p sees keys from
        `p // chunk * chunk`), or 0 for none."""
        return self.window(layer) if self.swa_chunked else 0

    def ropes(self, layer: int) -> bool:
        """Whether `layer` rotates q and k (llama4's NoPE layers do not)."""
        n = self.no_rope_step
        return n <= 0 or (layer + 1) % n != 0

    @property
    def recurrent_layers(self) -> list[int]:
        """The Gated DeltaNet layers (a recurrent state per sequence, no KV cache): the file's
        `attention.recurrent_layers` where it has that array, else every layer but each
        `full_attention_interval`-th."""
        if self.recurrent_list:
            return list(self.recurrent_list)
        n = self.full_attention_interval
        return [i for i in range(self.block_count) if n and (i + 1) % n]

    @property
    def rope_dims(self) -> int:
        """How many dimensions of each head rope rotates."""
        return self.rope_dim or self.head_dim

    @property
    def cache_width(self) -> tuple[int, int]:
        """(kv heads, values per head) a KV cache stores per token and layer: K and V of each
        kv head, or, for MLA, one latent of `kv_lora_rank + rope_dims` values (the values
        are its first `kv_lora_rank`, stored once)."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.rope_dims
        return self.head_count_kv, self.head_dim


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
        raise ModelError(f"{a}.rope.dimension_sections = {raw!r} is not four section sizes "
                         "with a positive t, h or w")  # fmt: skip
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
    want = {"gate": (e, f, h), "up": (e, f, h), "down": (e, h, f),
            "gate_b": (e, f), "up_b": (e, f), "down_b": (e, h)}  # fmt: skip
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
