"""`Verifier`: what a coordinator does with one remote result (issue 11 items 3 and 4).

Non-finite results never pass, with checks on or off; a checked result that agrees is replaced
by the local one and proves the worker; one that does not quarantines the worker on the board;
a lower-precision result is judged by its own dtype's tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import DispatchCounters
from kvq.coordinator.check import BIAS_WINDOW
from kvq.coordinator.pending import Answer
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.coordinator.verify import Verdict, Verifier, admitted

REF = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7 + 0.5  # [R=3, H=4]


def _verifier(mode: str = "sampled", policy: TrustPolicy | None = None, gpu: str = "*"):  # type: ignore[no-untyped-def]
    board = MemoryBoard()
    caught: list[str] = []
    trust = Trust(policy or TrustPolicy(), "c1", rng=random.Random(0))
    v = Verifier(
        board, "m", trust, mode, "float32", DispatchCounters(), caught.append, admitted(gpu)
    )
    return v, board, caught


class Recompute:
    """The local recomputation, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return REF.clone()


@pytest.mark.parametrize("mode", ["sampled", "all", "off"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_is_never_used_whatever_the_mode(mode: str, bad: float) -> None:
    v, board, caught = _verifier(mode)
    y = REF.clone()
    y[2, 1] = bad
    local = Recompute()
    used, verdict = v.judge("w", y, "float32", local)
    assert verdict is Verdict.REJECTED and torch.equal(used, REF) and local.calls == 1
    assert v.stats.nonfinite_results == 1 and v.stats.quarantines == 1 and caught == ["w"]
    assert board.quarantined("m")["w"].reason == "its result holds NaN or infinity"
    assert v.barred("w")


def test_a_checked_result_that_agrees_is_replaced_by_the_local_one_and_proves() -> None:
    v, board, caught = _verifier()
    y = REF + 1e-6
    used, verdict = v.judge("w", y, "float32", Recompute())
    assert verdict is Verdict.VERIFIED and torch.equal(used, REF)
    assert v.stats.verified == 1 and v.stats.verified_rows == 3 and v.stats.remote_rows == 3
    assert caught == [] and board.quarantined("m") == {}


def test_a_mismatch_quarantines_on_the_board_and_the_local_result_is_used() -> None:
    v, board, caught = _verifier()
    used, verdict = v.judge("w", REF * 1.2, "bfloat16", Recompute())
    assert verdict is Verdict.REJECTED and torch.equal(used, REF)
    q = board.quarantined("m")["w"]
    assert q.mismatches == 1 and q.coord == "c1" and "bfloat16 result" in q.reason
    assert v.stats.mismatches == 1 and caught == ["w"]


def test_the_coordinator_not_the_label_decides_the_check() -> None:
    """A result labelled with another path than its job asked for is refused and counts as a
    lie; a worker that says (by failing a job) it runs a GPU dtype is asked for that one, held
    to its measured tolerance, which a 1% lie fails; a looser CPU label is never granted."""
    from kvq import wire

    v, board, caught = _verifier()
    assert v.asked("w") == "float32"
    assert v.check("w", REF.clone(), "bfloat16", REF) is Verdict.REJECTED
    assert "a bfloat16 result for a job asking float32" in board.quarantined("m")["w"].reason
    v.refused("q", wire.Failure(type="WrongDType", message="q8"))
    assert v.asked("q") == "float32", "q8 is not checkable by a float32 coordinator"
    v.refused("g", wire.Failure(type="WrongDType", message="bfloat16"))
    assert v.asked("g") == "bfloat16"
    noise = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 1e-3
    assert v.check("g", REF + noise * REF, "bfloat16", REF) is Verdict.VERIFIED
    assert v.check("g", REF * 1.05, "bfloat16", REF) is Verdict.REJECTED, "5%: at once"
    verdicts = [v.check("g", REF * 1.01, "bfloat16", REF) for _ in range(BIAS_WINDOW)]
    assert verdicts[-1] is Verdict.REJECTED, "1%: by the mean bias of its last checked results"
    assert caught == ["w", "g", "g"]


def test_a_gpu_path_is_granted_only_to_a_worker_the_operator_admitted() -> None:
    """X3: a worker cannot loosen its own check by saying it runs a GPU. Not in
    KVQ_GPU_WORKERS, its `WrongDType: bfloat16` is not negotiated (it is asked for the
    coordinator's path still), and a bfloat16 label earns it float32's tolerance when two
    holders' answers are compared; an admitted one gets bfloat16's."""
    from kvq import wire

    v, _, _ = _verifier(gpu="gpu-1")
    claim = wire.Failure(type="WrongDType", message="bfloat16")
    v.refused("cpu-1", claim)
    v.refused("gpu-1", claim)
    assert v.asked("cpu-1") == "float32" and v.asked("gpu-1") == "bfloat16"
    off = REF * 1.005  # 0.5%: inside bfloat16's rounding, far outside float32's
    honest = Answer("w", REF, "float32")
    assert not v.agree(Answer("cpu-1", off, "bfloat16"), honest)
    assert v.agree(Answer("gpu-1", off, "bfloat16"), honest)
    assert v.held_to("cpu-1", "bfloat16") == "float32" and v.held_to("cpu-1", "q8") == "q8"


def test_the_gpu_workers_setting_admits_listed_ids_or_any() -> None:
    assert admitted("*")("anyone") and admitted("a, b")("b")
    assert not admitted("a,b")("c") and not admitted("")("a")


def test_q8_against_q8_is_bitwise() -> None:
    board = MemoryBoard()
    v = Verifier(board, "m", Trust(TrustPolicy(), "c1"), "all", "q8", DispatchCounters())
    assert v.check("w", REF.clone(), "q8", REF) is Verdict.VERIFIED
    one_ulp = torch.nextafter(REF, torch.full_like(REF, 10.0))
    assert v.check("w2", one_ulp, "q8", REF) is Verdict.REJECTED, "one ulp is a lie"
    assert "not bit-exact" in board.quarantined("m")["w2"].reason


def test_stage_answers_with_one_numerics_label_are_compared_bit_for_bit() -> None:
    """Stage answers (`exact=False`): one label (the same kind of CPU, kvq and torch) is held
    to the same bits; two labels, or none, to float32's tolerance."""
    v = Verifier(MemoryBoard(), "m", Trust(TrustPolicy(), "c1"), "all", "q8", DispatchCounters())
    one_ulp = torch.nextafter(REF, torch.full_like(REF, 10.0))
    label = "x86_64 AuthenticAMD avx2 avx512f kvq-1 torch-2 AVX512"
    same = Answer("a", REF.clone(), "q8", label), Answer("b", REF.clone(), "q8", label)
    assert v.agree(*same, exact=False)
    assert not v.agree(same[0], Answer("b", one_ulp, "q8", label), exact=False)
    other = label.replace("AVX512", "AVX2")
    assert v.agree(same[0], Answer("b", one_ulp, "q8", other), exact=False), "two CPU kinds"
    assert v.agree(Answer("a", REF, "q8"), Answer("b", one_ulp, "q8"), exact=False), "no label"
    far = Answer("b", REF * 1.01, "q8", other)
    assert not v.agree(same[0], far, exact=False), "beyond float32's tolerance"


def test_sampling_skips_checks_once_trusted_and_off_never_checks() -> None:
    v, _, _ = _verifier(policy=TrustPolicy(full_checks=2, decay=0.5, p_min=0.05))
    local = Recompute()
    verdicts = [v.judge("w", REF.clone(), "float32", local)[1] for _ in range(400)]
    assert verdicts[:2] == [Verdict.VERIFIED] * 2, "the full-check phase"
    share = local.calls / 400
    assert 0.03 < share < 0.12, share  # p_min = 5% plus the short decay
    off, _, _ = _verifier("off")
    local = Recompute()
    assert off.judge("w", REF.clone(), "float32", local)[1] is Verdict.USED and local.calls == 0
