"""A coordinator without experts (a backbone file) checks a worker's result by the same job's
result from another holder of the slice (issue 32 item 5): two that agree are used and both
credited; on disagreement a third holder decides and the outvoted worker is quarantined; with
nobody left to ask, no answer is used and the job goes out again. The real dispatcher and layer
call, with the workers' answers fed in as their results streams would."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from call_parts import arrive, make_call

from kvq import wire
from kvq.coordinator.layer_call import LayerCall

H = 4
TRUE = np.arange(2 * H, dtype=np.float32).reshape(2, H)


def _call(holders: list[str], dtype: str = "q8") -> tuple[LayerCall, Any, list[str]]:
    """A backbone-only layer call waiting for job `j1` (slice A, sent to `holders[0]`); every
    worker of `holders` serves A; every result is drawn for a check (KVQ_VERIFY_REMOTE=all).
    Returns the call, a view of its counters and board, and the workers jobs were sent to."""
    box: dict[str, Any] = {}
    routing = SimpleNamespace(
        holders={w: frozenset("A") for w in holders},
        live_holders=lambda sid: [w for w in holders if not box["verifier"].barred(w)],
        observe_result=lambda *a, **kw: None,
        observe_failure=lambda *a: None,
        refresh_s=0.01,
        refresh=lambda force=False: None,
    )
    call, board, posted = make_call(routing, has_experts=False, verify="all", dtype=dtype)
    box["verifier"] = call.parts.verifier
    d = SimpleNamespace(stats=call.stats, board=board, verifier=call.parts.verifier)
    return call, d, posted.sent


def _answer(call: LayerCall, worker: str, job_id: str, y: np.ndarray, dtype: str = "q8") -> None:
    res = wire.Result(job_id=job_id, worker=worker, y=wire.Tensor.of(y), dtype=dtype)  # type: ignore[arg-type]
    arrive(call, worker, res)


def _only_pending(call: LayerCall) -> tuple[str, str]:
    ((job_id, p),) = call.pending.items()
    return job_id, p.worker


def test_two_holders_that_agree_are_used_and_both_credited() -> None:
    call, d, sent = _call(["w0", "w1"])
    _answer(call, "w0", "j1", TRUE)
    job_id, witness = _only_pending(call)
    assert witness == "w1" and sent == ["w1"] and not call.partials, "waits for the witness"
    _answer(call, "w1", job_id, TRUE.copy())
    assert torch.equal(call.partials["A"], torch.from_numpy(TRUE)) and call.pending == {}
    assert d.stats.verified == 1 and d.stats.witness_jobs == 1 and d.stats.mismatches == 0
    assert d.verifier.trust.workers["w0"].ok == 1 and d.verifier.trust.workers["w1"].ok == 1


def test_a_liar_is_outvoted_by_a_third_holder_and_quarantined() -> None:
    for liar in ("w0", "w1"):  # first to answer, or the first witness
        call, d, sent = _call(["w0", "w1", "w2"])
        y = {"w0": TRUE, "w1": TRUE, "w2": TRUE} | {liar: TRUE * 1.01}
        _answer(call, "w0", "j1", y["w0"])
        job_id, witness = _only_pending(call)
        _answer(call, witness, job_id, y[witness])
        job_id, third = _only_pending(call)
        assert third == "w2" and sent == ["w1", "w2"]
        _answer(call, "w2", job_id, y["w2"])
        assert torch.equal(call.partials["A"], torch.from_numpy(TRUE)), "the majority's answer"
        assert list(d.board.quarantined("m")) == [liar] and d.stats.mismatches == 1


def test_two_that_disagree_with_nobody_left_use_neither_and_send_the_job_again() -> None:
    call, d, sent = _call(["w0", "w1"])
    _answer(call, "w0", "j1", TRUE)
    job_id, _ = _only_pending(call)
    _answer(call, "w1", job_id, TRUE + 1)
    assert not call.partials and d.stats.unresolved == 1 and d.board.quarantined("m") == {}
    job_id, again = _only_pending(call)
    assert again in ("w0", "w1") and len(sent) == 2, "sent again: it waits, never a wrong token"


def test_a_lone_holder_s_result_is_used_unconfirmed() -> None:
    call, d, sent = _call(["w0"])
    _answer(call, "w0", "j1", TRUE)
    assert torch.equal(call.partials["A"], torch.from_numpy(TRUE)) and sent == []
    assert d.stats.unwitnessed == 1 and d.stats.verified == 0
