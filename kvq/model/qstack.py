"""`QStack`: a stacked expert tensor kept in its GGUF encoding, dequantized one expert at a time.

A stack of `n` expert matrices `[n, rows, cols]` is `n` runs of encoded bytes (`raw`, uint8
`[n, bytes_per_expert]`). The bytes may alias a memory map of the model file (nothing is read
until an expert is used, and then only into the page cache), an owned buffer (a worker's
download), or pinned host memory (a CUDA node's cold bank).
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvq.errors import ModelError, SliceIntegrityError
from kvq.model.rowwise import invariant, row_matmul
from kvq.quant import dequantize, kernels, row_bytes


class _Encoded:
    """What every holder of encoded bytes (`raw`, uint8) says about them."""

    __slots__ = ()
    raw: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.raw.numel())

    @property
    def device(self) -> torch.device:
        return self.raw.device


@dataclass(frozen=True, slots=True)
class QStack(_Encoded):
    """`n` matrices `[rows, cols]` of one ggml type as raw bytes `[n, bytes_per_expert]`."""

    raw: torch.Tensor  # uint8 [n, bytes_per_expert]
    qtype: int
    shape: tuple[int, int, int]  # [n, rows, cols]: the dequantized shape
    # encoded(e) of the stack's own bytes, made at first use: a MoE layer at 8 sequences looks
    # up about 30 experts' 3 matrices, and each view and QMatrix cost a few microseconds
    _encoded: list[QMatrix | None] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_encoded", [None] * self.shape[0])
        n, rows, cols = self.shape
        want = (n, rows * row_bytes(self.qtype, cols))
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != want:
            raise SliceIntegrityError(
                f"{tuple(self.raw.shape)} {self.raw.dtype} bytes cannot hold {n} "
                f"{GGMLQuantizationType(self.qtype).name} matrices {rows}x{cols} (want {want})"
            )

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def expert_nbytes(self) -> int:
        return int(self.raw.shape[1])

    def dense_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert's matrix once dequantized to `dtype`."""
        return self.shape[1] * self.shape[2] * torch.empty((), dtype=dtype).element_size()

    def matrix(self, e: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Expert `e` (local index) dequantized to `dtype`: [rows, cols]."""
        return dequantize(self.raw[e], self.qtype, self.shape[1:], dtype, out)

    def weight(self, e: int, dtype: torch.dtype) -> torch.Tensor | QMatrix:
        """Expert `e`'s matrix as it computes fastest in `dtype` on this device: encoded
        (`QMatrix`, no copy) where a fused kernel covers the type, else dequantized."""
        if kernels.keeps_encoded(self.qtype, self.raw.device, dtype):
            return self.encoded(e)
        return self.matrix(e, dtype)

    def encoded(self, e: int, raw: torch.Tensor | None = None) -> QMatrix:
        """Expert `e`'s matrix kept encoded: its bytes here, or `raw`, a copy of them (a hot
        slot)."""
        if raw is not None:
            return QMatrix(raw.view(self.shape[1], -1), self.qtype, self.shape[1:])
        m = self._encoded[e]
        if m is None:  # two threads may both make it: the same view, either one kept
            m = QMatrix(self.raw[e].view(self.shape[1], -1), self.qtype, self.shape[1:])
            self._encoded[e] = m
        return m

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every expert dequantized: [n, rows, cols] (tests and references only)."""
        out = torch.empty(self.shape, dtype=dtype, device=self.raw.device)
        for e in range(self.n):
            self.matrix(e, dtype, out[e])
        return out

    def __getitem__(self, part: slice) -> QStack:
        """Experts `part` (a slice with step 1) as a view, like a dense stack's `t[a:b]`."""
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise TypeError("index a QStack with a slice; use .matrix(e, dtype) for one expert")
        start, end, _ = part.indices(self.n)
        return self.experts(start, max(start, end))

    def experts(self, start: int, end: int) -> QStack:
        """Experts `[start, end)` of this stack (a view: no copy)."""
        return QStack(self.raw[start:end], self.qtype, (end - start, *self.shape[1:]))

    def to(self, device: str | torch.device, pin: bool = False) -> QStack:
        raw = self.raw.to(device)
        if pin and raw.device.type == "cpu" and not raw.is_pinned():
            raw = raw.pin_memory()
        return QStack(raw, self.qtype, self.shape)

    @classmethod
    def from_bytes(
        cls, blob: bytes | bytearray | memoryview, qtype: int, shape: tuple[int, int, int]
    ) -> QStack:
        """A stack owning a copy of `blob` (e.g. downloaded bytes)."""
        n = shape[0]
        raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return cls(raw.reshape(n, -1) if n else raw.reshape(0, 0), qtype, shape)


