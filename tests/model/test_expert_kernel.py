"""The one grouped expert kernel: any `weights_of` against the float64 reference, its hooks,
and SwiGLU written in exactly one place."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.model import ExpertSlice, expert_forward, expert_forward_reference
from kvq.model.experts import ExpertWeights, grouped_expert_ffn

E, F_, H = 8, 40, 24
KVQ = Path(__file__).resolve().parents[2] / "kvq"


def _experts(n: int, seed: int) -> list[ExpertWeights]:
    """Separate (not stacked) tensors per expert, so the kernel can only reach them by index."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(F_, H, generator=g) / H**0.5,  # [F, H]
            torch.randn(F_, H, generator=g) / H**0.5,  # [F, H]
            torch.randn(H, F_, generator=g) / F_**0.5,  # [H, F]
        )
        for _ in range(n)
    ]


def _inputs(
    t: int, k: int, seed: int, unused: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routings over all E experts except `unused`, so some experts get zero rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)  # [T, H]
    pool = torch.tensor([e for e in range(E) if e != unused])  # [E - 1]
    ids = pool[torch.rand(t, E - 1, generator=g).argsort(dim=1)[:, :k]]  # [T, k] distinct
    w = torch.softmax(torch.randn(t, k, generator=g), dim=-1)  # [T, k]
    return x, ids, w


def _reference(
    experts: list[ExpertWeights], lo: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> np.ndarray:
    gate, up, down = (torch.stack([ex[i] for ex in experts]).double().numpy() for i in range(3))
    return expert_forward_reference(gate, up, down, lo, x.numpy(), ids.numpy(), w.numpy())


@settings(max_examples=30, deadline=None, database=None)
@given(
    bounds=st.tuples(st.integers(0, E - 1), st.integers(1, E)).filter(lambda b: b[0] < b[1]),
    t=st.integers(min_value=0, max_value=20),
    k=st.integers(min_value=1, max_value=4),
    unused=st.integers(min_value=0, max_value=E - 1),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_custom_weights_of_matches_float64_reference(
    bounds: tuple[int, int], t: int, k: int, unused: int, seed: int
) -> None:
    lo, hi = bounds
    experts = _experts(hi - lo, seed)
    x, ids, w = _inputs(t, k, seed, unused)
    looked_up: list[int] = []

    def weights_of(e: int) -> ExpertWeights:
        looked_up.append(e)
        return experts[e]

    got = grouped_expert_ffn(x, ids, w, lo, hi, weights_of, torch.float32)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = _reference(experts, lo, x, ids, w)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5 * scale)
    with_rows = sorted({int(e) - lo for e in ids.flatten() if lo <= int(e) < hi})
    assert looked_up == with_rows  # each expert with rows once, in order; none without rows


def test_same_bits_as_expert_forward_and_given_inside() -> None:
    experts = _experts(5, seed=3)
    sl = ExpertSlice(0, 2, 7, *(torch.stack([ex[i] for ex in experts]) for i in range(3)))
    x, ids, w = _inputs(32, 3, seed=4, unused=4)
    want = expert_forward(sl, x, ids, w)
    got = grouped_expert_ffn(x, ids, w, 2, 7, experts.__getitem__, torch.float32)
    assert torch.equal(got, want)
    inside = (ids >= 2) & (ids < 7)  # [T, k]
    given_mask = grouped_expert_ffn(
        x, ids, w, 2, 7, experts.__getitem__, torch.float32, inside=inside
    )
    assert torch.equal(given_mask, want)


def test_computes_in_cdtype_and_returns_x_dtype() -> None:
    experts = [(g.double(), u.double(), d.double()) for g, u, d in _experts(E, seed=5)]
    x, ids, w = _inputs(6, 2, seed=6, unused=0)
    got = grouped_expert_ffn(x, ids, w, 0, E, experts.__getitem__, torch.float64)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), _reference(experts, 0, x, ids, w), rtol=1e-6)


@pytest.mark.parametrize(("lo", "hi", "calls"), [(0, E, 1), (6, 8, 0)])
def test_before_compute_runs_once_and_only_with_work(lo: int, hi: int, calls: int) -> None:
    experts = _experts(hi - lo, seed=7)
    x, _, w = _inputs(5, 2, seed=8, unused=0)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 3], [0, 5]])  # none in [6, 8)
    seen: list[int] = []
    out = grouped_expert_ffn(
        x, ids, w, lo, hi, experts.__getitem__, torch.float32, lambda: seen.append(1)
    )
    assert len(seen) == calls
    if calls == 0:
        assert torch.equal(out, torch.zeros_like(x))


def _silu_calls(path: Path) -> list[int]:
    """Lines where `path` names silu in code (strings and comments do not count)."""
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [
        t.start[0]
        for t in toks
        if t.type == tokenize.NAME and t.string.lower() in ("silu", "silu_")
    ]


# the trainer's network (`kvq.tools.train.net`) is a differentiable torch model of its own,
# trained with autograd and never run to serve: the rule is about what serves
TRAINER = KVQ / "tools" / "train"


def test_swiglu_is_written_once() -> None:
    found = {
        str(p.relative_to(KVQ)): lines
        for p in sorted(KVQ.rglob("*.py"))
        if TRAINER not in p.parents and (lines := _silu_calls(p))
    }
    assert list(found) == ["model/layers.py"], f"silu outside kvq.model.layers.swiglu: {found}"
    assert len(found["model/layers.py"]) == 1
