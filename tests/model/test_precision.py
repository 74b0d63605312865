"""The precision of every default path, measured against the float64 reference on the same
dequantized weights, per expert call and as greedy tokens over 64 steps: the exact path
(`KVQ_ACTIVATIONS=float32`: exact dequantization or the fused float32 kernels) and the default
(int8 activations of the C kernel for the types it covers, on every SIMD path this CPU runs;
float32 for F32, F16 and BF16). `pytest tests/model/test_precision.py -s -k default_path`
prints the table of docs/models.md, "Correctness"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from kvq.bank import Bank, BankOptions
from kvq.model import Backbone, expert_forward_reference
from kvq.model.backbone import SeqStep
from kvq.model.generate import generate
from kvq.quant import qdot
from kvq.tools.synth import make_tiny

QUANTS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"]
REL_ERR = 1e-5  # max |fast - ref| / max|ref| per expert call
FLOAT_QUANTS = ("f32", "f16", "bf16")  # no int8 kernel: the default is the exact path
# every expert type kvq computes (mxfp4: llama.cpp's mix, MXFP4 experts, Q8_0 elsewhere;
# q4_k_m: Q4_K gate/up, Q6_K down in these layers)
DEFAULT_QUANTS = [*FLOAT_QUANTS, "q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k", "mxfp4", "q4_k_m"]
TILE_ROWS = 64  # rows of the many-row call: 32 pairs for each of 4 experts
GEMM_MIN = 16  # csrc/qdot_gemm.h: an expert with this many rows takes the tile kernel
# max |y - ref| / max |ref| per expert call (two int8-quantized activations per call for the
# int8 types; measured 1.3-3.0%, table in docs/models.md, "Correctness"; bounds 1.4-2x that)
REL_BOUND = {
    "f32": 1e-5,
    "f16": 1e-5,
    "bf16": 1e-5,
    "q8_0": 3e-2,
    "q4_0": 3e-2,
    "q5_0": 3e-2,
    "q4_k": 4.5e-2,
    "q5_k": 4.5e-2,
    "q6_k": 4e-2,
    "mxfp4": 3e-2,
    "q4_k_m": 4.5e-2,
}
AGREE_FLOOR = dict.fromkeys(DEFAULT_QUANTS, 56)  # of 64 teacher-forced greedy steps


@pytest.fixture(autouse=True)
def exact() -> object:
    """The float32 path (`KVQ_ACTIVATIONS=float32`) unless a test asks for int8."""
    before = qdot.options()
    qdot.configure(qdot.KernelOptions("float32", before.cc, before.cache_dir))
    yield
    qdot.configure(before)


def _tiny(path: Path, quant: str) -> Path:
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
    return path


@pytest.fixture(scope="module", params=QUANTS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("prec") / f"{request.param}.gguf", request.param)


def test_expert_calls_match_the_float64_reference(model: Path) -> None:
    bb = Backbone.from_gguf(model)
    bank = Bank(bb.experts.values(), BankOptions(hot_bytes=0, numa_policy="off", dynamic=False))
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for layer, sl in bb.experts.items():
        dense = sl.dense_copy(torch.float64)
        x = torch.randn(16, sl.hidden, generator=gen)
        ids = torch.randint(0, sl.n_experts, (16, 2), generator=gen)
        w = torch.softmax(torch.randn(16, 2, generator=gen), -1)
        got = bank.forward(layer, x, ids, w).double().numpy()
        ref = expert_forward_reference(dense.gate, dense.up, dense.down, 0, x, ids, w)
        worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
    assert worst < REL_ERR, f"{model.stem}: max relative error {worst:.2e}"


def test_greedy_tokens_agree_with_float64_over_64_steps(model: Path) -> None:
    fast = Backbone.from_gguf(model)  # float32, experts dequantized per call
    ref = Backbone.from_gguf(model, dtype=torch.float64)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    got = generate(fast, prompt, 64, stop_at_eos=False)
    want = generate(ref, prompt, 64, stop_at_eos=False)
    agree = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    assert agree == 1.0, f"{model.stem}: {agree:.3f} of 64 greedy tokens agree"


def _forced(bb: Backbone, prompt: list[int], tokens: list[int]) -> list[int]:
    """Greedy picks while feeding `tokens` (teacher forcing: one flat-logit tie does not make
    every later step differ)."""
    cache = bb.new_cache()
    picks = [int(bb.forward([SeqStep(list(prompt), cache)])[0].argmax())]
    for t in tokens[:-1]:
        picks.append(int(bb.forward([SeqStep([t], cache)])[0].argmax()))
    return picks


def _gguf_experts(path: Path, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layer's stacked gate [E, F, H], up [E, F, H] and down [E, H, F] in float64, as gguf's
    own dequantizer reads them from the file (a reference kvq's code has no part in)."""
    found = {}
    for t in GGUFReader(path).tensors:
        kind = t.name.removeprefix(f"blk.{layer}.ffn_").removesuffix("_exps.weight")
        if kind in ("gate", "up", "down") and t.name.startswith(f"blk.{layer}."):
            found[kind] = gguf_dequantize(t.data, t.tensor_type).astype(np.float64)
    return found["gate"], found["up"], found["down"]


