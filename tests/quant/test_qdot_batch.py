"""The batched MoE call (`qdot.moe_batch`, `kernels.moe_int8_batch`, KVQ_ACTIVATIONS=int8):
each token's row is the bits of the one-token call (`qdot.moe` of that token alone, its experts
in the same order) whatever else is in the batch, on every instruction set and thread count;
within the one-token call's tolerance of float64; and `grouped_expert_ffn` takes it for several
rows, so a row's result does not depend on the batch it lands in (remote == local)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from kvq.model.experts import expert_forward_reference
from kvq.quant import kernels, qdot
from kvq.tools.synth.quants import random_blocks

if TYPE_CHECKING:
    from conftest import Q4kmSlices  # tests/quant/conftest.py

# (Q4_K, Q6_K, Q4_K): gate and up take x in two orders (the 512-bit Q4_K pairs its chunks)
MOE_TYPES = [
    (Q.Q4_K, Q.Q4_K, Q.Q6_K),
    (Q.Q5_K, Q.Q5_K, Q.Q4_K),
    (Q.Q8_0, Q.Q4_0, Q.Q8_0),
    (Q.Q4_K, Q.Q8_0, Q.Q4_0),
    (Q.Q6_K, Q.Q6_K, Q.Q5_K),
    (Q.Q4_K, Q.Q6_K, Q.Q4_K),
]
MOE_TOL = 3e-2  # as the one-token call's (tests/quant/test_qdot.py)
TYPE_IDS = ["-".join(t.name for t in ts) for ts in MOE_TYPES]

Raws = list[list[np.ndarray]]  # per expert: gate [f, h], up [f, h], down [h, f] raw bytes


def _experts(types: tuple[Q, Q, Q], n: int, h: int, f: int, rng: np.random.Generator) -> Raws:
    shapes = ((f, h), (f, h), (h, f))
    raws = [
        [random_blocks(t, s, 0.05, rng) for t, s in zip(types, shapes, strict=True)]
        for _ in range(n)
    ]
    if Q.Q6_K in types:  # int8 scales of both signs, not only random_blocks' 16..63
        for e in raws:
            for t, r in zip(types, e, strict=True):
                if t == Q.Q6_K:
                    blocks = r.reshape(-1, 210)
                    blocks[:, 192:208] = rng.integers(0, 256, (len(blocks), 16), dtype=np.uint8)
    return raws


def _route(rng: np.random.Generator, t: int, n: int, k: int, keep: float = 1.0):
    """ids [t, k] (distinct per row, in router order, -1 = outside the slice) and weights."""
    ids = np.stack([rng.permutation(n)[:k] for _ in range(t)])
    ids[rng.random(ids.shape) >= keep] = -1
    return ids, rng.random((t, k), dtype=np.float32)


def _batch(built: qdot.Built, raws: Raws, types, x, ids, w, threads: int, isa: int = -1):
    """qdot.moe_batch over the pairs of ids >= 0, grouped by expert."""
    pairs = sorted((int(e), t, float(w[t, j])) for (t, j), e in np.ndenumerate(ids) if e >= 0)
    used = sorted({e for e, _, _ in pairs})
    start = np.searchsorted([e for e, _, _ in pairs], used + [len(raws)])  # [n + 1]
    ptrs = [tuple(r.ctypes.data for r in raws[e]) for e in used]
    rb = tuple(int(r.shape[1]) for r in raws[0])
    rows = np.array([t for _, t, _ in pairs], np.int64)
    wts = np.array([p[2] for p in pairs], np.float32)
    f = raws[0][0].shape[0]
    return qdot.moe_batch(built, x, ptrs, start, rows, wts, types, rb, f, threads, isa)


def _one(built: qdot.Built, raws: Raws, types, x, ids, w, threads: int = 1, isa: int = 0):
    """Each row alone through the one-token call, its experts sorted: [T, h]."""
    rb = tuple(int(r.shape[1]) for r in raws[0])
    out = []
    for t in range(x.shape[0]):
        mine = sorted((int(e), float(w[t, j])) for j, e in enumerate(ids[t]) if e >= 0)
        ptrs = [tuple(r.ctypes.data for r in raws[e]) for e, _ in mine]
        wts = np.array([we for _, we in mine], np.float32)
        out.append(
            qdot.moe(built, x[t].copy(), ptrs, types, rb, raws[0][0].shape[0], wts, threads, isa)
        )
    return np.stack(out)


@pytest.mark.parametrize("types", MOE_TYPES, ids=TYPE_IDS)
def test_each_row_gets_the_one_token_calls_bits(built: qdot.Built, types) -> None:
    """T in 1..9, k in 1..4 of 6 experts, some pairs outside the slice (rows with none are 0),
    every path and 1-3 threads: row t is `qdot.moe` of x[t] alone, bit for bit."""
    rng = np.random.default_rng(sum(int(t) for t in types))
    raws = _experts(types, 6, 512, 256, rng)
    for trial in range(8):
        t, k = int(rng.integers(1, 10)), int(rng.integers(1, 5))
        x = rng.standard_normal((t, 512), dtype=np.float32)
        ids, w = _route(rng, t, 6, k, keep=0.8 if trial % 2 else 1.0)
        want = _one(built, raws, types, x, ids, w)
        for isa in built.paths():
            for threads in (1, 2, 3):
                got = _batch(built, raws, types, x, ids, w, threads, isa)
                assert np.array_equal(got, want), (trial, t, k, isa, threads)


def test_experts_with_more_rows_than_one_multi_row_dot(built: qdot.Built) -> None:
    """20 rows over 3 experts: each expert's rows go MX (8) at a time through the multi-row
    dots, still the one-token bits."""
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    rng = np.random.default_rng(11)
    raws = _experts(types, 3, 256, 512, rng)
    x = rng.standard_normal((20, 256), dtype=np.float32)
    ids, w = _route(rng, 20, 3, 2)
    want = _one(built, raws, types, x, ids, w)
    for isa in built.paths():
        assert np.array_equal(_batch(built, raws, types, x, ids, w, 2, isa), want), isa


@pytest.mark.parametrize("types", MOE_TYPES, ids=TYPE_IDS)
def test_batch_matches_float64_reference(built: qdot.Built, types) -> None:
    rng = np.random.default_rng(3)
    h, f, n = 768, 512, 6
    raws = _experts(types, n, h, f, rng)
    dense = [np.stack([gguf_dequantize(e[j], types[j]) for e in raws]) for j in range(3)]
    x = rng.standard_normal((7, h), dtype=np.float32)
    ids, w = _route(rng, 7, n, 3)
    ref = expert_forward_reference(*dense, 0, x, ids, w)  # [7, h]
    for isa in built.paths():
        got = _batch(built, raws, types, x, ids, w, 2, isa).astype(np.float64)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < MOE_TOL, f"isa {isa}: max relative error {err:.2e}"


@pytest.mark.parametrize("qtype", qdot.TYPES, ids=lambda t: t.name)
def test_matmul_rows_get_their_one_row_bits(built: qdot.Built, qtype: Q) -> None:
    """`qdot.matmul` of 11 rows (the multi-row dots, 8 then 3 rows per unpacking) gives each
    row what it gets alone, on every path."""
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, (37, 768), 0.02, rng)
    x = rng.standard_normal((11, 768), dtype=np.float32)
    alone = np.concatenate([qdot.matmul(built, x[i : i + 1], raw, qtype, 1, 0) for i in range(11)])
    for isa in built.paths():
        for threads in (1, 3):
            assert np.array_equal(qdot.matmul(built, x, raw, qtype, threads, isa), alone), isa


def test_bad_pairs_are_refused(built: qdot.Built) -> None:
    types = (Q.Q4_K, Q.Q4_K, Q.Q4_K)
    raws = _experts(types, 2, 256, 256, np.random.default_rng(0))
    x = np.ones((3, 256), np.float32)
    ptrs = [tuple(r.ctypes.data for r in e) for e in raws]
    rb, w = (144, 144, 144), np.ones(3, np.float32)

    def call(start: list[int], rows: list[int], ts=types) -> np.ndarray:
        return qdot.moe_batch(built, x, ptrs, np.array(start), np.array(rows), w, ts, rb, 256, 1)

    assert call([0, 2, 3], [0, 1, 2]).shape == (3, 256)
    for start, rows in (([1, 2, 3], [0, 1, 2]), ([0, 4, 3], [0, 1, 2]), ([0, 2, 3], [0, 1, 3])):
        with pytest.raises(ValueError, match="out of order|out of range"):
            call(start, rows)
    for start in ([0, 3], [0, 3, 2]):
        with pytest.raises(ValueError, match="start"):
            call(start, [0, 1, 2])
    with pytest.raises(ValueError, match="unknown type"):
        call([0, 2, 3], [0, 1, 2], (Q.F16, Q.Q4_K, Q.Q4_K))


@pytest.mark.usefixtures("int8")
def test_several_rows_take_the_batch_call_and_keep_each_rows_bits(
    q4km: Q4kmSlices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`grouped_expert_ffn` with int8 on: several rows go through one `moe_int8_batch` call,
    each row the same bits as that row alone (the one-token call), from the bank and from
    `expert_forward`, within MOE_TOL of float64; a slice counts only its experts."""
    from kvq.model.experts import expert_forward

    sl, half, bank = q4km
    calls: list[int] = []
    real = kernels.moe_int8_batch
    monkeypatch.setattr(
        kernels, "moe_int8_batch", lambda x, *a: calls.append(int(x.shape[0])) or real(x, *a)
    )
    dense = [t.dense().numpy() for t in sl.stacks]
    rng = np.random.default_rng(9)
    for t in (2, 5, 9):
        x = torch.from_numpy(rng.standard_normal((t, 256), dtype=np.float32))
        ids = torch.from_numpy(np.stack([rng.permutation(8)[:3] for _ in range(t)]))
        w = torch.from_numpy(rng.random((t, 3), dtype=np.float32))
        got = expert_forward(sl, x, ids, w)
        assert torch.equal(bank.forward(0, x, ids, w), got)
        for i in range(t):
            assert torch.equal(
                expert_forward(sl, x[i : i + 1], ids[i : i + 1], w[i : i + 1]), got[i : i + 1]
            ), (t, i)
        ref = expert_forward_reference(*dense, 0, x.numpy(), ids.numpy(), w.numpy())
        assert np.abs(got.numpy() - ref).max() / np.abs(ref).max() < MOE_TOL
        part = expert_forward(half, x, ids, w)
        sub = [d[2:6] for d in dense]
        ref_half = expert_forward_reference(*sub, 2, x.numpy(), ids.numpy(), w.numpy())
        assert np.abs(part.numpy() - ref_half).max() <= MOE_TOL * np.abs(ref_half).max()
        outside = ~((ids >= 2) & (ids < 6)).any(dim=1)
        assert not part[outside].any()
    assert calls == [t for t in (2, 5, 9) for _ in range(3)]  # slice, bank, half slice


def test_float32_activations_keep_the_python_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With KVQ_ACTIVATIONS=float32 no int8 call runs (the float32 kernels' precision rule)."""
    from kvq.gguf import read_meta
    from kvq.model.expert_slice import map_slice, slice_layout
    from kvq.model.experts import expert_forward
    from kvq.tools.synth import make_tiny

    path = tmp_path / "q4_k_m.gguf"
    make_tiny(path, layers=1, experts=8, hidden=256, expert_ffn=256, quant="q4_k_m", seed=5)
    sl = map_slice(path, slice_layout(read_meta(path), 0, 0, 8), 0, 0, 8)

    def refuse(*_a: object) -> None:
        raise AssertionError("an int8 call with float32 activations")

    monkeypatch.setattr(kernels, "moe_int8_batch", refuse)
    monkeypatch.setattr(kernels, "moe_int8", refuse)
    monkeypatch.setattr(qdot, "_options", qdot.KernelOptions("float32"))
    assert not kernels.int8_active()
    x = torch.ones((4, 256))
    ids = torch.tensor([[0, 1], [2, 3], [0, 7], [5, 6]])
    assert expert_forward(sl, x, ids, torch.ones((4, 2))).abs().sum() > 0
