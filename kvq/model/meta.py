"""Model metadata and the byte layout of expert slices inside a GGUF file.

A slice is experts `[expert_start, expert_end)` of one layer. The stacked expert tensors
`ffn_{gate,up,down}_exps` have experts as their outermost (numpy dim 0) axis, so the slice of
each is one contiguous byte range: `offset + e0 * per_expert`, `(e1 - e0) * per_expert` bytes.
A worker can therefore fetch a slice with three HTTP range requests and decode it from the
published layout alone (see `meta_to_dict`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from gguf import GGUFReader, ReaderTensor

from kvq.errors import ModelError
from kvq.model import gguf_io as gio

SUPPORTED_ARCHS = ("qwen3moe",)
EXPERT_KINDS = ("gate", "up", "down")


@dataclass(frozen=True, slots=True)
class TensorRange:
    """A byte range of an expert tensor in the model file."""

    name: str
    kind: str  # "gate" | "up" | "down"
    offset: int  # absolute byte offset in the file
    nbytes: int
    ggml_type: int
    expert_shape: tuple[int, ...]  # numpy shape of ONE expert's matrix after dequantization


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
    expert_tensors: Mapping[int, Mapping[str, TensorRange]] = field(default_factory=dict)


def read_meta(path: str | Path) -> ModelMeta:
    """Read the header of a GGUF model (memory-mapped; no tensor data is copied)."""
    reader = gio.open_reader(path)
    arch = gio.str_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(
            f"model architecture {arch!r} in {str(path)!r} is not supported; "
            f"kvq serves {', '.join(SUPPORTED_ARCHS)}"
        )
    meta = _meta_fields(reader, arch, os.path.getsize(path))
    experts = {layer: _layer_experts(reader, meta, layer) for layer in range(meta.block_count)}
    return replace(meta, expert_tensors=experts)  # replace keeps the dataclass frozen


def _meta_fields(reader: GGUFReader, arch: str, file_size: int) -> ModelMeta:
    """The scalar metadata of a supported architecture."""
    a = arch
    hidden = gio.int_field(reader, f"{a}.embedding_length")
    heads = gio.int_field(reader, f"{a}.attention.head_count")
    head_dim = gio.int_field(reader, f"{a}.attention.key_length", hidden // heads)
    value_dim = gio.int_field(reader, f"{a}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ModelError(
            f"attention.value_length {value_dim} != key_length {head_dim}; unsupported"
        )
    tokens = gio.field(reader, "tokenizer.ggml.tokens", [], required=False)
    vocab = len(tokens) if tokens else _vocab_from_tensor(reader)
    return ModelMeta(
        arch=arch,
        name=gio.str_field(reader, "general.name", ""),
        block_count=gio.int_field(reader, f"{a}.block_count"),
        expert_count=gio.int_field(reader, f"{a}.expert_count"),
        expert_used_count=gio.int_field(reader, f"{a}.expert_used_count"),
        embedding_length=hidden,
        expert_feed_forward_length=gio.int_field(reader, f"{a}.expert_feed_forward_length"),
        head_count=heads,
        head_count_kv=gio.int_field(reader, f"{a}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_freq_base=gio.float_field(reader, f"{a}.rope.freq_base", 10000.0),
        rms_eps=gio.float_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        context_length=gio.int_field(reader, f"{a}.context_length"),
        vocab_size=vocab,
        bos_id=gio.int_field(reader, "tokenizer.ggml.bos_token_id", -1),
        eos_id=gio.int_field(reader, "tokenizer.ggml.eos_token_id", -1),
        file_size=file_size,
        feed_forward_length=gio.int_field(reader, f"{a}.feed_forward_length", 0),
        tokenizer_model=gio.str_field(reader, "tokenizer.ggml.model", ""),
    )


def _vocab_from_tensor(reader: GGUFReader) -> int:
    """Vocabulary size from `token_embd.weight` when the file has no token list."""
    t = gio.tensor_map(reader).get("token_embd.weight")
    if t is None:
        raise ModelError("GGUF has neither tokenizer.ggml.tokens nor token_embd.weight")
    return gio.numpy_shape(t)[0]


def _layer_experts(reader: GGUFReader, meta: ModelMeta, layer: int) -> dict[str, TensorRange]:
    """Full-tensor ranges of one layer's gate/up/down expert stacks, shape-checked."""
    tensors = gio.tensor_map(reader)
    e, f, h = meta.expert_count, meta.expert_feed_forward_length, meta.embedding_length
    want = {"gate": (e, f, h), "up": (e, f, h), "down": (e, h, f)}
    out: dict[str, TensorRange] = {}
    for kind in EXPERT_KINDS:
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
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


