"""End-to-end fixtures: a tiny model, and kvq roles running in threads or processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.model import make_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=3)
    return path
