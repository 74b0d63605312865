"""The `f32cpu` path (X17, issue 46 item 5): float32 activations on the CPU with batch-invariant
products give a worker's rows the bits the coordinator's recomputation of those rows alone
gives, whatever else was in the worker's batch, so the check is bitwise: an honest worker is
never flagged, and a lie far below float32's tolerance (x1.00001) is caught on its first job.
With `KVQ_BATCH_INVARIANT=false` the label is `float32`, held to a tolerance."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kvq.bank import Bank, BankOptions
from kvq.bank.server import ExpertServer
from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import DispatchCounters
from kvq.coordinator.check import deterministic, tolerance
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.coordinator.verify import Verdict, Verifier
from kvq.device import dtype_name
from kvq.gguf import read_meta
from kvq.model import load_slice
from kvq.quant import qdot
from kvq.tools.synth import make_tiny

EXPERTS, USED, JOBS = 8, 2, 60
_OPTS = BankOptions(numa_policy="off", vram_reserve_bytes=0, dynamic=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("f32cpu") / "q4_k_m.gguf"
    make_tiny(path, layers=1, experts=EXPERTS, hidden=256, expert_ffn=256, quant="q4_k_m", seed=9)
    return path


def _float32(invariant: bool) -> qdot.KernelOptions:
    o = qdot.options()
    return qdot.KernelOptions("float32", o.cc, o.cache_dir, o.isa, batch_invariant=invariant)


def _rows(rng: np.random.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = rng.standard_normal((t, 256)) * 10 ** rng.uniform(-2, 1.5)
    ids = np.argsort(rng.random((t, EXPERTS)), axis=1)[:, :USED].copy()
    w = rng.random((t, USED))
    return (
        torch.from_numpy(x.astype(np.float32)),
        torch.from_numpy(ids),
        torch.from_numpy(w.astype(np.float32)),
    )


def _forward(bank: Bank, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return bank.forward(0, x, ids, w, 0, EXPERTS)


def test_the_label_names_the_path() -> None:
    before = qdot.options()
    try:
        qdot.configure(_float32(True))
        assert dtype_name(torch.float32, "cpu") == "f32cpu"
        assert dtype_name(torch.float32, "cuda") == "float32"  # GPUs: tolerance
        assert dtype_name(torch.bfloat16, "cpu") == "bfloat16"
        qdot.configure(_float32(False))
        assert dtype_name(torch.float32, "cpu") == "float32"
    finally:
        qdot.configure(before)
    assert deterministic("f32cpu", "f32cpu") and tolerance("f32cpu", "f32cpu") == 0.0
    assert not deterministic("f32cpu", "q8") and not deterministic("float32", "float32")


def test_f32cpu_results_in_any_batch_are_checked_bit_for_bit(model: Path) -> None:
    before = qdot.options()
    meta = read_meta(model)
    bank = Bank([load_slice(model, meta, 0, 0, EXPERTS)], _OPTS, "cpu")
    rng = np.random.default_rng(4)
    board = MemoryBoard()
    trust = Trust(TrustPolicy(), "c1", rng=random.Random(0))
    try:
        qdot.configure(_float32(True))
        server = ExpertServer("w1", "tiny", bank, 256, torch.float32)
        assert server.dtype_name == "f32cpu"
        v = Verifier(board, "tiny", trust, "all", "f32cpu", DispatchCounters())
        caught = 0
        for i in range(JOBS):
            t, extra = int(rng.integers(1, 9)), int(rng.integers(1, 40))
            x, ids, w = _rows(rng, t)
            ox, oids, ow = _rows(rng, extra)  # other rows of the worker's batch, before the job's
            at = int(rng.integers(0, extra + 1))
            big = [torch.cat((o[:at], j, o[at:])) for o, j in ((ox, x), (oids, ids), (ow, w))]
            y = _forward(bank, *big)[at : at + t]  # the worker's: the job's rows among others

            def alone(x=x, ids=ids, w=w) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return _forward(bank, x, ids, w)

            used, verdict = v.judge("honest", y, "f32cpu", alone)
            assert verdict is Verdict.VERIFIED, f"job {i}: {board.quarantined('tiny')}"
            assert torch.equal(used, y)
            _, verdict = v.judge(f"liar{i}", y * 1.00001, "f32cpu", alone)
            caught += verdict is Verdict.REJECTED
    finally:
        qdot.configure(before)
    print(f"f32cpu: {JOBS} honest jobs among other rows, 0 flagged; x1.00001 caught {caught}")
    assert caught == JOBS and "honest" not in board.quarantined("tiny")
