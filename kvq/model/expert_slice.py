"""Expert slices: experts `[start, end)` of one layer, quantized (`QStack`) or dense.

A slice from a model file or a download keeps the GGUF encoding (`map_slice`, `decode_slice`):
nothing is dequantized at load. Dense slices (torch tensors) remain for tests and references
(`ExpertSlice.dense_copy`). The experts' biases, where the arch has them (gpt-oss), travel in
the same slice as three more stacked ranges and are held as float32 vectors (a few KB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from kvq.catalog import ModelMeta
from kvq.errors import ModelError, SliceIntegrityError
from kvq.gguf import reader as gio
from kvq.gguf.arch import ACT_SILU, EXPERT_ACTS
from kvq.gguf.layout import slice_layout
from kvq.model.qstack import FileMap, QStack, Weight
from kvq.quant import dequantize
from kvq.slices import BIAS_KINDS, EXPERT_KINDS, TensorRange

Stack = torch.Tensor | QStack  # [n, rows, cols]: dense, or encoded bytes
Biases = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [n, F], up [n, F], down [n, H]


@dataclass
class ExpertSlice:
    """Experts `[expert_start, expert_end)` of one layer: gate, up [n, ffn, hidden] and down
    [n, hidden, ffn], each dense or quantized; `dtype` is what they compute in."""

    layer: int
    expert_start: int
    expert_end: int
    gate: Stack  # [n, ffn, hidden]
    up: Stack  # [n, ffn, hidden]
    down: Stack  # [n, hidden, ffn]
    dtype: torch.dtype | None = None  # None: the dense tensors' own dtype
    biases: Biases | None = None  # float32, where the arch has expert biases (gpt-oss)
    act: str = ACT_SILU  # the activation (`kvq.gguf.arch.EXPERT_ACTS`)

    def __post_init__(self) -> None:
        if self.act not in EXPERT_ACTS:
            raise ModelError(f"expert activation {self.act!r} is not one of {EXPERT_ACTS}")

    @property
    def n_experts(self) -> int:
        """Number of experts held."""
        return self.expert_end - self.expert_start

    @property
    def hidden(self) -> int:
        return int(self.gate.shape[2])

    @property
    def quantized(self) -> bool:
        return isinstance(self.gate, QStack)

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        g = self.gate
        return g.dtype if isinstance(g, torch.Tensor) else torch.float32

    @property
    def stacks(self) -> tuple[Stack, Stack, Stack]:
        return self.gate, self.up, self.down

    def expert(self, e: int) -> tuple[Weight, Weight, Weight]:
        """Expert `e` (local index) as gate, up, down for the compute dtype: dense, or encoded
        where a fused kernel computes it (`QStack.weight`)."""
        dt = self.compute_dtype
        return tuple(  # type: ignore[return-value]
            t.weight(e, dt) if isinstance(t, QStack) else t[e] for t in self.stacks
        )

    def bias(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Expert `e`'s (local index) gate, up and down biases, or None without biases."""
        return (
            None
            if self.biases is None
            else (self.biases[0][e], self.biases[1][e], self.biases[2][e])
        )

    def dense_copy(self, dtype: torch.dtype | None = None) -> ExpertSlice:
        """The same experts dequantized into dense tensors (references and tests)."""
        dt = dtype or self.compute_dtype
        g, u, d = (t.dense(dt) if isinstance(t, QStack) else t.to(dtype=dt) for t in self.stacks)
        return ExpertSlice(
            self.layer,
            self.expert_start,
            self.expert_end,
            g,
            u,
            d,
            biases=self.biases,
            act=self.act,
        )

    def nbytes(self) -> int:
        """Bytes the slice holds as it is (encoded or dense)."""
        return sum(
            t.nbytes if isinstance(t, QStack) else t.numel() * t.element_size() for t in self.stacks
        )

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> ExpertSlice:
        """A copy on `device` (dense tensors also cast to `dtype`, if given)."""
        g, u, d = (
            t.to(device) if isinstance(t, QStack) else t.to(device=device, dtype=dtype)
            for t in self.stacks
        )
        biases = None if self.biases is None else _biases_on(self.biases, device)
        return ExpertSlice(
            self.layer,
            self.expert_start,
            self.expert_end,
            g,
            u,
            d,
            (dtype or self.dtype) if self.quantized else None,
            biases,
            self.act,
        )


def _biases_on(b: Biases, device: str | torch.device) -> Biases:
    return b[0].to(device), b[1].to(device), b[2].to(device)


