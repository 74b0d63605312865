"""The precision rule, measured: experts computed from their GGUF encoding (the bank's cold
kernel: exact dequantization + float32 matmuls) against the float64 reference on the same
dequantized weights, per expert call and as greedy tokens over 64 steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvq.bank import Bank, BankOptions
from kvq.model import Backbone, expert_forward_reference, make_tiny

QUANTS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"]
REL_ERR = 1e-5  # max |fast - ref| / max|ref| per expert call


@pytest.fixture(scope="module", params=QUANTS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prec") / f"{request.param}.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, hidden=256, expert_ffn=256, heads=4,
              kv_heads=2, head_dim=64, quant=request.param)  # fmt: skip
    return path


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
    got = fast.generate(prompt, 64, stop_at_eos=False)
    want = ref.generate(prompt, 64, stop_at_eos=False)
    agree = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    assert agree == 1.0, f"{model.stem}: {agree:.3f} of 64 greedy tokens agree"
