"""Slices: layers [ls, le) x experts [es, ee) of one model, the unit a worker downloads and
serves and the swarm places.

This module owns the concept for every role:
- its id, `L000-001:E0000-0004`: readable, and sorting ids sorts slices by their numbers;
- the grid (`slice_grid`): how a model's layers x experts are cut into slices;
- `SliceSpec`: a slice's byte ranges in the model file with their sha256, and its JSON text,
  the value of `P:{m:M}:slices[sid]`:

      {"layers": [ls, le], "experts": [es, ee], "bytes": n,
       "ranges": [{"name", "kind", "offset", "nbytes", "ggml_type", "expert_shape", "sha256"}]}

  with `"step": n` too where only every n-th layer of [ls, le) is MoE (llama4's interleaved
  layers: the slice holds layers ls, ls + n, ...);
- stage slices (X12, `"grain": "stage"`): layers [ls, le) served whole, attention and all,
  over every expert: their ranges are the file's header (kind `header`, so that the holder
  reads the span's tensors by name from a sparse copy of the file) and every tensor of those
  blocks (kind `tensor`), each with its sha256 (`stage_grid` cuts the layers);

- `TensorRange`, one expert tensor's byte range in the file, and its dict form, which
  `kvq.catalog` uses for whole layers.

A slice's dequantized tensors are a `kvq.model.ExpertSlice`. This module imports no torch, so
the swarm (pure routing) can use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kvq.errors import ConfigError, ModelError

_SLICE_ID = re.compile(r"L(\d{3,})-(\d{3,}):E(\d{4,})-(\d{4,})")
_SHA256 = re.compile(r"[0-9a-f]{64}")
EXPERT_KINDS = ("gate", "up", "down")
# the experts' biases (gpt-oss), stacked like the matrices: [E, F], [E, F], [E, H]
BIAS_KINDS = ("gate_b", "up_b", "down_b")
STACKED_KINDS = EXPERT_KINDS + BIAS_KINDS  # the order of a slice's ranges
# a stage slice's ranges: the file's header, then each tensor of its blocks whole
STAGE_KINDS = ("header", "tensor")
GRAINS = ("expert", "stage")
RANGE_KEYS = ("name", "kind", "offset", "nbytes", "ggml_type", "expert_shape")
_REPUBLISH = "re-register the model (kvq monitor --model ID=PATH)"


@dataclass(frozen=True, slots=True)
class TensorRange:
    """A byte range of an expert tensor in the model file."""

    name: str
    kind: str  # "gate" | "up" | "down", or a bias: "gate_b" | "up_b" | "down_b"
    offset: int  # absolute byte offset in the file
    nbytes: int
    ggml_type: int
    expert_shape: tuple[int, ...]  # numpy shape of ONE expert's matrix (or bias vector)


def slice_id(layer_start: int, layer_end: int, expert_start: int, expert_end: int) -> str:
    """Readable, sortable id of a slice: layers [ls, le) x experts [es, ee)."""
    return f"L{layer_start:03d}-{layer_end:03d}:E{expert_start:04d}-{expert_end:04d}"


def parse_slice_id(sid: str) -> tuple[int, int, int, int]:
    """Inverse of `slice_id`; ValueError on anything else."""
    m = _SLICE_ID.fullmatch(sid)
    if m is None or slice_id(*(int(g) for g in m.groups())) != sid:
        raise ValueError(f"not a slice id: {sid!r} (want e.g. {slice_id(0, 1, 0, 4)!r})")
    ls, le, es, ee = (int(g) for g in m.groups())
    return ls, le, es, ee


class SliceBounds(NamedTuple):
    """Layers [layer_start, layer_end) x experts [expert_start, expert_end)."""

    layer_start: int
    layer_end: int
    expert_start: int
    expert_end: int

    @property
    def sid(self) -> str:
        return slice_id(*self)

    def __str__(self) -> str:
        ls, le, es, ee = self
        return f"layers [{ls}, {le}) x experts [{es}, {ee})"


def slice_grid(
    layers: int,
    experts: int,
    slice_layers: int,
    slice_experts: int,
    first: int = 0,
    step: int = 1,
) -> list[SliceBounds]:
    """The slices that cut layers `[first, layers)` x `experts` exactly once each, in slice
    order (layer range, then expert range); the last range of an axis is shorter when the size
    does not divide it. `first`: the first MoE layer (the leading dense layers have no
    experts to cut); `step`: only every `step`-th layer from `first` on is MoE (llama4), and
    a slice holds `slice_layers` of those."""
    for name, n, least in (
        ("layers", layers, 0),
        ("experts", experts, 0),
        ("slice_layers", slice_layers, 1),
        ("slice_experts", slice_experts, 1),
        ("step", step, 1),
    ):
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise ConfigError(f"{name} must be an int >= {least}, got {n!r}")
    span = (slice_layers - 1) * step + 1  # from a slice's first MoE layer past its last
    return [
        SliceBounds(ls, min(ls + span, layers), es, min(es + slice_experts, experts))
        for ls in range(first, layers, slice_layers * step)
        for es in range(0, experts, slice_experts)
    ]


def stage_grid(layers: int, experts: int, stage_layers: int) -> list[SliceBounds]:
    """The stage slices that cut layers `[0, layers)` into spans of `stage_layers` (the last
    one shorter when it does not divide), each over every expert."""
    for name, n in (("layers", layers), ("experts", experts), ("stage_layers", stage_layers)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {n!r}")
    return [
        SliceBounds(ls, min(ls + stage_layers, layers), 0, experts)
        for ls in range(0, layers, stage_layers)
    ]


# -- TensorRange as plain values ---------------------------------------------------------------
def range_to_dict(r: TensorRange) -> dict[str, object]:
    """`r` as JSON values, keys in `RANGE_KEYS` order."""
    return {k: list(r.expert_shape) if k == "expert_shape" else getattr(r, k) for k in RANGE_KEYS}


def range_from_dict(row: object, where: str) -> TensorRange:
    """Inverse of `range_to_dict` (other keys are ignored); ModelError naming `where` and the
    missing or mistyped key."""
    if not isinstance(row, Mapping) or any(k not in row for k in RANGE_KEYS):
        raise ModelError(f"{where}: range {row!r} lacks one of {RANGE_KEYS}")
    shape = row["expert_shape"]
    if not isinstance(shape, list | tuple):
        raise ModelError(f"{where}: expert_shape {shape!r} is not a list of ints")
    r = TensorRange(
        name=_as_str(where, "name", row["name"]),
        kind=_as_str(where, "kind", row["kind"]),
        offset=_as_int(where, "offset", row["offset"]),
        nbytes=_as_int(where, "nbytes", row["nbytes"]),
        ggml_type=_as_int(where, "ggml_type", row["ggml_type"]),
        expert_shape=tuple(_as_int(where, "expert_shape", s) for s in shape),
    )
    if r.kind not in STACKED_KINDS + STAGE_KINDS:
        raise ModelError(
            f"{where}: range kind {r.kind!r} is not one of {STACKED_KINDS + STAGE_KINDS}"
        )
    return r


def _as_int(where: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{where}: key {key!r} = {value!r} is not an int")
    return value


def _as_str(where: str, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ModelError(f"{where}: key {key!r} = {value!r} is not a str")
    return value


# -- SliceSpec -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SliceSpec:
    """A published slice: its bounds, the byte ranges of its expert tensors in the model file
    (layer by layer, gate/up/down within a layer) and the sha256 of each range. `layer_step`
    n > 1: its layers are every n-th of [layer_start, layer_end) (llama4's MoE layers)."""

    sid: str
    layer_start: int
    layer_end: int
    expert_start: int
    expert_end: int
    ranges: tuple[TensorRange, ...]
    sha256: tuple[str, ...]  # one per range
    layer_step: int = 1
    grain: str = "expert"  # "stage": the layers served whole (X12), ranges header + tensors

    def __post_init__(self) -> None:
        b = self.bounds
        if not (0 <= b.layer_start < b.layer_end and 0 <= b.expert_start < b.expert_end):
            raise ModelError(f"slice {self.sid!r}: {b} is empty or negative; {_REPUBLISH}")
        if self.sid != b.sid:
            raise ModelError(f"slice id {self.sid!r} does not name {b} ({b.sid!r}); {_REPUBLISH}")
        if self.layer_step < 1:
            raise ModelError(f"slice {self.sid!r}: step {self.layer_step} < 1; {_REPUBLISH}")
        if self.grain not in GRAINS:
            raise ModelError(f"slice {self.sid!r}: grain {self.grain!r} is not one of {GRAINS}")
        if self.is_stage:
            if not self.ranges or self.ranges[0].kind != "header" or self.layer_step != 1:
                raise ModelError(
                    f"stage slice {self.sid!r} must start with the file's header range and "
                    f"have step 1; {_REPUBLISH}"
                )
        elif not self.ranges or len(self.ranges) % len(self.layers()):
            raise ModelError(
                f"slice {self.sid!r}: {len(self.ranges)} ranges do not split evenly over layers "
                f"[{b.layer_start}, {b.layer_end}) step {self.layer_step}; {_REPUBLISH}"
            )
        if len(self.sha256) != len(self.ranges):
            raise ModelError(
                f"slice {self.sid!r}: {len(self.sha256)} checksums for {len(self.ranges)} "
                f"ranges; {_REPUBLISH}"
            )

    @property
    def is_stage(self) -> bool:
        """Whether the slice is a layer span served whole (X12), not routed experts."""
        return self.grain == "stage"

    @property
    def bounds(self) -> SliceBounds:
        return SliceBounds(self.layer_start, self.layer_end, self.expert_start, self.expert_end)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)

    def layers(self) -> range:
        return range(self.layer_start, self.layer_end, self.layer_step)

    def ranges_of(self, layer: int) -> list[TensorRange]:
        """The ranges of one of the slice's layers, in gate, up, down order."""
        layers = self.layers()
        if layer not in layers or self.is_stage:
            what = "stage slice, whose ranges are whole tensors" if self.is_stage else "slice"
            raise ModelError(f"layer {layer} is not in {what} {self.sid!r}")
        per_layer = len(self.ranges) // len(layers)
        i = layers.index(layer) * per_layer
        return list(self.ranges[i : i + per_layer])

    def to_dict(self) -> dict[str, object]:
        """The published form as plain values (`to_json` is its JSON text)."""
        out: dict[str, object] = {
            "layers": [self.layer_start, self.layer_end],
            "experts": [self.expert_start, self.expert_end],
            "bytes": self.nbytes,
            "ranges": [
                {**range_to_dict(r), "sha256": h}
                for r, h in zip(self.ranges, self.sha256, strict=True)
            ],
        }
        if self.layer_step != 1:
            out["step"] = self.layer_step
        if self.is_stage:
            out["grain"] = self.grain
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, sid: str, doc: object) -> SliceSpec:
        """Inverse of `to_dict` for the slice published under `sid`; ModelError naming the
        missing or mistyped key."""
        where = f"slice {sid!r}"
        if not isinstance(doc, Mapping):
            raise ModelError(f"{where} must be a JSON object, got {doc!r}; {_REPUBLISH}")
        ls, le = _pair(where, doc, "layers")
        es, ee = _pair(where, doc, "experts")
        rows = doc.get("ranges")
        if not isinstance(rows, list):
            raise ModelError(f"{where}: 'ranges' must be a list, got {rows!r}; {_REPUBLISH}")
        ranges = tuple(range_from_dict(row, f"{where} range {i}") for i, row in enumerate(rows))
        sums = tuple(_sha256(f"{where} range {i}", row) for i, row in enumerate(rows))
        step = _as_int(where, "step", doc.get("step", 1))
        grain = _as_str(where, "grain", doc.get("grain", "expert"))
        spec = cls(sid, ls, le, es, ee, ranges, sums, step, grain)
        if _as_int(where, "bytes", doc.get("bytes")) != spec.nbytes:
            raise ModelError(
                f"{where}: 'bytes' = {doc.get('bytes')!r}, its ranges sum to {spec.nbytes}; "
                f"{_REPUBLISH}"
            )
        return spec

    @classmethod
    def from_json(cls, sid: str, text: str | bytes) -> SliceSpec:
        """Inverse of `to_json`; ModelError saying what is wrong with `text`."""
        try:
            doc = json.loads(text)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
            raise ModelError(f"slice {sid!r} is not JSON text ({exc}); {_REPUBLISH}") from None
        return cls.from_dict(sid, doc)


def _pair(where: str, doc: Mapping[str, object], key: str) -> tuple[int, int]:
    v = doc.get(key)
    if not isinstance(v, list) or len(v) != 2:
        raise ModelError(f"{where}: {key!r} must be [start, end], got {v!r}; {_REPUBLISH}")
    return _as_int(where, key, v[0]), _as_int(where, key, v[1])


def _sha256(where: str, row: Mapping[str, object]) -> str:
    h = row.get("sha256")
    if not isinstance(h, str) or _SHA256.fullmatch(h) is None:
        raise ModelError(f"{where}: 'sha256' = {h!r} is not 64 lowercase hex digits")
    return h
