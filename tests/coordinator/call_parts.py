"""A layer call and its parts, built for unit tests: a real `Mailbox`, `Placement`, `Verifier`
and `LayerCall`, with a routing view, a board and results streams that tests fill in."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvq import wire
from kvq.bus.memory_board import MemoryBoard
from kvq.bus.records import DispatchCounters
from kvq.coordinator.layer_call import CallParts, LayerCall, Tally
from kvq.coordinator.mailbox import Mailbox
from kvq.coordinator.pending import Pending
from kvq.coordinator.placement import Placement
from kvq.coordinator.trust import Trust, TrustPolicy
from kvq.coordinator.verify import Verifier
from kvq.keys import Keys

H = 4


@dataclass
class Posted:
    """Stands for the board's `send_jobs` and the results streams: what was sent, to whom."""

    sent: list[str] = field(default_factory=list)

    def send_jobs(self, jobs: list[tuple[str, Any]]) -> None:
        self.sent.extend(w for w, _ in jobs)

    def key(self, worker: str) -> str:
        return f"{worker}-results"

    def watch(self, workers: Any) -> None:
        pass

    def read(self, count: int, block_ms: int | None) -> list[Any]:
        return []  # results are fed with `Mailbox.take`


def make_call(
    routing: Any,
    *,
    has_experts: bool,
    verify: str = "off",
    dtype: str = "float32",
    job_deadline_ms: int = 1000,
) -> tuple[LayerCall, MemoryBoard, Posted]:
    """A call of layer 0 over 2 rows waiting for job `j1` (slice A) sent to `routing`'s first
    holder of A; `routing` needs `holders` and what the test's path calls on it."""
    board, posted = MemoryBoard(), Posted()
    stats = DispatchCounters()
    trust = Trust(TrustPolicy(), "c1", rng=random.Random(0))
    verifier = Verifier(board, "m", trust, verify, dtype, stats)
    verifier.on_caught = lambda w: None
    settings = SimpleNamespace(
        verify_remote=verify, job_deadline_ms=job_deadline_ms, replica_wait_s=5.0
    )
    info = SimpleNamespace(model="m", meta=SimpleNamespace(moe_layers=[]))
    placement = Placement(routing, info, settings, has_experts, stats)  # type: ignore[arg-type]
    mailbox = Mailbox(
        posted,
        None,
        Keys("t"),
        "c1",
        lambda: routing.holders,
        stats,  # type: ignore[arg-type]
        results=posted,
    )  # type: ignore[arg-type]
    parts = CallParts(
        "m",
        settings,
        placement,
        routing,
        mailbox,
        verifier,
        None,  # type: ignore[arg-type]
        Tally(stats=stats),
    )
    ids = torch.zeros(2, 1, dtype=torch.int64)  # [T, k]: each row one pair inside slice A
    call = LayerCall(parts, 0, torch.zeros(2, H), ids, torch.ones(2, 1))
    call.masks["A"] = torch.ones(2, 1, dtype=torch.bool)
    job = wire.Job(
        job_id="j",
        model="m",
        layer=0,
        slice="A",
        expert_start=0,
        expert_end=1,
        coord="c1",
        reply_to="r",
        deadline_ms=0,
        x=wire.Tensor.of(np.zeros((2, H), np.float32)),
        ids=wire.Tensor.of(np.zeros((2, 1), np.int32)),
        weights=wire.Tensor.of(np.ones((2, 1), np.float32)),
    )
    call._job = lambda job_id, spec, rows, worker: job  # type: ignore[method-assign]
    first = next(w for w, sids in routing.holders.items() if "A" in sids)
    p = Pending(
        SimpleNamespace(sid="A"), torch.tensor([0, 1]), first, time.monotonic(), 0.0, pairs=2
    )  # type: ignore[arg-type]
    call.pending = {"j1": p}
    mailbox.expect("j1", p, call)
    return call, board, posted


def fields_of(res: wire.Result) -> dict[bytes, bytes]:
    return {k.encode() if isinstance(k, str) else k: v for k, v in wire.encode(res).items()}


def arrive(call: LayerCall, sender: str, res: wire.Result, eid: bytes = b"1-0") -> None:
    """`res` read from `sender`'s results stream, then collected by the call."""
    mailbox = call.parts.mailbox
    mailbox.take(sender, f"{sender}-results", eid, fields_of(res))
    call.receive(mailbox.collect(call, None))
