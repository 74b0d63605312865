"""Model records of real models' shapes, for tests of what an operator sees at their scale."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvq.catalog import ModelInfo
from kvq.gguf.registry import plan_model
from kvq.slices import SliceSpec, slice_id


def deepseek_v3_record(tiny: Path) -> ModelInfo:
    """A registration of DeepSeek-V3's shape: 61 blocks, the first 3 dense, 256 experts; at 4
    experts a slice, 58 x 64 = 3,712 slices (byte ranges borrowed from a tiny file: nothing
    is downloaded)."""
    info = plan_model("dsv3", tiny, 1, 4)
    rng = next(iter(info.slices.values())).ranges[:1]
    slices = {}
    for layer in range(3, 61):
        for g in range(64):
            sid = slice_id(layer, layer + 1, 4 * g, 4 * g + 4)
            slices[sid] = SliceSpec(sid, layer, layer + 1, 4 * g, 4 * g + 4, rng, ("0" * 64,))
    layer0 = info.meta.expert_tensors[0]
    meta = dataclasses.replace(
        info.meta,
        block_count=61,
        leading_dense_block_count=3,
        expert_count=256,
        expert_used_count=8,
        expert_tensors=dict.fromkeys(range(3, 61), layer0),
    )
    return ModelInfo("dsv3", info.source, meta, slices, info.header_sha256)
