"""Which torch device and dtype a node computes with (CUDA when present, CPU otherwise)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def compute_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (faster than bf16 there, and exact vs the reference); bf16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of `fn`, synchronizing the device around it (CUDA runs async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
