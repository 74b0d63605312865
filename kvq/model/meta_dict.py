"""ModelMeta as plain values (ints, floats, strs, bools, lists of ints) for publishing over
Redis/JSON.

Fields that have a default in `ModelMeta` may be absent (a layout published by an older kvq);
the others must be present with the right type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields, replace

from kvq.errors import ModelError
from kvq.model.meta import EXPERT_KINDS, STACKED_KINDS, ModelMeta, TensorRange
from kvq.slices import range_from_dict, range_to_dict


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
    "int": _as_int, "float": _as_float, "str": _as_str, "bool": _as_bool,
    "tuple[bool, ...]": _as_flags, "tuple[int, ...]": _as_ints,
}  # fmt: skip


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
        raise ModelError(f"model layout lists {len(layers)} MoE layers, its metadata "
                         f"{len(moe)} ({list(moe)}); republish the model")  # fmt: skip
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