def decode_slice(
    layout: list[TensorRange],
    blobs: list[bytes],
    layer: int,
    expert_start: int,
    expert_end: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    act: str = ACT_SILU,
) -> ExpertSlice:
    """The gate/up/down byte blobs of a slice (in `layout` order, then any biases) as a
    quantized ExpertSlice that computes in `dtype` with activation `act` (the matrices' bytes
    are kept as they are; only the bias vectors are decoded).

    Raises SliceIntegrityError when a blob's length differs from its published `nbytes`.
    """
    if len(layout) != len(blobs):
        raise SliceIntegrityError(
            f"got {len(blobs)} blobs for {len(layout)} tensor ranges; fetch one blob per range"
        )
    n = _check_range(expert_start, expert_end)
    stacks: dict[str, QStack] = {}
    biases: dict[str, torch.Tensor] = {}
    for rng, blob in zip(layout, blobs, strict=True):
        if len(blob) != rng.nbytes:
            raise SliceIntegrityError(
                f"{rng.name} slice of layer {layer} experts [{expert_start}, {expert_end}) "
                f"has {len(blob)} bytes, the layout says {rng.nbytes}; re-download it"
            )
        if rng.kind in BIAS_KINDS:
            raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            biases[rng.kind] = _bias_stack(raw, rng, n).to(device)
        else:
            qs = QStack.from_bytes(blob, rng.ggml_type, _stack_shape(rng, n))
            stacks[rng.kind] = qs.to(device)
    return _assemble(stacks, biases, layer, expert_start, expert_end, dtype, act)


def map_slice(
    path: str | Path,
    layout: list[TensorRange],
    layer: int,
    expert_start: int,
    expert_end: int,
    dtype: torch.dtype = torch.float32,
    act: str = ACT_SILU,
) -> ExpertSlice:
    """A quantized slice whose bytes alias a memory map of `path`: no byte is read until an
    expert is computed, and then only into the page cache (biases are read at once)."""
    n = _check_range(expert_start, expert_end)
    stacks, biases = {}, {}
    for rng in layout:
        raw = FileMap.bytes_of(path, rng.offset, rng.nbytes)
        if rng.kind in BIAS_KINDS:
            biases[rng.kind] = _bias_stack(raw, rng, n)
        else:
            stacks[rng.kind] = QStack(raw.reshape(n, -1), rng.ggml_type, _stack_shape(rng, n))
    return _assemble(stacks, biases, layer, expert_start, expert_end, dtype, act)


def _bias_stack(raw: torch.Tensor, rng: TensorRange, n: int) -> torch.Tensor:
    """A stacked bias range as float32 [n, width]."""
    if len(rng.expert_shape) != 1:
        raise ModelError(f"{rng.name}: an expert bias must be 1-D, got {rng.expert_shape}")
    gio.check_supported(rng.ggml_type, rng.name)
    return dequantize(raw, rng.ggml_type, (n, rng.expert_shape[0]), torch.float32)


def _check_range(expert_start: int, expert_end: int) -> int:
    n = expert_end - expert_start
    if n <= 0:
        raise ModelError(f"expert range [{expert_start}, {expert_end}) is empty")
    return n


def _stack_shape(rng: TensorRange, n: int) -> tuple[int, int, int]:
    if len(rng.expert_shape) != 2:
        raise ModelError(f"{rng.name}: an expert matrix must be 2-D, got {rng.expert_shape}")
    rows, cols = rng.expert_shape
    gio.nbytes_for(rng.ggml_type, (rows, cols))  # ModelError unless rows are whole blocks
    gio.check_supported(rng.ggml_type, rng.name)
    return n, rows, cols


def _assemble(
    stacks: dict[str, QStack],
    biases: dict[str, torch.Tensor],
    layer: int,
    expert_start: int,
    expert_end: int,
    dtype: torch.dtype,
    act: str,
) -> ExpertSlice:
    missing = [k for k in EXPERT_KINDS if k not in stacks]
    if biases:
        missing += [k for k in BIAS_KINDS if k not in biases]
    if missing:
        raise ModelError(f"slice layout lacks the {missing} tensors; use slice_layout()")
    b = (biases["gate_b"], biases["up_b"], biases["down_b"]) if biases else None
    return ExpertSlice(
        layer,
        expert_start,
        expert_end,
        stacks["gate"],
        stacks["up"],
        stacks["down"],
        dtype,
        b,
        act,
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
    """One slice of a local model file, dense in `dtype` on `device` (references and tests;
    serving paths keep slices quantized with `map_slice`)."""
    layout = slice_layout(meta, layer, expert_start, expert_end)
    blobs = read_slice_file(path, layout)
    sl = decode_slice(layout, blobs, layer, expert_start, expert_end, "cpu", dtype, meta.expert_act)
    return sl.dense_copy(dtype).to(device)
