"""Results are attributed by the stream they arrive in, never by the `worker` field they carry:
the mailbox sorts what it reads, and a layer call collects only what its jobs got."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from call_parts import H, Posted, arrive, make_call

from kvq import wire
from kvq.bus.records import DispatchCounters
from kvq.coordinator.layer_call import LayerCall
from kvq.coordinator.mailbox import Mailbox
from kvq.coordinator.pending import Pending
from kvq.keys import Keys


def _call(has_experts: bool = False) -> tuple[LayerCall, Any]:
    """A layer call waiting for job `j1`, sent to w0 (slice A); w1 holds B, w2 holds A too."""
    seen: list[str] = []
    failed: list[str] = []
    routing = SimpleNamespace(
        holders={"w0": frozenset("A"), "w1": frozenset("B"), "w2": frozenset("A")},
        observe_result=lambda worker, *a, **kw: seen.append(worker),
        observe_failure=lambda worker, *a: failed.append(worker),
        observe_local=lambda *a: None,
        failed=failed,
        live_holders=lambda sid: [],
        refresh=lambda force=False: None,
        refresh_s=0.01,
    )
    call, board, _ = make_call(routing, has_experts=has_experts)
    d = SimpleNamespace(
        stats=call.stats, per_worker=call.parts.tally.per_worker, board=board, routing=routing
    )
    return call, d


def _result(claims: str) -> wire.Result:
    y = wire.Tensor.of(np.ones((2, H), dtype=np.float32))
    return wire.Result(job_id="j1", worker=claims, y=y, compute_ms=1.0)


def test_a_result_from_another_workers_stream_is_dropped_whatever_it_claims() -> None:
    call, d = _call(has_experts=True)
    arrive(call, "w1", _result(claims="w0"))  # w1 holds another slice
    assert d.stats.foreign_results == 1 and "j1" in call.pending and not call.partials
    arrive(call, "w0", _result(claims="w0"))  # still waited for: the real answer counts
    assert d.stats.remote_jobs == 1 and d.per_worker == {"w0": 1} and call.pending == {}


def test_the_worker_it_was_sent_to_is_credited() -> None:
    call, d = _call(has_experts=True)
    arrive(call, "w0", _result(claims="someone-else"))
    assert d.stats.remote_jobs == 1 and d.per_worker == {"w0": 1} and "A" in call.partials
    assert call.pending == {}
    arrive(call, "w0", _result(claims="w0"), b"2-0")  # a duplicate
    assert d.stats.late_results == 1 and d.stats.remote_jobs == 1


def test_a_peer_of_the_slice_answering_a_moved_job_is_credited_as_itself() -> None:
    call, d = _call(has_experts=True)
    arrive(call, "w2", _result(claims="w0"))  # the monitor moved j1 from w0 to w2
    assert d.stats.remote_jobs == 1 and d.per_worker == {"w2": 1}


def test_a_lie_is_blamed_on_the_stream_it_arrived_in() -> None:
    """Issue 11: a NaN answer from the peer the job was moved to quarantines the peer, not
    the worker the job was first sent to (whatever the result claims)."""
    call, d = _call(has_experts=True)
    call.local = lambda spec, rows: torch.zeros(2, H)  # type: ignore[method-assign]
    nan = wire.Tensor.of(np.full((2, H), np.nan, dtype=np.float32))
    arrive(call, "w2", wire.Result(job_id="j1", worker="w0", y=nan))
    assert list(d.board.quarantined("m")) == ["w2"] and d.stats.nonfinite_results == 1
    assert torch.equal(call.partials["A"], torch.zeros(2, H)) and d.per_worker == {}


def test_a_peer_s_failed_answer_counts_against_the_peer_not_the_worker_it_was_sent_to() -> None:
    """Issue 32: failures of a job answered by a peer were counted against the honest worker
    the job was first sent to."""
    call, d = _call(has_experts=True)
    call.local = lambda spec, rows: torch.zeros(2, H)  # type: ignore[method-assign]
    failure = wire.Failure(type="BadJob", message="no")
    arrive(call, "w2", wire.Result(job_id="j1", worker="w0", error=failure))
    assert d.routing.failed == ["w2"] and d.stats.remote_errors == 1


def test_a_result_read_by_another_call_is_kept_for_its_own() -> None:
    """Micro-batches: a call's read brings another call's result; the mailbox keeps it for
    that call, which collects it without reading again."""
    call, d = _call(has_experts=True)
    other = object()
    mailbox = call.parts.mailbox
    mailbox.expect(
        "j2",
        Pending(SimpleNamespace(sid="A"), torch.tensor([0]), "w0", 0.0, 0.0),  # type: ignore[arg-type]
        other,
    )
    j2 = wire.Result(job_id="j2", worker="w0", y=wire.Tensor.of(np.ones((1, H), np.float32)))
    mailbox.take("w0", "w0-results", b"1-0", {k.encode(): v for k, v in wire.encode(j2).items()})
    assert mailbox.collect(call, None) == [], "not this call's"
    (got,) = mailbox.collect(other, None)
    assert got.job_id == "j2" and got.sender == "w0" and mailbox.collect(other, None) == []


def test_job_ids_are_tokens_no_worker_can_guess() -> None:
    """A job id is `C:N:TOKEN` with 64 random bits: a peer of the slice that reads only its own
    inbox cannot name a job sent to its neighbour (and so cannot answer it)."""
    posted = Posted()
    mailbox = Mailbox(posted, None, Keys("t"), "c1", dict, DispatchCounters(), results=posted)  # type: ignore[arg-type]
    ids = [mailbox.next_job_id() for _ in range(1000)]
    assert len({i.rsplit(":", 1)[1] for i in ids}) == 1000
    assert all(re.fullmatch(r"c1:\d+:[0-9a-f]{16}", i) for i in ids)
