"""A model as the swarm knows it: id, source, layout and slice table with checksums (K8).

`plan_model` reads a GGUF file once and cuts it into slices; the monitor publishes the result
through the board (`Board.register_model`), workers and coordinators read it back
(`Board.model_info`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from kvq.catalog import ModelInfo, ModelMeta
from kvq.errors import ConfigError, ModelMismatch
from kvq.gguf import reader as gio
from kvq.gguf.layout import slice_layout
from kvq.gguf.meta import read_meta
from kvq.gguf.remote import check_source
from kvq.gguf.split import BackboneSource
from kvq.slices import SliceSpec, TensorRange, slice_grid, stage_grid

log = logging.getLogger("kvq.model")


def plan_slices(
    meta: ModelMeta, path: str | Path, slice_layers: int, slice_experts: int
) -> list[SliceSpec]:
    """Cut the model into slices and checksum every byte range of each."""
    out = []
    with open(path, "rb") as f:
        moe = meta.moe_layers
        grid = slice_grid(
            meta.block_count, meta.expert_count, slice_layers, slice_experts, moe.start, moe.step
        )
        for bounds in grid:
            ls, le, es, ee = bounds
            layers = range(ls, le, moe.step)
            ranges = [r for layer in layers for r in slice_layout(meta, layer, es, ee)]
            sums = []
            for r in ranges:
                f.seek(r.offset)
                sums.append(hashlib.sha256(f.read(r.nbytes)).hexdigest())
            out.append(SliceSpec(bounds.sid, *bounds, tuple(ranges), tuple(sums), moe.step))
    return out


# a stage-grain coordinator's own tensors; every other one outside the blocks (llama4's
# `rope_freqs`) goes with every stage
_HEAD_TENSORS = ("token_embd.weight", "output.weight", "output_norm.weight")


def plan_stages(meta: ModelMeta, path: str | Path, stage_layers: int) -> list[SliceSpec]:
    """Cut the model into stage slices (X12): spans of `stage_layers` blocks, each the
    file's header plus every tensor of its blocks, with their checksums."""
    reader = gio.open_reader(path)
    header = TensorRange("", "header", 0, int(reader.data_offset), 0, ())
    blocks: dict[int, list[TensorRange]] = {}  # -1: the tensors every block reads
    for t in reader.tensors:
        if t.name in _HEAD_TENSORS:
            continue  # the embedding, the output head and its norm stay with the coordinator
        parts = t.name.split(".")
        block = int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1
        blocks.setdefault(block, []).append(
            TensorRange(
                t.name,
                "tensor",
                int(t.data_offset),
                int(t.n_bytes),
                int(t.tensor_type),
                gio.numpy_shape(t),
            )
        )
    out = []
    with open(path, "rb") as f:
        for bounds in stage_grid(meta.block_count, meta.expert_count, stage_layers):
            ranges = [header] + [
                r
                for layer in (-1, *range(bounds.layer_start, bounds.layer_end))
                for r in sorted(blocks.get(layer, []), key=lambda r: r.offset)
            ]
            sums = []
            for r in ranges:
                f.seek(r.offset)
                sums.append(hashlib.sha256(f.read(r.nbytes)).hexdigest())
            out.append(SliceSpec(bounds.sid, *bounds, tuple(ranges), tuple(sums), grain="stage"))
    return out


def plan_model(
    model: str,
    path: str | Path,
    slice_layers: int,
    slice_experts: int,
    source: str | None = None,
    request_shards: int = 1,
    grain: str = "expert",
    stage_layers: int = 4,
) -> ModelInfo:
    """Read `path`'s layout and cut it into slices of `grain` (expert: `slice_layers` x
    `slice_experts`; stage: spans of `stage_layers`); `source` defaults to the resolved
    path."""
    if "#" in model or not model:
        raise ConfigError(
            f"model id {model!r} is not allowed: it must be non-empty and hold no '#' "
            "(which names a model's request shards: P:{m:MODEL#I}:requests)"
        )
    if source is not None:
        check_source(source)
    path = Path(path).resolve()
    meta = read_meta(path)
    if not meta.holds_experts:
        raise ConfigError(
            f"{str(path)!r} is a backbone file (kvq model split --backbone): workers could not "
            f"fetch model {model!r}'s experts from it; register the full file it was split "
            "from, and start the coordinator on the backbone file"
        )
    if grain == "stage":
        slices = plan_stages(meta, path, stage_layers)
    else:
        slices = plan_slices(meta, path, slice_layers, slice_experts)
    by_id = {s.sid: s for s in slices}
    return ModelInfo(model, source or str(path), meta, by_id, header_sha256(path), request_shards)


def header_sha256(path: str | Path) -> str:
    """sha256 of everything before the tensor data: the GGUF header, every metadata key and
    value (architecture, hyper-parameters, tokenizer) and the tensor table."""
    return gio.header_sha256(path)


def check_backbone_file(info: ModelInfo, path: str | Path, source: BackboneSource) -> None:
    """Refuse (ModelMismatch) a backbone file split from another file than the one registered
    as `info.model`: workers fetch its experts from that registration. The full file's size
    and metadata hash recorded at the split must match it (a full file with the same layout
    and metadata but other expert weights is not told apart: docs/limits.md)."""
    what = (
        f"backbone file {str(path)!r} was not split from the file registered as model "
        f"{info.model!r} (from {info.source!r})"
    )
    fix = "split the registered file (kvq model split FILE --backbone OUT), or register its source"
    if source.size != info.meta.file_size:
        raise ModelMismatch(
            f"{what}: its source had {source.size} bytes, registered {info.meta.file_size}; {fix}"
        )
    if info.header_sha256 and source.header_sha256 != info.header_sha256:
        raise ModelMismatch(
            f"{what}: source metadata sha256 {source.header_sha256[:16]}..., "
            f"registered {info.header_sha256[:16]}...; {fix}"
        )
    if not info.header_sha256:
        log.warning(
            "model %s was registered without a metadata hash; only the size of the "
            "backbone file's source is checked",
            info.model,
        )


def check_model_file(info: ModelInfo, path: str | Path) -> None:
    """Refuse (ModelMismatch) a file that is not the one registered as `info.model`: its size,
    its metadata hash, and the checksum of one expert range must match the registration."""
    what = (
        f"{str(path)!r} is not the file registered as model {info.model!r} (from {info.source!r})"
    )
    fix = "start the coordinator with that file, or register this one (kvq monitor --model)"
    size = os.path.getsize(path)
    if size != info.meta.file_size:
        raise ModelMismatch(f"{what}: {size} bytes, registered {info.meta.file_size}; {fix}")
    if not info.header_sha256:
        log.warning(
            "model %s was registered without a metadata hash; only its size and expert "
            "checksums are checked",
            info.model,
        )
    elif (got := header_sha256(path)) != info.header_sha256:
        raise ModelMismatch(
            f"{what}: metadata sha256 {got[:16]}..., registered {info.header_sha256[:16]}...; {fix}"
        )
    first = min(info.slices.values(), key=lambda s: (s.layer_start, s.expert_start), default=None)
    if first is None or not first.ranges:
        return
    r, want = first.ranges[0], first.sha256[0]
    with open(path, "rb") as f:
        f.seek(r.offset)
        got = hashlib.sha256(f.read(r.nbytes)).hexdigest()
    if got != want:  # same layout, other weights (another seed, another fine-tune)
        raise ModelMismatch(
            f"{what}: expert bytes of {r.name} at offset {r.offset} differ "
            f"(sha256 {got[:16]}..., registered {want[:16]}...); {fix}"
        )
