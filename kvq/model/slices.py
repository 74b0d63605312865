"""Expert slices: read their bytes from a file, decode downloaded bytes into torch tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from kvq.errors import ModelError, SliceIntegrityError
from kvq.model import gguf_io as gio
from kvq.model.layout import slice_layout
from kvq.model.meta import EXPERT_KINDS, ModelMeta, TensorRange


@dataclass
class ExpertSlice:
    """Dequantized weights of experts `[expert_start, expert_end)` of one layer."""

    layer: int
    expert_start: int
    expert_end: int
    gate: torch.Tensor  # [n, ffn, hidden]
    up: torch.Tensor  # [n, ffn, hidden]
    down: torch.Tensor  # [n, hidden, ffn]

    @property
    def n_experts(self) -> int:
        """Number of experts held."""
        return self.expert_end - self.expert_start

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> ExpertSlice:
        """A copy on `device` (and `dtype`, if given)."""
        return ExpertSlice(
            self.layer,
            self.expert_start,
            self.expert_end,
            self.gate.to(device=device, dtype=dtype),
            self.up.to(device=device, dtype=dtype),
            self.down.to(device=device, dtype=dtype),
        )


def decode_slice(
    layout: list[TensorRange],
    blobs: list[bytes],
    layer: int,
    expert_start: int,
    expert_end: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ExpertSlice:
    """Decode the gate/up/down byte blobs of a slice (in `layout` order) into an ExpertSlice.

    Raises SliceIntegrityError when a blob's length differs from its published `nbytes`.
    """
    if len(layout) != len(blobs):
        raise SliceIntegrityError(
            f"got {len(blobs)} blobs for {len(layout)} tensor ranges; fetch one blob per range"
        )
    n = expert_end - expert_start
    if n <= 0:
        raise ModelError(f"expert range [{expert_start}, {expert_end}) is empty")
    tensors: dict[str, torch.Tensor] = {}
    for rng, blob in zip(layout, blobs, strict=True):
        if len(blob) != rng.nbytes:
            raise SliceIntegrityError(
                f"{rng.name} slice of layer {layer} experts [{expert_start}, {expert_end}) "
                f"has {len(blob)} bytes, the layout says {rng.nbytes}; re-download it"
            )
        raw = np.frombuffer(blob, dtype=np.uint8)
        arr = gio.decode_bytes(raw, rng.ggml_type, (n, *rng.expert_shape))  # [n, *expert_shape]
        tensors[rng.kind] = torch.from_numpy(arr).to(device=device, dtype=dtype)
    missing = [k for k in EXPERT_KINDS if k not in tensors]
    if missing:
        raise ModelError(f"slice layout lacks the {missing} tensors; use slice_layout()")
    return ExpertSlice(
        layer, expert_start, expert_end, tensors["gate"], tensors["up"], tensors["down"]
    )


def read_slice_file(path: str | Path | BinaryIO, layout: list[TensorRange]) -> list[bytes]:
    """Read exactly the bytes of each range (seek + read; nothing else of the file).

    `path` may also be an open binary file object, which is left open.
    """
    if isinstance(path, str | Path):
        try:
            with open(path, "rb") as f:
                return _read_ranges(f, layout, str(path))
        except FileNotFoundError as exc:
            raise ModelError(f"model file {str(path)!r} does not exist; check the path") from exc
    return _read_ranges(path, layout, getattr(path, "name", "<file object>"))


def _read_ranges(f: BinaryIO, layout: list[TensorRange], label: str) -> list[bytes]:
    out: list[bytes] = []
    for rng in layout:
        f.seek(rng.offset)
        blob = f.read(rng.nbytes)
        if len(blob) != rng.nbytes:
            raise SliceIntegrityError(
                f"{label} ends inside {rng.name} (wanted {rng.nbytes} bytes at offset "
                f"{rng.offset}, got {len(blob)}); the file is truncated, re-download it"
            )
        out.append(blob)
    return out


def load_slice(
    path: str | Path,
    meta: ModelMeta,
    layer: int,
    expert_start: int,
    expert_end: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ExpertSlice:
    """Read and decode one slice straight from a local model file."""
    layout = slice_layout(meta, layer, expert_start, expert_end)
    blobs = read_slice_file(path, layout)
    return decode_slice(layout, blobs, layer, expert_start, expert_end, device, dtype)
