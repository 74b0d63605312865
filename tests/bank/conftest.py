"""Fixtures of the bank tests (helpers are in bank_helpers.py)."""

from __future__ import annotations

import pytest
import torch
from bank_helpers import DEVICE


@pytest.fixture
def device() -> torch.device:
    """BANK_TEST_DEVICE (default cpu); skips when CUDA is asked for but absent."""
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("BANK_TEST_DEVICE=cuda but no CUDA device is visible")
    return DEVICE
