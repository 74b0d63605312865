"""A model as the swarm knows it: id, source, layout and slice table with checksums (K8).

`plan_model` reads a GGUF file once and cuts it into slices; the monitor publishes the result
through the board (`Board.register_model`), workers and coordinators read it back
(`Board.model_info`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kvq.model.layout import slice_layout
from kvq.model.meta import ModelMeta, read_meta
from kvq.slices import SliceSpec, slice_grid


def plan_slices(
    meta: ModelMeta, path: str | Path, slice_layers: int, slice_experts: int
) -> list[SliceSpec]:
    """Cut the model into slices and checksum every byte range of each."""
    out = []
    with open(path, "rb") as f:
        for bounds in slice_grid(meta.block_count, meta.expert_count, slice_layers, slice_experts):
            ls, le, es, ee = bounds
            ranges = [r for layer in range(ls, le) for r in slice_layout(meta, layer, es, ee)]
            sums = []
            for r in ranges:
                f.seek(r.offset)
                sums.append(hashlib.sha256(f.read(r.nbytes)).hexdigest())
            out.append(SliceSpec(bounds.sid, *bounds, tuple(ranges), tuple(sums)))
    return out


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A registered model: what workers download and coordinators dispatch over."""

    model: str
    source: str  # a path or an http(s) URL workers fetch slices from
    meta: ModelMeta
    slices: dict[str, SliceSpec]

    def layer_slices(self, layer: int) -> list[SliceSpec]:
        return sorted(
            (s for s in self.slices.values() if s.layer_start <= layer < s.layer_end),
            key=lambda s: s.expert_start,
        )


def plan_model(
    model: str, path: str | Path, slice_layers: int, slice_experts: int,
    source: str | None = None,
) -> ModelInfo:  # fmt: skip
    """Read `path`'s layout and cut it into slices; `source` defaults to the resolved path."""
    path = Path(path).resolve()
    meta = read_meta(path)
    slices = plan_slices(meta, path, slice_layers, slice_experts)
    return ModelInfo(model, source or str(path), meta, {s.sid: s for s in slices})