def _check_slice(meta: ModelMeta, layer: int, expert_start: int, expert_end: int) -> None:
    """ModelError unless `layer` exists and `[expert_start, expert_end)` is a non-empty range."""
    for label, v in (("layer", layer), ("expert_start", expert_start), ("expert_end", expert_end)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ModelError(f"{label} must be an int, got {v!r}")
    if not 0 <= layer < meta.block_count:
        raise ModelError(
            f"layer {layer} is out of range; the model has layers 0..{meta.block_count - 1}"
        )
    if not 0 <= expert_start < expert_end <= meta.expert_count:
        raise ModelError(
            f"expert range [{expert_start}, {expert_end}) is invalid; need "
            f"0 <= start < end <= {meta.expert_count} (the layer's expert count)"
        )
    if layer not in meta.expert_tensors:
        raise ModelError(f"layer {layer} has no expert tensor layout in this ModelMeta")


def slice_layout(
    meta: ModelMeta, layer: int, expert_start: int, expert_end: int
) -> list[TensorRange]:
    """Byte ranges of experts `[expert_start, expert_end)` of `layer` in gate, up, down order."""
    _check_slice(meta, layer, expert_start, expert_end)
    out: list[TensorRange] = []
    for kind in EXPERT_KINDS:
        full = meta.expert_tensors[layer][kind]
        per_expert = full.nbytes // meta.expert_count
        out.append(
            TensorRange(
                name=full.name,
                kind=kind,
                offset=full.offset + expert_start * per_expert,
                nbytes=(expert_end - expert_start) * per_expert,
                ggml_type=full.ggml_type,
                expert_shape=full.expert_shape,
            )
        )
    return out


def slice_nbytes(meta: ModelMeta, layer: int, expert_start: int, expert_end: int) -> int:
    """Total bytes a worker downloads for this slice (sum of the three ranges)."""
    return sum(r.nbytes for r in slice_layout(meta, layer, expert_start, expert_end))


# -- plain-dict form, for publishing the layout (JSON / msgpack: ints, floats, strs, lists) --

_RANGE_KEYS = ("name", "kind", "offset", "nbytes", "ggml_type", "expert_shape")


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


_CHECKERS = {"int": _as_int, "float": _as_float, "str": _as_str}


def meta_to_dict(meta: ModelMeta) -> dict[str, object]:
    """`meta` as a dict of plain values; `expert_tensors` becomes a list indexed by layer."""
    out: dict[str, object] = {
        f.name: getattr(meta, f.name) for f in fields(meta) if f.name != "expert_tensors"
    }
    out["expert_tensors"] = [
        [_range_to_dict(meta.expert_tensors[layer][kind]) for kind in EXPERT_KINDS]
        for layer in sorted(meta.expert_tensors)
    ]
    return out


def _range_to_dict(r: TensorRange) -> dict[str, object]:
    return {k: list(r.expert_shape) if k == "expert_shape" else getattr(r, k) for k in _RANGE_KEYS}


def meta_from_dict(d: Mapping[str, object]) -> ModelMeta:
    """Inverse of `meta_to_dict`; ModelError naming the first missing or mistyped key."""
    if not isinstance(d, Mapping):
        raise ModelError(f"model layout must be a mapping, got {type(d).__name__}")
    values: dict[str, object] = {}
    for f in fields(ModelMeta):
        if f.name == "expert_tensors":
            continue
        if f.name not in d:
            raise ModelError(f"model layout dict lacks key {f.name!r}; republish the model")
        values[f.name] = _CHECKERS[str(f.type)](f.name, d[f.name])
    layers = d.get("expert_tensors")
    if not isinstance(layers, list):
        raise ModelError(f"model layout 'expert_tensors' must be a list, got {layers!r}")
    experts = {i: _layer_from_list(i, rows) for i, rows in enumerate(layers)}
    return ModelMeta(**values, expert_tensors=experts)  # type: ignore[arg-type]


def _layer_from_list(layer: int, rows: object) -> dict[str, TensorRange]:
    """One layer's gate/up/down ranges from their dict form."""
    if not isinstance(rows, list) or len(rows) != len(EXPERT_KINDS):
        raise ModelError(
            f"model layout layer {layer} must list {EXPERT_KINDS} ranges, got {rows!r}"
        )
    out: dict[str, TensorRange] = {}
    for row in rows:
        if not isinstance(row, Mapping) or any(k not in row for k in _RANGE_KEYS):
            raise ModelError(f"layer {layer} range {row!r} lacks one of {_RANGE_KEYS}")
        shape = row["expert_shape"]
        if not isinstance(shape, list | tuple):
            raise ModelError(f"layer {layer} expert_shape {shape!r} is not a list of ints")
        r = TensorRange(
            name=_as_str("name", row["name"]),
            kind=_as_str("kind", row["kind"]),
            offset=_as_int("offset", row["offset"]),
            nbytes=_as_int("nbytes", row["nbytes"]),
            ggml_type=_as_int("ggml_type", row["ggml_type"]),
            expert_shape=tuple(_as_int("expert_shape", s) for s in shape),
        )
        if r.kind not in EXPERT_KINDS:
            raise ModelError(f"layer {layer} range kind {r.kind!r} is not one of {EXPERT_KINDS}")
        out[r.kind] = r
    if len(out) != len(EXPERT_KINDS):
        raise ModelError(
            f"model layout layer {layer} repeats a kind; need one each of {EXPERT_KINDS}"
        )
    return out
