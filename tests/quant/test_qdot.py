"""The int8-activation C kernel (`kvq.quant.qdot`, KVQ_ACTIVATIONS=int8) against the float64
reference for every type it covers and odd shapes; the scalar and SIMD paths give the same bits;
results do not depend on the thread count; no compiler means the float32 kernels, not a crash;
and generation with it agrees with float32 on greedy tokens.

Measured errors (stated in docs/models.md): max |y - ref| / max |ref| about 0.7-0.8% for the
K-quants and 0.55-0.65% for Q8_0/Q4_0 with Gaussian activations (the activations' 8-bit
rounding; the weights are exact)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from kvq.model.generate import generate
from kvq.quant import kernels, qdot
from kvq.tools.synth.quants import random_blocks

if TYPE_CHECKING:
    from conftest import Q4kmSlices  # tests/quant/conftest.py

TOL = 1.2e-2  # max relative error of one product against float64 (measured 0.55-0.8%)


def _bound(qtype: Q, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The most the activations' rounding can move each output [B, N]: half a step
    (amax / 127 / 2) per value times |w|, plus float32 accumulation slack."""
    size = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    w = np.abs(gguf_dequantize(raw, qtype).astype(np.float64))  # [N, K]
    xb = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, size)  # [B, K / size, size]
    half_step = np.repeat(xb.max(axis=2) / 254, size, axis=1)  # [B, K]
    return half_step @ w.T + 1e-5 * (np.abs(x) @ w.T)


def _case(qtype: Q, rows: int, cols: int, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, (rows, cols), 0.02, rng)  # [rows, row bytes]
    if qtype == Q.Q6_K:  # int8 scales of both signs, not only random_blocks' 16..63
        blocks = raw.reshape(-1, 210)
        blocks[:, 192:208] = rng.integers(0, 256, (blocks.shape[0], 16), dtype=np.uint8)
    x = rng.standard_normal((batch, cols), dtype=np.float32)
    ref = x.astype(np.float64) @ gguf_dequantize(raw, qtype).astype(np.float64).T  # [B, rows]
    return raw, x, ref


@pytest.mark.parametrize("qtype", qdot.TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rows", "cols", "batch"), [(1, 256, 1), (37, 512, 3), (130, 768, 1), (33, 1280, 5)]
)
def test_qdot_matches_float64_reference(
    built: qdot.Built, qtype: Q, rows: int, cols: int, batch: int
) -> None:
    raw, x, ref = _case(qtype, rows, cols, batch)
    bound = _bound(qtype, raw, x)
    for isa in built.paths():
        got = qdot.matmul(built, x, raw, qtype, 2, isa).astype(np.float64)
        assert (np.abs(got - ref) <= bound).all(), f"{qtype.name} isa {isa}: beyond the bound"
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert rows * batch < 32 or err < TOL, (
            f"{qtype.name} isa {isa}: max relative error {err:.2e}"
        )


@pytest.mark.parametrize("qtype", qdot.TYPES, ids=lambda t: t.name)
def test_scalar_and_simd_paths_give_the_same_bits(built: qdot.Built, qtype: Q) -> None:
    """Integer dot products are exact and the float part is shared: a worker on an AVX2-only
    CPU and a coordinator with VNNI agree bit for bit. Rows of x 1 to 9: the one-row dots,
    the few-row and the 8-lane multi-row forms (and a second group of 8)."""
    for batch in (1, 2, 3, 4, 5, 8, 9):
        raw, x, _ = _case(qtype, 67, 1024, batch, seed=4 + batch)
        scalar = qdot.matmul(built, x, raw, qtype, 1, 0)
        for isa in built.paths()[1:]:
            got = qdot.matmul(built, x, raw, qtype, 1, isa)
            assert np.array_equal(got, scalar), (batch, isa)


