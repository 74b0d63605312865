"""Remote results checked by the path the coordinator asked for, on real kernels (issue 32
item 3, issue 28 item 1): a worker on another SIMD path than the coordinator's is never flagged
(the int8 kernels give the same bits on every path: the check is bitwise), and liars that scale
their results by 1.01 or 1.05 are caught on every checked job, in q8 and in the GPU dtypes'
tolerance paths (bfloat16 and float16, checked against float32 activations)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kvq import wire
from kvq.bank import Bank, BankOptions
from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import DispatchCounters
from kvq.coordinator.check import BIAS_WINDOW
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.coordinator.verify import Verdict, Verifier, admitted
from kvq.gguf import read_meta
from kvq.model import load_slice
from kvq.quant import kernels, qdot
from kvq.tools.synth import make_tiny

EXPERTS, USED, JOBS = 8, 2, 300
_OPTS = BankOptions(numa_policy="off", vram_reserve_bytes=0, dynamic=False)
SCALAR, BEST = 0, -1  # qdot's isa numbers: forced scalar, the best this CPU has


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("paths") / "q4_k_m.gguf"
    make_tiny(path, layers=1, experts=EXPERTS, hidden=256, expert_ffn=256, quant="q4_k_m", seed=7)
    return path


def _jobs(seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(JOBS):
        t = int(rng.integers(1, 9))
        x = rng.standard_normal((t, 256)) * 10 ** rng.uniform(-2, 1.5)
        ids = np.argsort(rng.random((t, EXPERTS)), axis=1)[:, :USED].copy()
        out.append(
            (
                torch.from_numpy(x.astype(np.float32)),
                torch.from_numpy(ids),
                torch.from_numpy(rng.random((t, USED)).astype(np.float32)),
            )
        )
    return out


def _on(isa: int) -> qdot.KernelOptions:
    o = qdot.options()
    return qdot.KernelOptions("int8", o.cc, o.cache_dir, isa)


def _forward(bank: Bank, job, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x, ids, w = job
    with torch.inference_mode():
        return bank.forward(0, x.to(dtype), ids, w.to(dtype), 0, EXPERTS).float()


def _verifier(local: str) -> tuple[Verifier, MemoryBoard]:
    board = MemoryBoard()
    trust = Trust(TrustPolicy(), "c1", rng=random.Random(0))
    # every worker admitted to a GPU path (KVQ_GPU_WORKERS=*): its tolerance is what is tested
    v = Verifier(board, "tiny", trust, "all", local, DispatchCounters(), gpu_admitted=admitted("*"))
    return v, board


@pytest.mark.slow
def test_two_forced_simd_paths_agree_bitwise_and_liars_are_caught(model: Path) -> None:
    before = qdot.options()
    meta = read_meta(model)
    bank = Bank([load_slice(model, meta, 0, 0, EXPERTS)], _OPTS, "cpu")
    try:
        qdot.configure(_on(SCALAR))
        if not kernels.int8_active():
            pytest.skip("no C compiler: no int8 path")
        built = kernels.int8_kernel()
        assert built is not None
        best = built.best_isa
        jobs = _jobs(3)
        worker = [_forward(bank, j) for j in jobs]  # the worker: forced scalar
        qdot.configure(_on(BEST))  # the coordinator: the best path here
        v, board = _verifier("q8")
        caught = {1.01: 0, 1.05: 0}
        for i, (job, y) in enumerate(zip(jobs, worker, strict=True)):
            used, verdict = v.judge("honest", y, "q8", lambda j=job: _forward(bank, j))
            assert verdict is Verdict.VERIFIED, f"job {i}: {board.quarantined('tiny')}"
            assert torch.equal(used, y), "bit for bit"
            for scale in caught:
                liar = f"liar{scale}-{i}"  # a fresh liar per job: each lie is its first
                _, verdict = v.judge(liar, y * scale, "q8", lambda j=job: _forward(bank, j))
                caught[scale] += verdict is Verdict.REJECTED
    finally:
        qdot.configure(before)
    print(
        f"q8, worker scalar vs coordinator {best}: {JOBS} honest jobs, 0 flagged; "
        f"caught x1.01 {caught[1.01]}/{JOBS}, x1.05 {caught[1.05]}/{JOBS}"
    )
    assert v.stats.mismatches == 2 * JOBS and caught == {1.01: JOBS, 1.05: JOBS}
    assert "honest" not in board.quarantined("tiny")


@pytest.mark.parametrize(
    ("name", "low"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
@pytest.mark.slow
def test_gpu_dtype_paths_are_checked_against_float32_and_catch_one_percent(
    model: Path, name: str, low: torch.dtype
) -> None:
    """A worker computing in bfloat16/float16 (what a CUDA worker does) asks for its path; the
    q8 coordinator recomputes with float32 activations and holds it to the path's tolerance."""
    meta = read_meta(model)
    f32 = Bank([load_slice(model, meta, 0, 0, EXPERTS)], _OPTS, "cpu")
    lo = Bank([load_slice(model, meta, 0, 0, EXPERTS, dtype=low)], _OPTS, "cpu")
    before = qdot.options()
    qdot.configure(_on(BEST))
    try:
        v, board = _verifier("q8")
        v.refused("gpu", wire.Failure(type="WrongDType", message=name))
        assert v.asked("gpu") == name and v.exact_for("gpu")
        first = {1.01: 0, 1.05: 0}  # lies caught on the liar's first checked job
        within: dict[float, int] = {1.01: 0, 1.05: 0}  # most checked jobs before the catch
        worst_mean = 0.0
        for i, job in enumerate(_jobs(5)):
            y = _forward(lo, job, low)
            _, verdict = v.judge("gpu", y, name, lambda j=job: _forward(f32, j))
            assert verdict is Verdict.VERIFIED, f"job {i}: {board.quarantined('tiny')}"
            last = v.biases["gpu"]
            worst_mean = max(worst_mean, abs(sum(last) / len(last)))
        for scale in first:  # one liar per scale and per start: a steady lie from job s on
            for s in range(0, JOBS, 10):
                liar = f"liar{scale}-{s}"
                v.refused(liar, wire.Failure(type="WrongDType", message=name))
                for n, job in enumerate(_jobs(5)[s : s + BIAS_WINDOW], start=1):
                    y = _forward(lo, job, low) * scale
                    _, verdict = v.judge(liar, y, name, lambda j=job: _forward(f32, j))
                    if verdict is Verdict.REJECTED:
                        first[scale] += n == 1
                        within[scale] = max(within[scale], n)
                        break
                else:
                    raise AssertionError(
                        f"x{scale} from job {s} not caught in {BIAS_WINDOW} checks"
                    )
    finally:
        qdot.configure(before)
    liars = JOBS // 10
    print(
        f"{name}: {JOBS} honest jobs, 0 flagged (worst mean bias over {BIAS_WINDOW} {worst_mean:.3g}); "
        f"x1.01 caught at its first job {first[1.01]}/{liars}, all within {within[1.01]}; "
        f"x1.05 {first[1.05]}/{liars}, within {within[1.05]}"
    )
    assert within[1.01] <= BIAS_WINDOW and first[1.05] == liars
