"""A stage holder's copy of its span (X12): the file's header and exactly the span's tensor
bytes, written at their own offsets into a sparse file.

A stage slice's ranges (`kvq.slices`, grain "stage") are the GGUF header, which names every
tensor of the model and where it lies, and each tensor of the span's blocks. Written back at
their offsets, they make a file that reads as the original for every tensor the span uses;
the rest is holes, which take no disk and are never read (`Backbone.from_gguf` with
`span=` and `head=False` maps only the span's blocks). The holder verifies each range's sha256
before it writes (`kvq.worker.fetch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvq.errors import ModelError
from kvq.gguf.meta import read_meta
from kvq.model.backbone import Backbone
from kvq.slices import SliceSpec


def write_stage_file(
    spec: SliceSpec, blobs: Sequence[bytes], path: str | Path, file_size: int
) -> Path:
    """Write `spec`'s ranges (`blobs`, in range order, already verified) into a sparse file at
    `path` as long as the model's file (`file_size`: its header maps every tensor); returns
    the path."""
    if not spec.is_stage:
        raise ModelError(f"slice {spec.sid} is an expert slice, not a stage")
    if len(blobs) != len(spec.ranges):
        raise ModelError(f"stage {spec.sid}: {len(blobs)} blobs for {len(spec.ranges)} ranges")
    path = Path(path)
    end = max(r.offset + r.nbytes for r in spec.ranges)
    if end > file_size:
        raise ModelError(f"stage {spec.sid}: a range ends at {end}, past the file's {file_size}")
    with open(path, "wb") as f:
        f.truncate(file_size)  # holes everywhere the span does not read
        for r, blob in zip(spec.ranges, blobs, strict=True):
            if len(blob) != r.nbytes:
                raise ModelError(
                    f"stage {spec.sid}: range {r.name or r.kind} has {len(blob)} "
                    f"bytes, its spec says {r.nbytes}"
                )
            f.seek(r.offset)
            f.write(blob)
    return path


def load_stage(
    spec: SliceSpec, path: str | Path, device: str | torch.device, dtype: torch.dtype
) -> Backbone:
    """The blocks of stage `spec` from its sparse file (`write_stage_file`), without the
    embedding or the output head."""
    meta = read_meta(path)
    return Backbone.from_gguf(
        path, device, dtype, meta, span=range(spec.layer_start, spec.layer_end), head=False
    )
