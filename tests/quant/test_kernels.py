"""The fused quantized matmul kernels against the float64 reference, for every kernel type,
odd shapes and batch sizes; and the properties the bank relies on (row and thread
independence)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from kvq.quant import kernels, qdot
from kvq.tools.synth.quants import random_blocks


@pytest.fixture(autouse=True)
def exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are the float32 kernels (`KVQ_ACTIVATIONS=float32`; int8 is the default)."""
    monkeypatch.setattr(qdot, "_options", qdot.KernelOptions("float32"))


# float32 accumulation against float64: a few float32 ulps of the largest output
TOL = 2e-6


def _case(qtype: Q, rows: int, cols: int, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, (rows, cols), 0.02, rng)  # [rows, row bytes]
    x = rng.standard_normal((batch, cols), dtype=np.float32)
    ref = x.astype(np.float64) @ gguf_dequantize(raw, qtype).astype(np.float64).T  # [B, rows]
    return torch.from_numpy(raw), torch.from_numpy(x), ref


@pytest.mark.parametrize("qtype", kernels.KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("rows", "cols", "batch"),
    [(1, 256, 1), (37, 512, 3), (130, 768, 16), (33, 256, 5), (17, 512, 64)],
)
def test_kernel_matches_float64_reference(qtype: Q, rows: int, cols: int, batch: int) -> None:
    raw, x, ref = _case(qtype, rows, cols, batch)
    assert kernels.covers(qtype, batch, x) or batch > 32  # 64 rows: dense path for some types
    got = kernels.matmul(x, raw, qtype).numpy().astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < TOL, f"{qtype.name}: max relative error {err:.2e}"


@pytest.mark.parametrize("qtype", kernels.KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_kernel_results_do_not_depend_on_the_threads(qtype: Q, batch: int) -> None:
    """What remote == local rests on: the same rows through the same kernel give the same bits
    on any thread count (a worker and a coordinator differ in cores)."""
    raw, x, _ = _case(qtype, 64, 512, batch, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.matmul(x, raw, qtype)
        torch.set_num_threads(2)
        two = kernels.matmul(x, raw, qtype)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("qtype", kernels.KERNEL_TYPES, ids=lambda t: t.name)
def test_batched_rows_agree_with_single_rows_to_float32_rounding(qtype: Q) -> None:
    """One row alone takes the one-row kernel, a batch the dequantize-once kernel: the two sum
    in another order, so they agree to float32 rounding, not bit for bit."""
    raw, x, _ = _case(qtype, 64, 512, 7, seed=2)
    full = kernels.matmul(x, raw, qtype)
    alone = torch.cat([kernels.matmul(x[i : i + 1], raw, qtype) for i in range(7)])
    assert not torch.equal(full, torch.zeros_like(full))
    torch.testing.assert_close(full, alone, rtol=0, atol=2e-6 * float(alone.abs().max()))


def test_covers_only_small_cpu_float32_batches() -> None:
    x = torch.zeros(4, 256)
    assert kernels.covers(Q.Q4_K, 4, x)
    assert not kernels.covers(Q.Q4_K, kernels.MAX_ROWS + 1, x)
    assert not kernels.covers(Q.Q4_K, 4, x.to(torch.bfloat16))
    assert not kernels.covers(Q.IQ4_NL, 4, x)
    assert not kernels.covers(Q.F16, 4, x)


def test_describe_says_what_computes_and_where_the_kernel_came_from(
    built: qdot.Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = qdot.options()
    try:
        qdot.configure(qdot.KernelOptions("int8", "cc", str(built.path.parent)))
        assert kernels.describe() == f"int8 {built.best_isa} ({built.origin})"
        qdot.configure(qdot.KernelOptions("float32"))
        assert kernels.describe() == "float32 (KVQ_ACTIVATIONS)"
        monkeypatch.setattr(qdot, "INSTALL_DIR", tmp_path)  # nothing installed, no compiler
        qdot.configure(qdot.KernelOptions("int8", str(tmp_path / "no-cc"), str(tmp_path)))
        assert kernels.describe() == "float32 (no int8 kernel: none installed, no compiler)"
        assert kernels.describe("cuda") == "torch on cuda"  # a GPU worker's torch path
    finally:
        qdot.configure(before)