def _paths(quant: str) -> dict[str, int]:
    """The int8 kernel's SIMD paths this CPU runs ({name: forced isa}); for the float types
    (no int8 kernel) the one default path."""
    if quant in FLOAT_QUANTS:
        return {"float32": -1}
    built = qdot.load_configured()
    if built is None:
        pytest.skip("no C compiler: the default falls back to float32")
    return {built.isa(isa): isa for isa in (0, 1, 2, 3, 4)}  # lowered to what the CPU has


def _calls(hidden: int, n_experts: int, gen: torch.Generator) -> list[tuple[str, ...]]:
    """8 one-row calls (decode) and one call of TILE_ROWS rows, each routed to 2 of 4 experts,
    so every expert gets TILE_ROWS / 2 >= 16 rows (the tile kernel on AVX-512)."""
    calls = []
    for rows in [1] * 8 + [TILE_ROWS]:
        x = torch.randn(rows, hidden, generator=gen)
        if rows == 1:
            ids = torch.randperm(n_experts, generator=gen)[:2][None]
        else:
            t = torch.arange(rows)
            ids = torch.stack([t % 4, (t + 1 + t // 4 % 3) % 4], 1)  # two distinct of 4
        w = torch.softmax(torch.randn(rows, 2, generator=gen), -1)
        calls.append((x, ids, w))
    return calls


def _expert_errors(path: Path, quant: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Per SIMD path: the max relative error of the default path's expert calls against the
    float64 reference, one-row calls and TILE_ROWS-row calls apart, and each call's output."""
    bb = Backbone.from_gguf(path)
    opts = qdot.options()
    per_expert: list[int] = []
    real_batch = qdot.moe_batch

    def moe_batch(*args: Any, **kw: Any) -> Any:
        if args[1].shape[0] == TILE_ROWS:  # x [T, H]; start [n + 1]: each expert's pairs
            per_expert.extend(np.diff(args[3]).tolist())
        return real_batch(*args, **kw)

    monkeypatch.setattr(qdot, "moe_batch", moe_batch)
    out: dict[str, Any] = {}
    for name, isa in _paths(quant).items():
        qdot.configure(qdot.KernelOptions("int8", opts.cc, opts.cache_dir, isa))
        bank = Bank(bb.experts.values(), BankOptions(hot_bytes=0, numa_policy="off", dynamic=False))
        worst, outs = {1: 0.0, TILE_ROWS: 0.0}, []
        gen = torch.Generator().manual_seed(0)
        for layer, sl in bb.experts.items():
            gate, up, down = _gguf_experts(path, layer)
            for x, ids, w in _calls(sl.hidden, sl.n_experts, gen):
                got = bank.forward(layer, x, ids, w).double().numpy()
                ref = expert_forward_reference(gate, up, down, 0, x, ids, w)
                err = float(np.abs(got - ref).max() / np.abs(ref).max())
                worst[x.shape[0]] = max(worst[x.shape[0]], err)
                outs.append(got)
        out[name] = (worst, outs)
    if quant not in FLOAT_QUANTS:  # the many-row calls reached the kernel, >= 16 rows each
        assert per_expert and min(per_expert) >= GEMM_MIN
    return out


@pytest.mark.parametrize("quant", DEFAULT_QUANTS)
def test_default_path_error_and_greedy_agreement(
    quant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default path (int8 activations for the quantized types, float32 for the float ones)
    on every SIMD path this CPU runs: per expert call against float64 from gguf's own
    dequantization, one-row calls (decode) and TILE_ROWS-row calls (a prompt: the tile kernel
    on AVX-512, the multi-row dots elsewhere), the same bits on every path; and 64
    teacher-forced greedy steps against the exact path (float32, itself equal to float64
    over 64 steps above). `pytest -s` prints the docs/models.md table's rows."""
    path = _tiny(tmp_path / f"{quant}.gguf", quant)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    want = generate(Backbone.from_gguf(path), prompt, 64, stop_at_eos=False)  # float32
    per_path = _expert_errors(path, quant, monkeypatch)
    first = next(iter(per_path.values()))[1]
    for name, (_worst, outs) in per_path.items():
        assert all(np.array_equal(a, b) for a, b in zip(outs, first, strict=True)), name
    opts = qdot.options()
    qdot.configure(qdot.KernelOptions("int8", opts.cc, opts.cache_dir))  # the default
    agree = sum(
        a == b for a, b in zip(_forced(Backbone.from_gguf(path), prompt, want), want, strict=True)
    )
    worst = next(iter(per_path.values()))[0]
    bound = REL_BOUND[quant]
    print(
        f"\n| {quant} | {', '.join(per_path)} | {worst[1]:.2e} | {worst[TILE_ROWS]:.2e} | "
        f"{bound:.0e} | {agree} of 64 | {AGREE_FLOOR[quant]} |"
    )
    assert max(worst.values()) < bound, (quant, worst)
    assert agree >= AGREE_FLOOR[quant], f"{quant}: {agree} of 64 greedy steps agree"
