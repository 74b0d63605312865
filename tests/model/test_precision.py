"""The precision of every default path, measured against the float64 reference on the same
dequantized weights, per expert call and as greedy tokens over 64 steps: the exact path
(`KVQ_ACTIVATIONS=float32`: exact dequantization or the fused float32 kernels) and the default
int8 activations of the C kernel for the types it covers (docs/models.md, "Precision")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvq.bank import Bank, BankOptions
from kvq.model import Backbone, expert_forward_reference, make_tiny
from kvq.model.backbone import SeqStep
from kvq.model.generate import generate
from kvq.quant import qdot

QUANTS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"]
REL_ERR = 1e-5  # max |fast - ref| / max|ref| per expert call
# the types the int8 C kernel covers (mxfp4: llama.cpp's mix, MXFP4 experts, Q8_0 elsewhere)
INT8_QUANTS = ["q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "q5_0", "mxfp4"]
INT8_REL_ERR = 3e-2  # two quantized activations per expert call (measured 0.5-2.1%)


@pytest.fixture(autouse=True)
def exact() -> object:
    """The float32 path (`KVQ_ACTIVATIONS=float32`) unless a test asks for int8."""
    before = qdot.options()
    qdot.configure(qdot.KernelOptions("float32", before.cc, before.cache_dir))
    yield
    qdot.configure(before)


def _tiny(path: Path, quant: str) -> Path:
    make_tiny(path, layers=2, experts=8, experts_used=2, hidden=256, expert_ffn=256, heads=4,
              kv_heads=2, head_dim=64, quant=quant)  # fmt: skip
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


@pytest.mark.parametrize("quant", INT8_QUANTS)
def test_int8_default_path_error_and_greedy_agreement(quant: str, tmp_path: Path) -> None:
    """The default (int8 activations): per expert call against float64, as one-row calls
    (decode) and 16-row calls, and 64 teacher-forced greedy steps against the float32 path."""
    path = _tiny(tmp_path / f"{quant}.gguf", quant)
    bb = Backbone.from_gguf(path)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    want = generate(bb, prompt, 64, stop_at_eos=False)  # float32 (the fixture)
    cc, cache = qdot.options().cc, qdot.options().cache_dir
    qdot.configure(qdot.KernelOptions("int8", cc, cache))
    from kvq.quant import kernels

    if not kernels.int8_active():
        pytest.skip("no C compiler: the default falls back to float32")
    bank = Bank(bb.experts.values(), BankOptions(hot_bytes=0, numa_policy="off", dynamic=False))
    gen = torch.Generator().manual_seed(0)
    worst = {1: 0.0, 16: 0.0}
    for layer, sl in bb.experts.items():
        dense = sl.dense_copy(torch.float64)
        for rows in worst:
            for _ in range(8 if rows == 1 else 2):
                x = torch.randn(rows, sl.hidden, generator=gen)
                # distinct per row, as a router's top-k
                ids = torch.stack([torch.randperm(sl.n_experts, generator=gen)[:2]
                                   for _ in range(rows)])  # fmt: skip
                w = torch.softmax(torch.randn(rows, 2, generator=gen), -1)
                got = bank.forward(layer, x, ids, w).double().numpy()
                ref = expert_forward_reference(dense.gate, dense.up, dense.down, 0, x, ids, w)
                err = float(np.abs(got - ref).max() / np.abs(ref).max())
                worst[rows] = max(worst[rows], err)
    got = _forced(bb, prompt, want)
    agree = sum(a == b for a, b in zip(got, want, strict=True))
    print(f"int8 {quant}: max rel err per expert call 1 row {worst[1]:.4f}, 16 rows "
          f"{worst[16]:.4f}; {agree} of 64 greedy steps equal to float32")  # fmt: skip
    assert max(worst.values()) < INT8_REL_ERR, worst
    assert agree >= 56, f"{quant}: {agree} of 64 greedy steps agree with float32"
