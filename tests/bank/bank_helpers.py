"""Helpers of the bank tests: the device they run on, random expert slices, quiet options.

`BANK_TEST_DEVICE=cuda` (set by workers/gpu_check.sh) runs the same tests on the GPU; CPU
otherwise. Outputs are compared bit for bit on CPU and to float32 rounding on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvq.bank.layout import resident_bytes
from kvq.bank.options import BankOptions
from kvq.model.expert_slice import ExpertSlice

DEVICE = torch.device(os.environ.get("BANK_TEST_DEVICE", "cpu"))


def make_slice(
    layer: int = 0,
    start: int = 0,
    end: int = 8,
    hidden: int = 32,
    ffn: int = 48,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> ExpertSlice:
    """Random experts [start, end) of `layer` on the CPU (non-square: transposes fail loudly)."""
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    n = end - start

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.2).to(dtype)

    return ExpertSlice(
        layer, start, end, rand(n, ffn, hidden), rand(n, ffn, hidden), rand(n, hidden, ffn)
    )


def per_expert(sl: ExpertSlice) -> int:
    """Hot-bank bytes of one expert: dense in the compute dtype (what the budget counts)."""
    return resident_bytes(sl, torch.device("cpu"))


def opts(**kw: Any) -> BankOptions:
    """Options for tests: NUMA off, a zero device reserve, static unless asked."""
    base: dict[str, Any] = {"numa_policy": "off", "vram_reserve_bytes": 0, "dynamic": False}
    return BankOptions(**(base | kw))


def routes(
    tokens: int, k: int, start: int, end: int, seed: int = 0, device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] distinct per row in [start, end) and weights [T, k] summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(end - start, generator=gen)[:k] + start for _ in range(tokens)]
    )
    w = torch.rand(tokens, k, generator=gen)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def same(a: torch.Tensor, b: torch.Tensor, cuda_rtol: float = 1e-5) -> bool:
    """Bit-identical on CPU; equal to rounding on CUDA (kernel choice may differ by memory)."""
    if a.device.type == "cpu":
        return torch.equal(a, b)
    return torch.allclose(a.float(), b.float(), rtol=cuda_rtol, atol=cuda_rtol / 10)