@dataclass(frozen=True, slots=True)
class QMatrix(_Encoded):
    """One weight matrix [rows, cols] kept encoded and multiplied as it is (`matmul`)."""

    raw: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: int
    shape: tuple[int, int]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, cols] @ W.T -> [B, rows] in x.dtype: the fused kernel for a few rows, else
        the matrix dequantized for this call (float32 bytes are used in place). Batch-invariant
        (`kvq.model.rowwise`) with float32 activations, the float32 kernels are not (their
        one-row and many-row forms sum differently): the dequantized matrix, row by row."""
        fused = kernels.covers(self.qtype, int(x.shape[0]), x)
        if fused and (kernels.int8_active() or not invariant(x)):
            return kernels.matmul(x, self.raw, self.qtype)
        if self.qtype == GGMLQuantizationType.F32 and x.dtype == torch.float32:
            return row_matmul(x, self.raw.view(torch.float32).view(self.shape).T)
        return row_matmul(x, self.dense(x.dtype).T)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape, dtype)


Weight = torch.Tensor | QMatrix  # a dense matrix or an encoded one


@dataclass(frozen=True, slots=True)
class QRows:
    """A [rows, cols] matrix kept encoded, read a few rows at a time (token embeddings)."""

    raw: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: int
    shape: tuple[int, int]
    dtype: torch.dtype = torch.float32  # what the rows are dequantized to

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` ([N] int64) dequantized: [N, cols]."""
        picked = self.raw.index_select(0, idx.to(self.raw.device))  # [N, row_bytes]
        return dequantize(picked, self.qtype, (int(idx.numel()), self.shape[1]), self.dtype)

    @property
    def device(self) -> torch.device:
        return self.raw.device


class FileMap:
    """One copy-on-write memory map per model file, shared by every stack read from it.

    Copy-on-write (`mmap.ACCESS_COPY`) gives writable tensors (torch refuses read-only
    buffers) while untouched pages stay shared with the page cache: mapping costs no memory,
    and reading an expert costs page cache only.
    """

    _lock = threading.Lock()
    _maps: dict[str, np.ndarray] = {}

    @classmethod
    def forget(cls, path: str | Path) -> None:
        """Drop `path`'s map from the table (tensors read from it keep it alive): a later
        file at the same path is mapped anew."""
        with cls._lock:
            cls._maps.pop(str(Path(path).resolve()), None)

    @classmethod
    def bytes_of(cls, path: str | Path, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 view of `nbytes` at `offset` of `path` (ModelError if the file is short)."""
        key = str(Path(path).resolve())
        with cls._lock:
            arr = cls._maps.get(key)
            if arr is None:
                try:
                    with open(key, "rb") as f:
                        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                except FileNotFoundError as exc:
                    raise ModelError(f"model file {key!r} does not exist") from exc
                arr = np.frombuffer(mm, dtype=np.uint8)
                cls._maps[key] = arr
        if offset < 0 or offset + nbytes > arr.size:
            raise SliceIntegrityError(
                f"{key} ends before byte {offset + nbytes} (it has {arr.size}); the file is "
                "truncated, re-download it"
            )
        return torch.from_numpy(arr[offset : offset + nbytes])
