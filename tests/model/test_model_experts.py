"""expert_forward against the float64 reference, and exactness of slice partitions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import ModelError
from kvq.gguf import read_meta
from kvq.model import ExpertSlice, expert_forward, expert_forward_reference, load_slice
from kvq.tools.synth import make_tiny

E, F_, H = 6, 48, 32


def _random_slice(e0: int, e1: int, seed: int = 0) -> ExpertSlice:
    g = torch.Generator().manual_seed(seed)
    n = e1 - e0
    return ExpertSlice(
        0,
        e0,
        e1,
        torch.randn(n, F_, H, generator=g) / H**0.5,  # [n, F, H]
        torch.randn(n, F_, H, generator=g) / H**0.5,  # [n, F, H]
        torch.randn(n, H, F_, generator=g) / F_**0.5,  # [n, H, F]
    )


def _inputs(t: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)  # [T, H]
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])  # [T, k] distinct
    w = torch.softmax(torch.randn(t, k, generator=g), dim=-1)  # [T, k]
    return x, ids, w


def _reference(sl: ExpertSlice, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    return expert_forward_reference(
        sl.gate.double().numpy(),
        sl.up.double().numpy(),
        sl.down.double().numpy(),
        sl.expert_start,
        x.numpy(),
        ids.numpy(),
        w.numpy(),
    )


def _close(got: torch.Tensor, want: np.ndarray) -> None:
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(("e0", "e1"), [(0, 6), (2, 4), (5, 6), (0, 1)])
def test_matches_float64_reference(e0: int, e1: int) -> None:
    sl = _random_slice(e0, e1, seed=e0)
    x, ids, w = _inputs(40, 3, seed=e1)
    got = expert_forward(sl, x, ids, w)
    assert got.shape == x.shape and got.dtype == torch.float32
    _close(got, _reference(sl, x, ids, w))


def test_rows_with_experts_outside_the_slice() -> None:
    sl = _random_slice(2, 4)
    x, _, w = _inputs(4, 2, seed=1)
    ids = torch.tensor([[0, 1], [2, 5], [3, 2], [4, 5]])  # none, partly, fully, none inside
    got = expert_forward(sl, x, ids, w)
    assert torch.equal(got[0], torch.zeros(H)) and torch.equal(got[3], torch.zeros(H))
    assert bool(got[1].abs().sum() > 0) and bool(got[2].abs().sum() > 0)
    _close(got, _reference(sl, x, ids, w))


def test_no_rows_inside_and_empty_batch() -> None:
    sl = _random_slice(0, 2)
    x, _, w = _inputs(3, 2, seed=2)
    ids = torch.tensor([[3, 4]] * 3)
    assert torch.equal(expert_forward(sl, x, ids, w), torch.zeros(3, H))
    empty = expert_forward(
        sl, torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    )
    assert empty.shape == (0, H)


def test_output_dtype_follows_x() -> None:
    sl = _random_slice(0, 6)
    x, ids, w = _inputs(5, 2, seed=3)
    got = expert_forward(sl, x.double(), ids, w)
    assert got.dtype == torch.float64
    _close(got, _reference(sl, x, ids, w))


@settings(max_examples=25, deadline=None, database=None)
@given(
    cuts=st.sets(st.integers(min_value=1, max_value=E - 1)),
    t=st.integers(min_value=1, max_value=24),
    k=st.integers(min_value=1, max_value=4),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_partition_sums_to_full_layer(cuts: set[int], t: int, k: int, seed: int) -> None:
    full = _random_slice(0, E, seed=seed)
    x, ids, w = _inputs(t, k, seed=seed)
    bounds = [0, *sorted(cuts), E]
    total = torch.zeros(t, H)
    for e0, e1 in zip(bounds, bounds[1:], strict=False):
        part = ExpertSlice(0, e0, e1, full.gate[e0:e1], full.up[e0:e1], full.down[e0:e1])
        total += expert_forward(part, x, ids, w)
    torch.testing.assert_close(total, expert_forward(full, x, ids, w), rtol=1e-5, atol=1e-6)


def test_model_slices_partition_exactly(odd_path: Path) -> None:
    meta = read_meta(odd_path)
    full = load_slice(odd_path, meta, 0, 0, 6)
    parts = [load_slice(odd_path, meta, 0, a, b) for a, b in ((0, 1), (1, 4), (4, 6))]
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(16)])
    w = torch.full((16, 3), 1 / 3)
    want = expert_forward(full, x, ids, w)
    torch.testing.assert_close(sum(expert_forward(p, x, ids, w) for p in parts), want)
    _close(want, _reference(full, x, ids, w))


def test_bad_shapes_raise() -> None:
    sl = _random_slice(0, 2)
    x, ids, w = _inputs(3, 2, seed=4)
    with pytest.raises(ModelError, match="hidden"):
        expert_forward(sl, torch.zeros(3, H + 1), ids, w)
    with pytest.raises(ModelError, match="must both be"):
        expert_forward(sl, x, ids, w[:, :1])
    with pytest.raises(ModelError, match="int64"):
        expert_forward(sl, x, ids.int(), w)


@pytest.mark.parametrize(
    ("arch", "quant"), [("qwen3moe", "q4_k"), ("mixtral", "q6_k"), ("qwen2moe", "q5_0")]
)
def test_quantized_model_slice_matches_float64_reference(
    tmp_path: Path, arch: str, quant: str
) -> None:
    path = tmp_path / "q.gguf"
    make_tiny(
        path, arch=arch, quant=quant, experts=6, experts_used=3, hidden=256, expert_ffn=256, seed=9
    )
    meta = read_meta(path)
    sl = load_slice(path, meta, 1, 2, 5)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 256, generator=g)  # [T, H]
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(24)])  # [T, 3]
    w = torch.softmax(torch.randn(24, 3, generator=g), dim=-1)  # [T, 3]
    _close(expert_forward(sl, x, ids, w), _reference(sl, x, ids, w))
