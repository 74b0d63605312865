"""Results are attributed by the stream they arrive in, never by the `worker` field they carry."""

from __future__ import annotations

import itertools
import random
import re
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvq import wire
from kvq.bus.histogram import Histogram
from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import DispatchCounters
from kvq.coordinator.dispatch import Dispatcher
from kvq.coordinator.layer_call import LayerCall
from kvq.coordinator.pending import Pending
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.coordinator.verify import Verifier

H = 4


def _call() -> tuple[LayerCall, Any]:
    """A layer call waiting for job `j1`, sent to w0 (slice A); w1 holds B, w2 holds A too.
    Results reach it through the dispatcher (`Dispatcher.accept`), which finds the owner."""
    seen: list[str] = []
    failed: list[str] = []
    routing = SimpleNamespace(
        holders={"w0": frozenset("A"), "w1": frozenset("B"), "w2": frozenset("A")},
        observe_result=lambda worker, *a, **kw: seen.append(worker),
        observe_failure=lambda worker, *a: failed.append(worker),
        failed=failed,
    )
    stats = DispatchCounters()
    board = MemoryBoard()
    trust = Trust(TrustPolicy(), "c", rng=random.Random(0))
    d = object.__new__(Dispatcher)
    d.shadows, d.routing, d.stats, d.job_rtt, d.per_worker = {}, routing, stats, Histogram(), {}  # type: ignore[assignment]
    d.s, d.board = SimpleNamespace(verify_remote="off", job_deadline_ms=1000), board  # type: ignore[assignment]
    d.verifier = Verifier(board, "m", trust, "off", "float32", stats)
    call = object.__new__(LayerCall)
    call.d, call.x, call.partials = d, torch.zeros(2, H), {}
    rows = torch.tensor([0, 1])
    call.pending = {"j1": Pending(SimpleNamespace(sid="A"), rows, "w0", time.monotonic(), 0.0)}  # type: ignore[arg-type]
    d.inflight = {"j1": call}
    return call, d


def _result(claims: str) -> dict[bytes, bytes]:
    y = wire.Tensor.of(np.ones((2, H), dtype=np.float32))
    fields = wire.encode(wire.Result(job_id="j1", worker=claims, y=y, compute_ms=1.0))
    return {k.encode() if isinstance(k, str) else k: v for k, v in fields.items()}


def test_a_result_from_another_workers_stream_is_dropped_whatever_it_claims() -> None:
    call, d = _call()
    d.accept("w1", "s1", b"1-0", _result(claims="w0"))  # w1 holds another slice
    assert d.stats.foreign_results == 1 and "j1" in call.pending and not call.partials
    assert d.inflight == {"j1": call}, "still waited for: the real answer may come"


def test_the_worker_it_was_sent_to_is_credited() -> None:
    call, d = _call()
    d.accept("w0", "s0", b"1-0", _result(claims="someone-else"))
    assert d.stats.remote_jobs == 1 and d.per_worker == {"w0": 1} and "A" in call.partials
    assert d.inflight == {} and call.pending == {}
    d.accept("w0", "s0", b"2-0", _result(claims="w0"))  # a duplicate
    assert d.stats.late_results == 1 and d.stats.remote_jobs == 1


def test_a_peer_of_the_slice_answering_a_moved_job_is_credited_as_itself() -> None:
    call, d = _call()
    d.accept("w2", "s2", b"1-0", _result(claims="w0"))  # the monitor moved j1 from w0 to w2
    assert d.stats.remote_jobs == 1 and d.per_worker == {"w2": 1}


def test_a_lie_is_blamed_on_the_stream_it_arrived_in() -> None:
    """Issue 11: a NaN answer from the peer the job was moved to quarantines the peer, not
    the worker the job was first sent to (whatever the result claims)."""
    call, d = _call()
    call.local = lambda spec, rows: torch.zeros(2, H)  # type: ignore[method-assign]
    fields = wire.encode(wire.Result(
        job_id="j1", worker="w0", y=wire.Tensor.of(np.full((2, H), np.nan, dtype=np.float32)),
    ))  # fmt: skip
    d.accept("w2", "s2", b"1-0", {k.encode() if isinstance(k, str) else k: v
                                      for k, v in fields.items()})  # fmt: skip
    assert list(d.board.quarantined("m")) == ["w2"] and d.stats.nonfinite_results == 1
    assert torch.equal(call.partials["A"], torch.zeros(2, H)) and d.per_worker == {}


def test_a_peer_s_failed_answer_counts_against_the_peer_not_the_worker_it_was_sent_to() -> None:
    """Issue 32: failures of a job answered by a peer were counted against the honest worker
    the job was first sent to."""
    call, d = _call()
    call.local = lambda spec, rows: torch.zeros(2, H)  # type: ignore[method-assign]
    d.has_experts = True
    fields = wire.encode(wire.Result(job_id="j1", worker="w0",
                                     error=wire.Failure(type="BadJob", message="no")))  # fmt: skip
    d.accept("w2", "s2", b"1-0", {k.encode() if isinstance(k, str) else k: v
                                      for k, v in fields.items()})  # fmt: skip
    assert d.routing.failed == ["w2"] and d.stats.remote_errors == 1


def test_job_ids_are_tokens_no_worker_can_guess() -> None:
    """A job id is `C:N:TOKEN` with 64 random bits: a peer of the slice that reads only its own
    inbox cannot name a job sent to its neighbour (and so cannot answer it)."""
    d = object.__new__(Dispatcher)
    d.coord, d._seq = "c1", itertools.count()
    ids = [d.next_job_id() for _ in range(1000)]
    assert len({i.rsplit(":", 1)[1] for i in ids}) == 1000
    assert all(re.fullmatch(r"c1:\d+:[0-9a-f]{16}", i) for i in ids)
