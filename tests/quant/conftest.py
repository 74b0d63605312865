"""The int8-activation kernel, built once for the tests of this folder, and a small Q4_K_M
expert slice to run it on through the model code."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from kvq.bank import Bank, BankOptions
from kvq.gguf import read_meta
from kvq.model.expert_slice import ExpertSlice, map_slice, slice_layout
from kvq.quant import qdot
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> qdot.Built:
    b = qdot.load("cc", tmp_path_factory.mktemp("qdot"))
    if b is None:
        pytest.skip("no C compiler here: the float32 kernels are what runs")
    return b


@pytest.fixture
def int8(built: qdot.Built) -> Iterator[None]:
    """KVQ_ACTIVATIONS=int8 for one test, with the session's build."""
    before = qdot.options()
    qdot.configure(qdot.KernelOptions("int8", "cc", str(built.path.parent)))
    yield
    qdot.configure(before)


class Q4kmSlices(NamedTuple):
    whole: ExpertSlice  # layer 0, experts [0, 8) of a Q4_K_M file (hidden and FFN 256)
    half: ExpertSlice  # experts [2, 6) of the same layer
    bank: Bank  # over `whole`, static, all cold


@pytest.fixture
def q4km(tmp_path: Path) -> Q4kmSlices:
    path = tmp_path / "q4_k_m.gguf"
    make_tiny(path, layers=1, experts=8, hidden=256, expert_ffn=256, quant="q4_k_m", seed=5)
    sl = map_slice(path, slice_layout(read_meta(path), 0, 0, 8), 0, 0, 8)
    half = map_slice(path, slice_layout(read_meta(path), 0, 2, 6), 0, 2, 6)
    bank = Bank([sl], BankOptions(numa_policy="off", vram_reserve_bytes=0, dynamic=False), "cpu")
    return Q4kmSlices(sl, half, bank)
