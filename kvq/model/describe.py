"""A plain-dict description of a GGUF model: hyper-parameters, quant types, slice table."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvq.errors import ModelError
from kvq.model import gguf_io as gio
from kvq.model.arch import arch_spec
from kvq.model.layout import slice_nbytes
from kvq.model.meta import ModelMeta, read_meta
from kvq.slices import slice_grid

_LAYER = re.compile(r"^blk\.\d+\.")


def describe_model(path: str | Path, slice_experts: int = 4) -> dict[str, Any]:
    """Everything `kvq model inspect` shows; `slices` cuts each layer into `slice_experts`."""
    if slice_experts < 1:
        raise ModelError(f"slice_experts {slice_experts} must be >= 1")
    meta = read_meta(path)
    spec = arch_spec(meta.arch)
    out: dict[str, Any] = {"path": str(path)}
    out.update({f.name: getattr(meta, f.name) for f in fields(meta) if f.name != "expert_tensors"})
    out.update(rope_style=spec.rope_style, qk_norm=spec.qk_norm, shared_expert=spec.shared_expert)
    out["quant_types"] = quant_types(path)
    out["slice_experts"] = slice_experts
    out["slices"] = slice_table(meta, slice_experts)
    out["expert_bytes"] = sum(s["bytes"] for s in out["slices"])
    return out


def quant_types(path: str | Path) -> dict[str, dict[str, int]]:
    """Per tensor kind (name without `blk.N.`), how many tensors use each ggml type."""
    kinds: dict[str, Counter[str]] = {}
    for t in gio.open_reader(path).tensors:
        kind = _LAYER.sub("", t.name).removesuffix(".weight")
        kinds.setdefault(kind, Counter())[gio.quant_type(int(t.tensor_type)).name] += 1
    return {k: dict(sorted(c.items())) for k, c in sorted(kinds.items())}


def slice_table(meta: ModelMeta, slice_experts: int) -> list[dict[str, int]]:
    """Every (layer, expert range) slice at expert grain, with its download size in bytes."""
    return [
        {"layer": b.layer_start, "expert_start": b.expert_start, "expert_end": b.expert_end,
         "bytes": slice_nbytes(meta, b.layer_start, b.expert_start, b.expert_end)}
        for b in slice_grid(meta.block_count, meta.expert_count, 1, slice_experts)
    ]  # fmt: skip
