"""How the device reads cold experts: in place over PCIe (mapped) or copied first (staged).

Mapped: pinned host memory is addressable by the GPU (unified virtual addressing), so a CUDA
tensor can alias it and the matmuls read the weights over PCIe as they go, with no copy.
Staged: each cold expert is copied host-to-device, then computed from device memory. Which is
faster depends on the bus, the batch and the expert size, so a node measures both at start
(`measure`) and keeps the faster. On CPU "mapped" means the cold tensors themselves (RAM).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvq.device import timed_call
from kvq.errors import BankError
from kvq.model.experts import ExpertWeights
from kvq.model.layers import swiglu

MEASURE_ROWS = 8  # tokens per measured expert call: a decode-sized batch
MEASURE_REPS = 5


class _CudaArray:
    """`__cuda_array_interface__` over a pinned host tensor's bytes (UVA: same address)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.owner = t
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (t.numel() * t.element_size(),),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),  # torch refuses the read-only flag
            "version": 2,
            "strides": None,
        }


def uva_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned host tensor `t` (no copy). BankError if not pinned."""
    if not t.is_pinned() or not t.is_contiguous():
        raise BankError("mapped cold experts need contiguous pinned host memory")
    with torch.cuda.device(device):
        raw = torch.as_tensor(_CudaArray(t), device=device)  # [bytes] uint8
    return raw.view(t.dtype).view(t.shape)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of MEASURE_REPS calls after one warm-up."""
    fn()
    times = [timed_call(fn, device) for _ in range(MEASURE_REPS)]
    return sorted(times)[len(times) // 2]


def measure(
    mapped: Callable[[], ExpertWeights],
    staged: Callable[[], ExpertWeights],
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, float]:
    """Seconds per expert call (MEASURE_ROWS tokens) with a cold expert's weights read by each
    path (`mapped()` / `staged()` give gate, up, down on the device)."""
    x = torch.randn(MEASURE_ROWS, hidden, dtype=dtype, device=device)  # [m, H]
    return {
        "mapped": _timed(lambda: swiglu(x, *mapped()), device),
        "staged": _timed(lambda: swiglu(x, *staged()), device),
    }
