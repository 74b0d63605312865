"""Shared tiny models for the kvq.model tests (written once per session)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

if importlib.util.find_spec("kvq") is None:  # kvq not installed: import it from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvq.model import Backbone
from kvq.quant import qdot
from kvq.tools.synth import make_tiny

# non-square dimensions so any transposed matrix fails loudly
ODD = {
    "layers": 2,
    "experts": 6,
    "experts_used": 3,
    "hidden": 32,
    "expert_ffn": 48,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "seed": 7,
}


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    make_tiny(path)
    return path


@pytest.fixture(scope="session")
def odd_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with hidden != ffn, head_dim * heads != hidden, k = 3."""
    path = tmp_path_factory.mktemp("odd") / "odd.gguf"
    make_tiny(path, **ODD)
    return path


@pytest.fixture(scope="session")
def backbone(tiny_path: Path) -> Backbone:
    return Backbone.from_gguf(tiny_path)


@pytest.fixture(scope="session")
def odd_backbone(odd_path: Path) -> Backbone:
    return Backbone.from_gguf(odd_path)


@pytest.fixture(scope="session")
def qwen2_backbone(tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    """A qwen2moe model (q/k/v biases, shared expert) with the odd dims."""
    path = tmp_path_factory.mktemp("qwen2") / "qwen2moe.gguf"
    make_tiny(path, arch="qwen2moe", shared_expert_ffn=40, **ODD)  # type: ignore[arg-type]
    return Backbone.from_gguf(path)


@pytest.fixture(scope="session")
def mixtral_backbone(tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    """A Mixtral-style `llama` model (NORM rope, permuted Q/K) with the odd dims."""
    path = tmp_path_factory.mktemp("mixtral") / "mixtral.gguf"
    make_tiny(path, arch="mixtral", **ODD)  # type: ignore[arg-type]
    return Backbone.from_gguf(path)


@pytest.fixture
def int8_activations() -> Iterator[None]:
    """kvq's kernels with int8 activations, as llama.cpp computes quantized matrices."""
    before = qdot.options()
    qdot.configure(replace(before, activations="int8"))
    yield
    qdot.configure(before)


@pytest.fixture
def float32_activations() -> Iterator[None]:
    """kvq's exact path (`KVQ_ACTIVATIONS=float32`): quantized weights times float32 activations,
    for comparisons with a float reference that int8 activations would miss by their rounding."""
    before = qdot.options()
    qdot.configure(replace(before, activations="float32"))
    yield
    qdot.configure(before)
