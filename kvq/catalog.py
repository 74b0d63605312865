"""A registered model as every role and the bus see it, without its weights: `ModelMeta`
(every hyper-parameter the forward pass needs, and where each layer's stacked expert tensors
lie in the file), `ModelInfo` (the meta, the slice table and the source workers fetch from),
and the meta's JSON form, the value of `P:{m:M}:meta`'s `meta` field.

`kvq.gguf.meta` fills a `ModelMeta` from a GGUF header, `kvq.gguf.registry` cuts a file into
a `ModelInfo`; this module imports neither numpy, gguf nor torch, so the bus can carry models
without knowing how they are read or run. Fields that have a default in `ModelMeta` may be
absent from a published dict (a layout published by an older kvq); the others must be present
with the right type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace

from kvq.errors import ModelError
from kvq.slices import (
    EXPERT_KINDS,
    STACKED_KINDS,
    SliceSpec,
    TensorRange,
    range_from_dict,
    range_to_dict,
)


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
    expert_act: str = "silu"  # the routed experts' activation (`kvq.gguf.arch.EXPERT_ACTS`)
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
    # llama4 (`kvq.gguf.meta_llama4`): MoE every `moe_layer_step`-th layer, chunked windows,
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


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A registered model: what workers download and coordinators dispatch over."""

    model: str
    source: str  # a path or an http(s) URL workers fetch slices from
    meta: ModelMeta
    slices: dict[str, SliceSpec]
    header_sha256: str = ""  # of the file's bytes before its tensor data ("": not recorded)
    request_shards: int = 1  # request streams clients spread requests over (KVQ_REQUEST_SHARDS)

    @property
    def grain(self) -> str:
        """ "stage" when the model's slices are layer spans served whole (X12), else
        "expert"; one grain per registered model (register a file twice, under two ids, to
        serve it at both)."""
        return "stage" if any(s.is_stage for s in self.slices.values()) else "expert"

    def stages(self) -> list[SliceSpec]:
        """A stage-grain model's spans in layer order (empty at expert grain)."""
        return sorted((s for s in self.slices.values() if s.is_stage), key=lambda s: s.layer_start)

    def layer_slices(self, layer: int) -> list[SliceSpec]:
        return sorted(
            (s for s in self.slices.values() if s.layer_start <= layer < s.layer_end),
            key=lambda s: s.expert_start,
        )


def _as_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"model layout key {key!r} = {value!r} is not an int")
    return value


def _as_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelError(f"model layout key {key!r} = {value!r} is not a number")
    return float(value)


def _as_str(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ModelError(f"model layout key {key!r} = {value!r} is not a str")
    return value


def _as_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ModelError(f"model layout key {key!r} = {value!r} is not a bool")
    return value


def _as_flags(key: str, value: object) -> tuple[bool, ...]:
    """A list of bools, e.g. `sliding_layers`."""
    if not isinstance(value, list | tuple) or len(value) > 4096:
        raise ModelError(f"model layout key {key!r} = {value!r} is not a list of bools")
    return tuple(_as_bool(key, v) for v in value)


def _as_ints(key: str, value: object) -> tuple[int, ...]:
    """A list of ints (JSON has no tuples), e.g. `rope_sections`."""
    if not isinstance(value, list | tuple):
        raise ModelError(f"model layout key {key!r} = {value!r} is not a list of ints")
    return tuple(_as_int(key, v) for v in value)


_CHECKERS = {
    "int": _as_int,
    "float": _as_float,
    "str": _as_str,
    "bool": _as_bool,
    "tuple[bool, ...]": _as_flags,
    "tuple[int, ...]": _as_ints,
}


def meta_to_dict(meta: ModelMeta) -> dict[str, object]:
    """`meta` as a dict of plain values; `expert_tensors` becomes a list over the MoE layers,
    in order (`meta.moe_layers`: the first is layer `leading_dense_block_count`, llama4 every
    `moe_layer_step`-th)."""
    out: dict[str, object] = {
        f.name: list(v) if isinstance(v := getattr(meta, f.name), tuple) else v
        for f in fields(meta)
        if f.name != "expert_tensors"
    }
    out["expert_tensors"] = [
        [
            range_to_dict(meta.expert_tensors[layer][k])
            for k in STACKED_KINDS
            if k in meta.expert_tensors[layer]
        ]
        for layer in sorted(meta.expert_tensors)
    ]
    return out


def meta_from_dict(d: Mapping[str, object]) -> ModelMeta:
    """Inverse of `meta_to_dict`; ModelError naming the first missing or mistyped key."""
    if not isinstance(d, Mapping):
        raise ModelError(f"model layout must be a mapping, got {type(d).__name__}")
    values: dict[str, object] = {}
    for f in fields(ModelMeta):
        if f.name == "expert_tensors":
            continue
        if f.name not in d and f.default is not MISSING:
            continue  # published by an older kvq: keep the default
        if f.name not in d:
            raise ModelError(f"model layout dict lacks key {f.name!r}; republish the model")
        values[f.name] = _CHECKERS[str(f.type)](f.name, d[f.name])
    layers = d.get("expert_tensors")
    if not isinstance(layers, list):
        raise ModelError(f"model layout 'expert_tensors' must be a list, got {layers!r}")
    meta = ModelMeta(**values)  # type: ignore[arg-type]
    moe = meta.moe_layers
    if layers and len(layers) != len(moe):
        raise ModelError(
            f"model layout lists {len(layers)} MoE layers, its metadata "
            f"{len(moe)} ({list(moe)}); republish the model"
        )
    experts = {
        layer: _layer_from_list(layer, rows) for layer, rows in zip(moe, layers, strict=False)
    }
    return replace(meta, expert_tensors=experts)


def _layer_from_list(layer: int, rows: object) -> dict[str, TensorRange]:
    """One layer's gate/up/down ranges (and bias ranges, if any) from their dict form."""
    if not isinstance(rows, list) or len(rows) not in (len(EXPERT_KINDS), len(STACKED_KINDS)):
        raise ModelError(
            f"model layout layer {layer} must list {EXPERT_KINDS} ranges (or "
            f"{STACKED_KINDS}), got {rows!r}"
        )
    ranges = [range_from_dict(row, f"model layout layer {layer}") for row in rows]
    out = {r.kind: r for r in ranges}
    if set(out) != set(STACKED_KINDS[: len(rows)]):
        raise ModelError(
            f"model layout layer {layer} repeats a kind (has {sorted(out)}); need one each "
            f"of {STACKED_KINDS[: len(rows)]}"
        )
    return out