@pytest.mark.parametrize("qtype", qdot.TYPES, ids=lambda t: t.name)
def test_qdot_results_do_not_depend_on_the_threads(built: qdot.Built, qtype: Q) -> None:
    raw, x, _ = _case(qtype, 101, 512, 2, seed=1)  # 101 rows: not a multiple of the threads
    one = qdot.matmul(built, x, raw, qtype, 1)
    for threads in (2, 3, 7):
        assert np.array_equal(qdot.matmul(built, x, raw, qtype, threads), one), threads


def test_rows_are_independent(built: qdot.Built) -> None:
    """A row's result is the same alone or among others (what a job of several rows needs)."""
    raw, x, _ = _case(Q.Q4_K, 40, 512, 4, seed=2)
    full = qdot.matmul(built, x, raw, Q.Q4_K, 2)
    for i in range(4):
        assert np.array_equal(qdot.matmul(built, x[i : i + 1], raw, Q.Q4_K, 2), full[i : i + 1])


def test_non_finite_activations_give_nan_not_garbage(built: qdot.Built) -> None:
    raw, x, _ = _case(Q.Q4_K, 8, 512, 1)
    x[0, 3] = np.inf
    y = qdot.matmul(built, x, raw, Q.Q4_K, 2)
    assert np.isnan(y).all()


def test_bad_shapes_are_refused(built: qdot.Built) -> None:
    raw, x, _ = _case(Q.Q4_K, 4, 512, 1)
    with pytest.raises(ValueError, match="multiple"):
        qdot.matmul(built, x[:, :300].copy(), raw, Q.Q4_K, 1)
    with pytest.raises(ValueError, match="unknown type"):
        qdot.matmul(built, x, raw, Q.F16, 1)


@pytest.mark.usefixtures("int8")
def test_kernels_use_it_for_every_row_count_only_when_asked() -> None:
    """With int8 on, one row and several rows go through the C kernel (each row the bits it
    gets alone); with it off, the float32 kernels."""
    raw, x, _ = _case(Q.Q6_K, 64, 512, 3, seed=3)
    w, xt = torch.from_numpy(raw), torch.from_numpy(x)
    built = kernels.int8_kernel()
    assert built is not None
    one = kernels.matmul(xt[:1], w, Q.Q6_K)
    assert torch.equal(one, torch.from_numpy(qdot.matmul(built, x[:1], raw, Q.Q6_K, 1)))
    many = kernels.matmul(xt, w, Q.Q6_K)
    assert torch.equal(many, torch.from_numpy(qdot.matmul(built, x, raw, Q.Q6_K, 1)))
    assert torch.equal(many[:1], one)
    qdot.configure(qdot.KernelOptions("float32"))
    assert not kernels.int8_active()
    assert torch.equal(kernels.matmul(xt, w, Q.Q6_K), kernels.matmul_float32(xt, w, Q.Q6_K))
    assert not torch.equal(kernels.matmul(xt, w, Q.Q6_K), many)
    assert not torch.equal(kernels.matmul(xt[:1], w, Q.Q6_K), one)


def test_no_compiler_means_the_float32_kernels_and_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qdot, "INSTALL_DIR", tmp_path)  # no library from the install either
    raw, x, _ = _case(Q.Q4_K, 16, 512, 1)
    w, xt = torch.from_numpy(raw), torch.from_numpy(x)
    f32 = kernels.matmul_float32(xt, w, Q.Q4_K)
    before = qdot.options()
    try:
        for cc in (str(tmp_path / "no-such-cc"), "false"):  # missing; a build that fails
            qdot.configure(qdot.KernelOptions("int8", cc, str(tmp_path / cc.replace("/", "_"))))
            with caplog.at_level(logging.WARNING, logger="kvq.quant"):
                caplog.clear()
                assert not kernels.int8_active()
                assert torch.equal(kernels.matmul(xt, w, Q.Q4_K), f32)
                kernels.matmul(xt, w, Q.Q4_K)
            warned = [r for r in caplog.records if "could not be built" in r.message]
            assert len(warned) == 1, cc
    finally:
        qdot.configure(before)


