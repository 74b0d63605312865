"""Which torch device and dtype a node computes with (CUDA when present, CPU otherwise)."""

from __future__ import annotations

import torch


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def compute_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (faster than bf16 there, and exact vs the reference); bf16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