def test_processes_building_at_once_each_load_a_whole_library(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from kvq.quant import qdot; "
        "b = qdot.build('cc', Path(sys.argv[1])); print(b.best_isa)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len(set(outs)) == 1
    assert [f.suffix for f in tmp_path.iterdir()] == [".so"], "no temporary file left behind"


def _forced_argmax(bb, prompt: list[int], tokens: list[int]) -> list[int]:
    """The greedy pick at each step while feeding `tokens` (teacher forcing): one early
    disagreement does not make every later step disagree."""
    from kvq.model.backbone import SeqStep

    cache = bb.new_cache()
    logits = bb.forward([SeqStep(list(prompt), cache)])
    picks = [int(logits[0].argmax())]
    for t in tokens[:-1]:
        logits = bb.forward([SeqStep([t], cache)])
        picks.append(int(logits[0].argmax()))
    return picks


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0"])
def test_greedy_tokens_with_int8_activations_agree_with_float32(
    quant: str, tmp_path: Path, built: qdot.Built
) -> None:
    """64 greedy steps of a small model (q4_k_m: Q4_K with Q6_K), int8 activations against
    float32 (which matches float64 exactly: tests/model/test_precision.py), each step fed the
    float32 tokens. Random weights give flat logits (the top two often within 1%), so a
    trained model's agreement is higher; free-running, the first disagreement changes every
    token after it (measured: 6 and 9 tokens before it)."""
    from kvq.model import Backbone
    from kvq.tools.synth import make_tiny

    path = tmp_path / f"{quant}.gguf"
    make_tiny(
        path,
        layers=2,
        experts=8,
        experts_used=2,
        hidden=256,
        expert_ffn=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        quant=quant,
    )
    bb = Backbone.from_gguf(path)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    want = generate(bb, prompt, 64, stop_at_eos=False)
    assert _forced_argmax(bb, prompt, want) == want
    before = qdot.options()
    qdot.configure(qdot.KernelOptions("int8", "cc", str(built.path.parent)))
    try:
        got = _forced_argmax(bb, prompt, want)
        free = generate(bb, prompt, 64, stop_at_eos=False)
    finally:
        qdot.configure(before)
    agree = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    first = next((i for i, (a, b) in enumerate(zip(free, want, strict=True)) if a != b), 64)
    print(f"{quant}: {agree:.3f} of 64 greedy steps agree; free-running, {first} tokens agree")
    assert agree >= 0.9, f"{quant}: {agree:.3f} of 64 greedy steps agree with float32"


def test_an_honest_int8_worker_is_never_flagged_against_float32(
    tmp_path: Path, built: qdot.Built
) -> None:
    """What `ROW_TOLERANCE["q8"]` rests on: single-row jobs (each expert call one row, so all
    of it through the int8 kernel) of a q4_k_m slice, int8 against the float32 recompute a
    coordinator does; and int8 against int8 on other thread counts is bit-exact."""
    from kvq.bank import Bank, BankOptions
    from kvq.coordinator.check import compare, tolerance
    from kvq.gguf import read_meta
    from kvq.model.expert_slice import map_slice, slice_layout
    from kvq.tools.synth import make_tiny

    path = tmp_path / "q4_k_m.gguf"
    make_tiny(path, layers=1, experts=8, hidden=256, expert_ffn=256, quant="q4_k_m", seed=7)
    sl = map_slice(path, slice_layout(read_meta(path), 0, 0, 8), 0, 0, 8)
    bank = Bank([sl], BankOptions(numa_policy="off", vram_reserve_bytes=0, dynamic=False), "cpu")
    rng = np.random.default_rng(3)
    tol, worst, before = tolerance("q8", "float32"), 0.0, qdot.options()
    threads = torch.get_num_threads()
    try:
        for i in range(500):
            x = torch.from_numpy(
                (rng.standard_normal((1, 256)) * 10 ** rng.uniform(-2, 1.5)).astype(np.float32)
            )
            ids = torch.from_numpy(np.argsort(rng.random((1, 8)), axis=1)[:, :2].copy())
            w = torch.from_numpy(rng.random((1, 2)).astype(np.float32))
            qdot.configure(qdot.KernelOptions("float32"))
            ref = bank.forward(0, x, ids, w)
            qdot.configure(qdot.KernelOptions("int8", "cc", str(built.path.parent)))
            got = bank.forward(0, x, ids, w)
            c = compare(got, ref, tol)
            assert c.ok, f"job {i}: relative row error {c.rel_err:.3g} > {tol}"
            worst = max(worst, c.rel_err)
            if i % 50 == 0:
                torch.set_num_threads(1)
                assert torch.equal(bank.forward(0, x, ids, w), got), "remote == local"
                torch.set_num_threads(threads)
    finally:
        qdot.configure(before)
        torch.set_num_threads(threads)
    print(f"q8: worst relative row error {worst:.4g} over 500 jobs, tolerance {tol}")
    assert worst < tol / 4, "the tolerance keeps a margin over honest rounding"


def _moe_case(types: tuple[Q, Q, Q], n: int, h: int, f: int, seed: int = 0):
    """n experts' raw gate [f, h], up [f, h], down [h, f] of `types`, x [h], weights [n], and
    the float64 reference of the sum of weighted SwiGLU experts."""
    from kvq.model.experts import expert_forward_reference

    rng = np.random.default_rng(seed)
    shapes = ((f, h), (f, h), (h, f))
    raws = [
        [random_blocks(t, s, 0.05, rng) for t, s in zip(types, shapes, strict=True)]
        for _ in range(n)
    ]
    dense = [np.stack([gguf_dequantize(r[j], types[j]) for r in raws]) for j in range(3)]
    x = rng.standard_normal(h, dtype=np.float32)
    w = rng.random(n, dtype=np.float32)
    ids = np.arange(n)[None]  # [1, n]: every expert, in order
    ref = expert_forward_reference(*dense, 0, x[None], ids, w[None])[0]  # [h]
    return raws, x, w, ref


def _moe(built: qdot.Built, raws, types, x, w, threads: int = 2, isa: int = -1) -> np.ndarray:
    ptrs = [tuple(r.ctypes.data for r in e) for e in raws]
    rb = tuple(int(r.shape[1]) for r in raws[0])
    return qdot.moe(built, x, ptrs, types, rb, raws[0][0].shape[0], w, threads, isa)


MOE_TYPES = [
    (Q.Q4_K, Q.Q4_K, Q.Q6_K),
    (Q.Q5_K, Q.Q5_K, Q.Q4_K),
    (Q.Q8_0, Q.Q4_0, Q.Q8_0),
    (Q.Q4_K, Q.Q8_0, Q.Q4_0),
    (Q.Q6_K, Q.Q6_K, Q.Q5_K),
    (Q.MXFP4, Q.MXFP4, Q.MXFP4),
]
# and gate and up taking x in two orders (the 512-bit Q4_K pairs its chunks)
BITS_TYPES = [*MOE_TYPES, (Q.Q4_K, Q.Q6_K, Q.Q4_K)]
MOE_TOL = 3e-2  # max relative error of a layer's sum (measured 0.7-2.5%: two quantizations)


@pytest.mark.parametrize("types", MOE_TYPES, ids=lambda ts: "-".join(t.name for t in ts))
@pytest.mark.parametrize(("n", "h", "f"), [(1, 256, 256), (3, 512, 768), (8, 768, 512)])
def test_moe_call_matches_float64_reference(
    built: qdot.Built, types: tuple[Q, Q, Q], n: int, h: int, f: int
) -> None:
    raws, x, w, ref = _moe_case(types, n, h, f)
    for isa in built.paths():
        got = _moe(built, raws, types, x, w, isa=isa).astype(np.float64)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < MOE_TOL, f"isa {isa}: max relative error {err:.2e}"


@pytest.mark.parametrize("types", BITS_TYPES, ids=lambda ts: "-".join(t.name for t in ts))
def test_moe_call_gives_the_same_bits_on_every_path_and_thread_count(
    built: qdot.Built, types: tuple[Q, Q, Q]
) -> None:
    raws, x, w, _ = _moe_case(types, 5, 768, 512, seed=6)
    scalar = _moe(built, raws, types, x, w, threads=1, isa=0)
    for isa in built.paths()[1:]:
        assert np.array_equal(_moe(built, raws, types, x, w, threads=1, isa=isa), scalar), isa
    for threads in (2, 3, 7):
        assert np.array_equal(_moe(built, raws, types, x, w, threads=threads), scalar), threads


def test_moe_call_equals_its_matrix_by_matrix_form(built: qdot.Built) -> None:
    """What the call fuses: per expert, qdot gate and up, silu(g) * u in float32, qdot down,
    and the weighted terms added in order from 0; only the SiLU's expf may round differently
    from numpy's (and move one 8-bit step), so this compares to 1e-4, not bits."""
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    raws, x, w, _ = _moe_case(types, 4, 512, 256, seed=8)
    acc = np.zeros(512, dtype=np.float32)
    for (g, u, d), we in zip(raws, w, strict=True):
        a = qdot.matmul(built, x[None], g, types[0], 1)
        b = qdot.matmul(built, x[None], u, types[1], 1)
        hid = (a / (np.float32(1) + np.exp(-a)) * b).astype(np.float32)
        acc = acc + we * qdot.matmul(built, hid, d, types[2], 1)[0]
    got = _moe(built, raws, types, x, w)
    assert np.abs(got - acc).max() <= 1e-4 * np.abs(acc).max()


def test_moe_call_refuses_bad_types_and_sizes(built: qdot.Built) -> None:
    types = (Q.Q4_K, Q.Q4_K, Q.Q4_K)
    raws, x, w, _ = _moe_case(types, 1, 256, 256)
    with pytest.raises(ValueError, match="unknown type"):
        _moe(built, raws, (Q.F16, Q.Q4_K, Q.Q4_K), x, w)
    with pytest.raises(ValueError, match="multiple"):
        qdot.moe(
            built,
            x[:200].copy(),
            [tuple(r.ctypes.data for r in raws[0])],
            types,
            (144, 144, 144),
            256,
            w,
            1,
        )


@pytest.mark.usefixtures("int8")
def test_one_token_expert_calls_take_the_one_call_path(
    q4km: Q4kmSlices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step's experts (one row, int8 on) go through `kernels.moe_int8`, within
    MOE_TOL of float64, the same bits from the bank and from `expert_forward`, and only the
    experts inside the slice count."""
    from kvq.model.experts import expert_forward, expert_forward_reference

    sl, half, bank = q4km
    calls: list[int] = []
    real = kernels.moe_int8
    monkeypatch.setattr(
        kernels, "moe_int8", lambda x, e, t, w: calls.append(len(e)) or real(x, e, t, w)
    )
    dense = [t.dense().numpy() for t in sl.stacks]
    rng = np.random.default_rng(9)
    for _ in range(10):
        x = torch.from_numpy(rng.standard_normal((1, 256), dtype=np.float32))
        ids = torch.from_numpy(rng.permutation(8)[None, :3].copy())
        w = torch.from_numpy(rng.random((1, 3), dtype=np.float32))
        got = expert_forward(sl, x, ids, w)
        assert torch.equal(bank.forward(0, x, ids, w), got)
        ref = expert_forward_reference(*dense, 0, x.numpy(), ids.numpy(), w.numpy())
        err = np.abs(got.numpy() - ref).max() / np.abs(ref).max()
        assert err < MOE_TOL, err
        inside = [int(e) for e in ids[0] if 2 <= e < 6]
        part = expert_forward(half, x, ids, w)
        if not inside:
            assert not part.any()
        else:
            sub = [d[2:6] for d in dense]
            ref_half = expert_forward_reference(*sub, 2, x.numpy(), ids.numpy(), w.numpy())
            assert np.abs(part.numpy() - ref_half).max() / np.abs(ref_half).max() < MOE_TOL
    assert calls and all(1 <= c <= 3 for c in calls)
